"""FlashInfer paged decode over sink + selected pages + window, one "request" per KV head.

FlashInfer's paged decode has one page table per request, shared by the request's KV heads;
IceCache selects different pages for every KV head. The per-head tables come from folding the
KV head into the page axis (docs/ARCHITECTURE.md, section Attend): each IceCache layer keeps
all its device tokens of one kind (K or V) in one contiguous buffer ``[B, H_kv, T, D]`` (``T`` = page-pool slots x page
size + sink + window), viewed without a copy in HND layout as ``[B*H_kv*T, 1, 1, D]``: token
``t`` of KV head ``h`` of sequence ``b`` is folded page ``(b*H_kv + h)*T + t``. The batch is
``B*H_kv`` requests with ``num_kv_heads = 1`` and ``num_qo_heads = G`` (the GQA group), so the
query ``[B, H_kv*G, D]`` is viewed as ``[B*H_kv, G, D]``.

Partially filled pages. Semantic pages are not full (a page holds the keys its index cell
holds), and the sink and window parts are partly filled too, while FlashInfer allows a partial
page only at the end of a request. Compacting tokens into full pages on the device would cost a
gather kernel per layer and step; a masked kernel does not exist in the decode path. Instead
the fold uses **page size 1**: every valid token is its own page, and a request's index list
names exactly the valid tokens (sink, then each selected page's first ``len`` slots, then the
window). Empty slots are never read, so any fill pattern is exact. The lists are built on the
host, where the selection and the page lengths already are, and travel with the step's other
small metadata in the same host-to-device copy; the kernel reads one 4-byte index per 256-byte
key row, which costs nothing measurable at a few hundred tokens.

Planning. FlashInfer's ``plan`` costs ~140 us of host time on the H200, too much per layer.
The plan only decides how to split each request's KV across thread blocks; it is made here once
per (batch, heads, dim, dtype, scale), with one page per request, which selects the non-split
kernel: one thread block per request walks the request's whole index list, whose length the
kernel reads on the device from ``indptr``. So one plan serves every layer and step, and each
layer only points the wrapper at its own ``indptr``/``indices`` device tensors. A few hundred
tokens per request do not need a split (the kernel is short either way); with ``B*H_kv``
requests of several thousand tokens, splitting would pay again.

FlashInfer is optional (``pip install icecache[gpu]``); :func:`available` says whether it can
be used, and the pure-torch :func:`icecache.attend.sparse_decode_attention` is the reference
and the fallback.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from icecache import _core

__all__ = ["available", "supports", "token_lists", "FlashInferDecode"]

_HEAD_DIMS = (64, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16)
_WORKSPACE_BYTES = 16 << 20


def available() -> bool:
    """Whether FlashInfer is importable and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import
        return False
    return True


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the FlashInfer path serves this device, storage dtype and head dim."""
    return device.type == "cuda" and dtype in _DTYPES and head_dim in _HEAD_DIMS


def token_lists(
    table: np.ndarray,
    page_len: np.ndarray,
    sink_len: np.ndarray,
    win_len: np.ndarray,
    pool_slots: int,
    page_size: int,
    sink_cap: int,
    win_cap: int,
) -> Tuple[np.ndarray, np.ndarray]:
    """Folded token indices of every (sequence, KV head) request, and their ``indptr``.

    Args:
        table: ``[B, H, M]`` pool slot of each selected page, ``-1`` for none.
        page_len: ``[B, H, M]`` valid tokens of each selected page.
        sink_len, win_len: ``[B]`` valid sink and window tokens.
        pool_slots, page_size, sink_cap, win_cap: the layer's buffer layout: per (sequence, KV
            head) ``pool_slots * page_size`` pool tokens, then ``sink_cap`` sink slots, then
            ``win_cap`` window slots.

    Returns:
        ``(indptr [B*H + 1], indices [indptr[-1]])``, int32: request ``b*H + h`` attends to the
        folded tokens ``indices[indptr[r]:indptr[r+1]]``.

    Raises:
        ValueError: shapes that do not match, or a slot or length outside the layout.
    """
    return _core.fold_token_lists(
        table,
        page_len,
        sink_len,
        win_len,
        pool_slots=pool_slots,
        page_size=page_size,
        sink_cap=sink_cap,
        win_cap=win_cap,
    )


class FlashInferDecode:
    """One FlashInfer decode wrapper, planned once and shared by the layers of one cache.

    Args:
        device: the CUDA device.
    """

    def __init__(self, device: torch.device):
        import flashinfer

        self.device = device
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, kv_layout="HND")
        self._planned: Optional[tuple] = None
        self.plans = 0  # how many times plan() ran (for tests and benchmarks)
        self._last_page_len: Optional[torch.Tensor] = None

    def _plan(self, requests: int, group: int, dim: int, dtype: torch.dtype, scale: float) -> None:
        key = (requests, group, dim, dtype, float(scale))
        if self._planned == key:
            return
        # One page per request: FlashInfer then picks the non-split kernel, which reads each
        # request's real length on the device (see the module docstring).
        ones = torch.ones(requests, dtype=torch.int32)
        self._wrapper.plan(
            torch.arange(requests + 1, dtype=torch.int32),
            torch.zeros(requests, dtype=torch.int32),
            ones,
            num_qo_heads=group,
            num_kv_heads=1,
            head_dim=dim,
            page_size=1,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=float(scale),
        )
        self._last_page_len = torch.ones(requests, dtype=torch.int32, device=self.device)
        self._planned = key
        self.plans += 1

    def run(
        self,
        query: torch.Tensor,
        kv_k: torch.Tensor,
        kv_v: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``query`` ``[B, H*G, D]`` over the tokens that ``indptr``/``indices``
        (device int32, from :func:`token_lists`) name in ``kv_k``/``kv_v`` ``[B, H, T, D]``
        (contiguous). Returns ``[B, H*G, D]`` in the query's dtype."""
        B, H, T, D = kv_k.shape
        Hq = query.shape[1]
        if Hq % H:
            raise ValueError(f"{Hq} query heads do not split into {H} KV heads")
        G = Hq // H
        self._plan(B * H, G, D, kv_k.dtype, scale)
        w = self._wrapper
        # Point the planned wrapper at this layer's token lists (same batch, same kernel).
        w._paged_kv_indptr_buf = indptr
        w._paged_kv_indices_buf = indices
        w._paged_kv_last_page_len_buf = self._last_page_len
        q = query.to(kv_k.dtype).reshape(B * H, G, D)
        out = w.run(q, (kv_k.view(B * H * T, 1, 1, D), kv_v.view(B * H * T, 1, 1, D)))
        return out.reshape(B, Hq, D).to(query.dtype)
