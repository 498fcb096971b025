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

Sink and window tokens are always attended. The attention itself is torch's scaled-dot-product
attention over the valid, kept tokens (its kernels keep logits and softmax in float32 whatever
the storage dtype); the ranking's logits are the storage dtype's, which only decides an order.
The output has the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["RankedAttention", "RankedAttentionGraph", "ranked_decode_attention"]

_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


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
        valid: ``[B, H, T]`` bool, slots that hold a token (the others may hold anything
            finite: they are masked out, not zeroed).
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
    # The group's query heads are the "query positions" of one KV head: [B, H, G, D].
    q = query.reshape(B, H, G, D).to(kv_k.dtype)
    if keep is None:
        if pages < pool_slots:
            # Ranking only needs the order of page masses: logits in the storage dtype will do.
            logits = torch.matmul(q, kv_k.transpose(-1, -2)).float().mul_(scale)
            logits.masked_fill_(~valid[:, :, None, :], float("-inf"))
            mass = torch.softmax(logits, dim=-1)[..., :P].reshape(B, H, G, pool_slots, page_size).sum((2, 4))
            top = mass.topk(pages, dim=-1).indices
            keep = torch.zeros(B, H, pool_slots, dtype=torch.bool, device=kv_k.device).scatter_(-1, top, True)
        else:
            keep = torch.ones(B, H, pool_slots, dtype=torch.bool, device=kv_k.device)
    elif keep.shape != (B, H, pool_slots):
        raise ValueError(f"keep must be [{B}, {H}, {pool_slots}], got {tuple(keep.shape)}")
    attended = valid.clone()
    attended[..., :P].view(B, H, pool_slots, page_size).logical_and_(keep[..., None])
    mask = attended[:, :, None, :]
    if kv_k.is_cuda:  # cuDNN's backend would plan anew for the mask; the others need no plan
        with sdpa_kernel(_BACKENDS):
            out = F.scaled_dot_product_attention(q, kv_k, kv_v, attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, kv_k, kv_v, attn_mask=mask, scale=scale)
    lse = None
    if want_lse:
        logits = torch.matmul(q.float(), kv_k.float().transpose(-1, -2)) * scale
        lse = torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=-1).reshape(B, Hq)
    return RankedAttention(out=out.reshape(B, Hq, D).to(query.dtype), kept=keep, lse=lse)


class RankedAttentionGraph:
    """:func:`ranked_decode_attention` of one layer (ranking mode) replayed from CUDA graphs.

    Eager, one decode step of a layer launches about fifteen small kernels, and on slow hosts
    their launches cost far more than their device time. The step's shapes never change (the
    layer's device buffers are fixed, and ``pages`` takes one of two values), so each ``pages``
    value is captured once into a CUDA graph over the layer's buffers and replayed: per step, one
    copy of the query into the graph's input and one replay. The graph also leaves the query as
    float32 for the host.

    Args:
        kv_k, kv_v, valid, pool_slots, page_size, scale: as for :func:`ranked_decode_attention`
            (the layer's persistent buffers; the graphs read them at replay).
        query_shape, query_dtype: of the step's query ``[B, H*G, D]``.
        pool: a CUDA graph memory pool to share between layers (``torch.cuda.graph_pool_handle``):
            layers replay in stream order, so they can share it.
    """

    def __init__(
        self,
        kv_k: torch.Tensor,
        kv_v: torch.Tensor,
        valid: torch.Tensor,
        *,
        pool_slots: int,
        page_size: int,
        scale: float,
        query_shape: tuple,
        query_dtype: torch.dtype,
        pool: Optional[tuple] = None,
    ):
        self._args = (kv_k, kv_v, valid)
        self._layout = dict(pool_slots=pool_slots, page_size=page_size, scale=scale)
        self._query = torch.zeros(query_shape, dtype=query_dtype, device=kv_k.device)
        self._pool = pool
        self._graphs: dict = {}

    def _run(self, pages: int):
        res = ranked_decode_attention(self._query, *self._args, pages=pages, **self._layout)
        return res.out, self._query.float()

    def _capture(self, pages: int):
        side = torch.cuda.Stream(self._query.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # library warm-up (workspaces, autotuning) outside the capture
                self._run(pages)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._run(pages)
        self._graphs[pages] = (graph, outputs)
        return self._graphs[pages]

    def __call__(self, query: torch.Tensor, pages: int):
        """``(out [B, H*G, D], query as float32)`` of this step; both stay valid until the next
        call with the same ``pages``."""
        self._query.copy_(query)
        graph, outputs = self._graphs.get(pages) or self._capture(pages)
        graph.replay()
        return outputs
