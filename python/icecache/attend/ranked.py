"""Decode attention over one IceCache layer's device tokens, with the page choice made there.

Each IceCache layer keeps its device tokens in two buffers, K and V together in each: a pool of
``C`` page slots of ``S`` tokens per (sequence, KV head), ``[2, B, H, C, S, D]``, and the dense
tokens that are always attended (the sink and the recent window), ``[2, B, H, L, D]``, each with
a mask saying which slots hold a token (semantic pages are partly filled anywhere, the window
is a ring).

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
    pool_kv: torch.Tensor,
    pool_valid: torch.Tensor,
    dense_kv: torch.Tensor,
    dense_valid: torch.Tensor,
    *,
    pages: int,
    scale: float,
    keep: Optional[torch.Tensor] = None,
    want_lse: bool = False,
) -> RankedAttention:
    """Attention of one query token per sequence over the dense tokens and chosen pool pages.

    Args:
        query: ``[B, H*G, D]``; query head ``j`` reads KV head ``j // G``.
        pool_kv: ``[2, B, H, C, S, D]`` K and V of the page pool (``C`` slots of ``S`` tokens).
        pool_valid: ``[B, H, C, S]`` bool, pool slots that hold a token.
        dense_kv: ``[2, B, H, L, D]`` K and V of the tokens that are always attended (sink and
            window).
        dense_valid: ``[B, H, L]`` bool, dense slots that hold a token. Invalid slots may hold
            anything finite: they are masked out, not zeroed.
        pages: most pool pages to attend per (sequence, KV head) when ranking.
        scale: logit scale (usually ``D ** -0.5``).
        keep: ``[B, H, C]`` bool, the pool slots to attend (no ranking); ``None``: rank the
            valid pool pages by group attention mass and keep the ``pages`` heaviest.
        want_lse: also return the log-sum-exp of the attended logits.

    Returns:
        A :class:`RankedAttention`. A sequence whose every slot is invalid gets NaN.
    """
    _, B, H, C, S, D = pool_kv.shape
    Hq = query.shape[1]
    if Hq % H:
        raise ValueError(f"{Hq} query heads do not split into {H} KV heads")
    if pool_valid.shape != (B, H, C, S) or dense_valid.shape != dense_kv.shape[1:4]:
        raise ValueError("pool_valid must be [B, H, C, S] and dense_valid [B, H, L], as the K/V parts")
    G, P = Hq // H, C * S
    # The group's query heads are the "query positions" of one KV head: [B, H, G, D].
    q = query.reshape(B, H, G, D).to(pool_kv.dtype)
    kv = torch.cat([pool_kv.view(2, B, H, P, D), dense_kv], dim=3)
    if keep is None:
        if pages < C:
            # Ranking only needs the order of page masses: logits in the storage dtype will do.
            valid = torch.cat([pool_valid.view(B, H, P), dense_valid], dim=2)
            logits = torch.matmul(q, kv[0].transpose(-1, -2)).float().mul_(scale)
            logits.masked_fill_(~valid[:, :, None, :], float("-inf"))
            mass = torch.softmax(logits, dim=-1)[..., :P].reshape(B, H, G, C, S).sum((2, 4))
            top = mass.topk(pages, dim=-1).indices
            keep = torch.zeros(B, H, C, dtype=torch.bool, device=pool_kv.device).scatter_(-1, top, True)
        else:
            keep = torch.ones(B, H, C, dtype=torch.bool, device=pool_kv.device)
    elif keep.shape != (B, H, C):
        raise ValueError(f"keep must be [{B}, {H}, {C}], got {tuple(keep.shape)}")
    mask = torch.cat([(pool_valid & keep[..., None]).view(B, H, P), dense_valid], dim=2)[:, :, None, :]
    if kv.is_cuda:  # cuDNN's backend would plan anew for the mask; the others need no plan
        with sdpa_kernel(_BACKENDS):
            out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale)
    lse = None
    if want_lse:
        logits = torch.matmul(q.float(), kv[0].float().transpose(-1, -2)) * scale
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
        pool_kv, pool_valid, dense_kv, dense_valid, scale: as for :func:`ranked_decode_attention`
            (the layer's persistent buffers; the graphs read them at replay).
        query_shape, query_dtype: of the step's query ``[B, H*G, D]``.
        pool: a CUDA graph memory pool to share between layers (``torch.cuda.graph_pool_handle``):
            layers replay in stream order, so they can share it.
    """

    def __init__(
        self,
        pool_kv: torch.Tensor,
        pool_valid: torch.Tensor,
        dense_kv: torch.Tensor,
        dense_valid: torch.Tensor,
        *,
        scale: float,
        query_shape: tuple,
        query_dtype: torch.dtype,
        pool: Optional[tuple] = None,
        host_query: Optional[torch.Tensor] = None,
        host_flag: Optional[torch.Tensor] = None,
        counter: Optional[torch.Tensor] = None,
    ):
        self._args = (pool_kv, pool_valid, dense_kv, dense_valid)
        self._handoff = (host_query, host_flag, counter) if host_query is not None else None
        self._scale = scale
        self._query = torch.zeros(query_shape, dtype=query_dtype, device=pool_kv.device)
        self._pool = pool
        self._graphs: dict = {}

    def _run(self, pages: int):
        res = ranked_decode_attention(self._query, *self._args, pages=pages, scale=self._scale)
        if self._handoff is not None:
            host_query, host_flag, counter = self._handoff
            host_query.copy_(self._query.float(), non_blocking=True)
            counter.add_(1)
            host_flag.copy_(counter, non_blocking=True)
        return res.out

    def _capture(self, pages: int):
        # The warm-up runs count too: put the counter back afterwards.
        before = None if self._handoff is None else self._handoff[2].clone()
        side = torch.cuda.Stream(self._query.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # library warm-up (workspaces, autotuning) outside the capture
                self._run(pages)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._run(pages)
        if before is not None:
            self._handoff[2].copy_(before)
        self._graphs[pages] = (graph, outputs)
        return self._graphs[pages]

    def __call__(self, query: torch.Tensor, pages: int) -> torch.Tensor:
        """This step's attention output ``[B, H*G, D]``; valid until the next call with the
        same ``pages``."""
        self._query.copy_(query)
        graph, outputs = self._graphs.get(pages) or self._capture(pages)
        graph.replay()
        return outputs
