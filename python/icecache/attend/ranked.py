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
- ``adaptive``: the same ranking, but the sequence's ``H * pages`` pages are shared among its
  KV heads: each page's group mass is divided by its head's mass over all its pool pages, and
  the pages with the largest such shares of all heads are kept (over the candidates: the pool,
  or ``keep``'s pages when given). A head whose pool mass is spread over many pages gets more
  pages, a peaked head fewer. Shares, not raw masses: ranking by raw mass gives most pages to
  the heads that attend the offloaded middle at all and starves the ones whose mass sits in the
  sink and window, which on real attention (benches/RESULTS.md) raised the mean recall but
  lowered the middle's; shares raised both. The device memory and the tokens attended per
  sequence stay those of ``pages`` per head.

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

__all__ = ["RankedAttention", "ranked_decode_attention"]

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
    adaptive: bool = False,
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
        pages: most pool pages to attend per (sequence, KV head) when ranking (with
            ``adaptive``: on average over the sequence's KV heads).
        scale: logit scale (usually ``D ** -0.5``).
        keep: ``[B, H, C]`` bool, the pool slots to attend (no ranking); ``None``: rank the
            valid pool pages by group attention mass and keep the ``pages`` heaviest.
        adaptive: rank and share ``H * pages`` pages per sequence among its KV heads (see the
            module docs); the candidates are ``keep``'s pages when it is given, else the pool.
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
    if keep is not None and keep.shape != (B, H, C):
        raise ValueError(f"keep must be [{B}, {H}, {C}], got {tuple(keep.shape)}")
    if pages >= C:
        keep = torch.ones(B, H, C, dtype=torch.bool, device=pool_kv.device) if keep is None else keep
    elif keep is None or adaptive:
        # Ranking only needs the order of page masses: logits in the storage dtype will do.
        valid = torch.cat([pool_valid.view(B, H, P), dense_valid], dim=2)
        logits = torch.matmul(q, kv[0].transpose(-1, -2)).float().mul_(scale)
        logits.masked_fill_(~valid[:, :, None, :], float("-inf"))
        mass = torch.softmax(logits, dim=-1)[..., :P].reshape(B, H, G, C, S).sum((2, 4))
        if adaptive:
            mass = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
        if keep is not None:  # only the given candidates compete (masses are >= 0)
            mass = mass.masked_fill(~keep, -1.0)
        # Fixed: each head's top ``pages``; adaptive: the sequence's top ``H * pages`` of all heads.
        ranked, n = (mass.view(B, H * C), H * pages) if adaptive else (mass, pages)
        chosen = torch.zeros_like(ranked, dtype=torch.bool).scatter_(-1, ranked.topk(n, dim=-1).indices, True)
        chosen = chosen.view(B, H, C)
        keep = chosen if keep is None else chosen & keep
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
