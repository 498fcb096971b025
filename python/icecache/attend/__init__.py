"""Attention backends for IceCache's decode step.

A decode step attends one query token per sequence to three parts of the KV cache: the sink
tokens and the recent-window tokens, which stay on the device as dense per-sequence buffers,
and the retrieved semantic pages, which live in a device page pool and are addressed through a
per-(sequence, KV head) page table. Semantic pages need not be full, so every selected page
carries its own valid length.

:mod:`icecache.attend.reference` is the pure-torch implementation (CPU and GPU), exact over the
selected tokens; faster kernels must match it. :mod:`icecache.attend.flashinfer` runs the same
attention through FlashInfer's paged decode on CUDA (optional: ``icecache[gpu]``); it imports
FlashInfer only when used (``IceCacheConfig.attention``).
"""

from icecache.attend.reference import attention_recall, sparse_decode_attention

__all__ = ["attention_recall", "sparse_decode_attention"]
