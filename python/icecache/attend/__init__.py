"""Attention for IceCache's decode step.

A decode step attends one query token per sequence to three parts of the KV cache, all on the
device in one buffer per layer: the sink tokens, the recent window, and the pages of the device
page pool (semantic pages, each with its own valid length).

- :mod:`icecache.attend.ranked`: what the runtime runs: logits against every valid device
  token, the pool's pages ranked on the device by their attention mass (or the host's
  selection), softmax and output from the same logits.
- :mod:`icecache.attend.full`: one query token over a full-cache layer's whole storage under a
  mask of its written positions (the step graph's full-cache layers).
- :mod:`icecache.attend.chunk`: a prompt chunk's exact attention over the tokens before it.
- :mod:`icecache.attend.reference`: plain-torch references over explicitly listed pages, and the
  attention recall of a page selection (tests and evaluation).
"""

from icecache.attend.ranked import RankedAttention, ranked_decode_attention
from icecache.attend.reference import attention_recall, sparse_decode_attention

__all__ = [
    "RankedAttention",
    "attention_recall",
    "ranked_decode_attention",
    "sparse_decode_attention",
]
