"""Decode attention over one IceCache layer's device tokens, with the page choice made there.

Each IceCache layer keeps all its device tokens of one kind (K or V) in one buffer
``[B, H, T, D]``: a pool of ``C`` page slots of ``S`` tokens (``T`` starts with ``C * S`` pool
tokens), then the sink, then the recent window, with a ``valid`` mask ``[B, H, T]`` saying
which slots hold a token (semantic pages are partly filled anywhere, the window is a ring).

One decode step computes the logits of the step's queries against every valid device token
(a few hundred to a thousand per KV head: cheap on any device). The budget then picks which
pool pages enter the softmax:

- ``keep`` given (fresh selection): exactly the slots the host selected;
- ``keep`` absent (look-ahead): the pool holds a superset of pages selected a step earlier;
  they are ranked here by their exact attention mass under the current queries, summed over the
  KV head's query group (each query head's softmax over the valid tokens counts equally), and
  the ``pages`` heaviest are kept. The host never waits for this step's queries.

Sink and window tokens are always attended. The softmax and the output then reuse the same
logits, so choosing and attending cost one pass over the device tokens. Logits and softmax are
float32 whatever the storage dtype; the output has the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["RankedAttention", "ranked_decode_attention"]


@dataclass
class RankedAttention:
    """Result of :func:`ranked_decode_attention`.

    Attributes:
        out: ``[B, H*G, D]`` attention output, in the query's dtype.
        kept: ``[B, H, C]`` bool: the pool slots that entered the softmax.
        lse: ``[B, H*G]`` float32 log-sum-exp of the attended logits (only with
            ``want_lse=True``; for recall measurements).
    """

    out: torch.Tensor
    kept: torch.Tensor
    lse: Optional[torch.Tensor] = None


def ranked_decode_attention(
    query: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    valid: torch.Tensor,
    *,
    pool_slots: int,
    page_size: int,
    pages: int,
    scale: float,
    keep: Optional[torch.Tensor] = None,
    want_lse: bool = False,
) -> RankedAttention:
    """Attention of one query token per sequence over sink + window + chosen pool pages.

    Args:
        query: ``[B, H*G, D]``; query head ``j`` reads KV head ``j // G``.
        kv_k, kv_v: ``[B, H, T, D]`` device tokens; the first ``pool_slots * page_size`` are
            the page pool.
        valid: ``[B, H, T]`` bool, slots that hold a token.
        pool_slots, page_size: the pool's layout.
        pages: most pool pages to attend per (sequence, KV head) when ranking.
        scale: logit scale (usually ``D ** -0.5``).
        keep: ``[B, H, pool_slots]`` bool, the pool slots to attend (no ranking); ``None``:
            rank the valid pool pages by group attention mass and keep the ``pages`` heaviest.
        want_lse: also return the log-sum-exp of the attended logits.

    Returns:
        A :class:`RankedAttention`. A sequence whose every slot is invalid gets NaN.
    """
    B, H, T, D = kv_k.shape
    Hq = query.shape[1]
    if Hq % H:
        raise ValueError(f"{Hq} query heads do not split into {H} KV heads")
    P = pool_slots * page_size
    if P > T or valid.shape != (B, H, T):
        raise ValueError(f"valid must be [{B}, {H}, {T}] and the pool ({P} tokens) inside T = {T}")
    G = Hq // H
    q = query.reshape(B, H, G, D).to(kv_k.dtype)
    logits = torch.matmul(q, kv_k.transpose(-1, -2)).float().mul_(scale)  # [B, H, G, T]
    logits.masked_fill_(~valid[:, :, None, :], float("-inf"))
    pool_logits = logits[..., :P].view(B, H, G, pool_slots, page_size)
    if keep is None:
        if pages < pool_slots:
            mass = torch.softmax(logits, dim=-1)[..., :P].reshape(B, H, G, pool_slots, page_size).sum((2, 4))
            top = mass.topk(pages, dim=-1).indices
            keep = torch.zeros(B, H, pool_slots, dtype=torch.bool, device=kv_k.device).scatter_(-1, top, True)
        else:
            keep = torch.ones(B, H, pool_slots, dtype=torch.bool, device=kv_k.device)
    else:
        if keep.shape != (B, H, pool_slots):
            raise ValueError(f"keep must be [{B}, {H}, {pool_slots}], got {tuple(keep.shape)}")
    pool_logits.masked_fill_(~keep[:, :, None, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(kv_v.dtype), kv_v).reshape(B, Hq, D).to(query.dtype)
    lse = torch.logsumexp(logits, dim=-1).reshape(B, Hq) if want_lse else None
    return RankedAttention(out=out, kept=keep, lse=lse)
