"""Pure-torch decode attention over sink + selected pages + window, and its recall.

Shapes (``B`` sequences, ``H`` KV heads, ``G`` query heads per KV head, ``D`` head dim):

- ``query``: ``[B, H * G, D]``, query head ``j`` reads KV head ``j // G`` (GQA).
- dense parts (sink, window): ``[B, H, L, D]`` with a valid length per sequence ``[B]``;
  slots at or past the length are ignored (left padding, a short prompt, a window that is
  not full yet).
- pages: a pool ``[B, H, C, S, D]`` of ``C`` device page slots of ``S`` tokens, a table
  ``[B, H, M]`` of pool slots (``-1``: no page) and each selected page's valid length
  ``[B, H, M]`` (tokens fill slots ``0 .. length - 1`` of a page).

Logits and softmax are computed in float32 whatever the storage dtype.
"""

from __future__ import annotations

import torch

__all__ = ["sparse_decode_attention", "attention_recall"]


def _gather_pages(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Pool pages named by ``table`` (``-1`` reads slot 0, masked later): ``[B, H, M * S, D]``."""
    B, H, _, S, D = pool.shape
    b = torch.arange(B, device=pool.device)[:, None, None]
    h = torch.arange(H, device=pool.device)[None, :, None]
    return pool[b, h, table.clamp(min=0).long()].reshape(B, H, table.shape[2] * S, D)


def _valid_slots(sink_len, sink_cap, page_len, table, page_size, win_len, win_cap) -> torch.Tensor:
    """``[B, H, Ls + M*S + Lw]`` bool: which slots of sink, selected pages and window hold a
    token. Each slot is compared with the length of the part (sink, page m, window) it is in."""
    B, H, M = table.shape
    dev = table.device
    lengths = torch.cat(
        [
            sink_len.view(B, 1, 1).expand(B, H, 1),
            torch.where(table >= 0, page_len, 0),
            win_len.view(B, 1, 1).expand(B, H, 1),
        ],
        dim=2,
    ).long()  # [B, H, M + 2]
    sizes = torch.tensor([sink_cap] + [page_size] * M + [win_cap], device=dev)
    part = torch.repeat_interleave(torch.arange(M + 2, device=dev), sizes)
    slot = torch.arange(part.numel(), device=dev) - (torch.cumsum(sizes, 0) - sizes)[part]
    return slot < lengths[:, :, part]


def sparse_decode_attention(
    query: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    sink_len: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    table: torch.Tensor,
    page_len: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Exact softmax attention of one query token over sink, selected pages and window.

    Args:
        query: ``[B, H*G, D]``.
        sink_k, sink_v: ``[B, H, Ls, D]``; ``sink_len``: ``[B]`` valid sink tokens.
        pool_k, pool_v: ``[B, H, C, S, D]`` device page pool.
        table: ``[B, H, M]`` pool slot of each selected page, ``-1`` past the selection.
        page_len: ``[B, H, M]`` valid tokens of each selected page.
        win_k, win_v: ``[B, H, Lw, D]``; ``win_len``: ``[B]`` valid window tokens.
        scale: logit scale (usually ``D ** -0.5``).

    Returns:
        ``[B, H*G, D]`` in ``query``'s dtype. A sequence with no valid token at all gets NaN.
    """
    B, Hq, D = query.shape
    H = sink_k.shape[1]
    if Hq % H:
        raise ValueError(f"{Hq} query heads do not split into {H} KV heads")
    valid = _valid_slots(sink_len, sink_k.shape[2], page_len, table, pool_k.shape[3], win_len, win_k.shape[2])
    empty = ~valid[..., None]
    # Empty slots may hold anything, even NaN: zero them so that masked terms stay 0.
    keys = torch.cat([sink_k, _gather_pages(pool_k, table), win_k], dim=2).float().masked_fill(empty, 0.0)
    values = torch.cat([sink_v, _gather_pages(pool_v, table), win_v], dim=2).float().masked_fill(empty, 0.0)
    q = query.reshape(B, H, Hq // H, D).float()
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, :, None, :], scale=scale)
    return out.reshape(B, Hq, D).to(query.dtype)


def attention_recall(
    query: torch.Tensor,
    dense_k: torch.Tensor,
    store_k: torch.Tensor,
    store_len: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Share of the full attention mass that a selection keeps, per query head.

    Full attention of one sequence's query over every token it has (the dense sink and window
    tokens plus all offloaded pages) is compared with attention restricted to the dense tokens
    and the selected pages: the result is the softmax mass of the kept tokens under the full
    attention, in ``[0, 1]`` (1: the selection is exact).

    Args:
        query: ``[H*G, D]``.
        dense_k: ``[H, L, D]`` the valid sink and window keys (always kept).
        store_k: ``[H, P, S, D]`` all offloaded pages.
        store_len: ``[H, P]`` valid tokens per page.
        selected: ``[H, M]`` selected page ids (``-1``: none).
        scale: logit scale.

    Returns:
        ``[H*G]`` float32 recall per query head.
    """
    H, P, S, D = store_k.shape
    q = query.reshape(H, -1, D).float()
    dense = torch.einsum("hgd,hld->hgl", q, dense_k.float()) * scale
    paged = torch.einsum("hgd,hpsd->hgps", q, store_k.float()) * scale
    occupied = torch.arange(S, device=store_k.device) < store_len[..., None]
    paged = paged.masked_fill(~occupied[:, None], float("-inf"))
    page_lse = torch.logsumexp(paged, dim=-1)  # [H, G, P]
    keep = torch.zeros(H, P, dtype=torch.bool, device=store_k.device)
    rows, cols = torch.nonzero(selected >= 0, as_tuple=True)
    keep[rows, selected[rows, cols].long()] = True
    dense_lse = torch.logsumexp(dense, dim=-1)  # [H, G]
    kept_pages = torch.logsumexp(page_lse.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    all_pages = torch.logsumexp(page_lse, dim=-1)
    kept = torch.logaddexp(dense_lse, kept_pages)
    total = torch.logaddexp(dense_lse, all_pages)
    return torch.exp(kept - total).reshape(-1)
