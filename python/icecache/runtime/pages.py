"""CPU side of the runtime: page stores and the per-sequence page index.

For every sequence and IceCache layer, the offloaded ("middle") tokens live in a
:class:`PageStore`, K and V laid out as semantic pages ``[H_kv, P, page_size, D]`` in ordinary
host memory (only the staging rows that pages are gathered into take part in DMA, see
:mod:`icecache.runtime.transfer`). A :class:`PageIndex` per
sequence and reuse group owns the :class:`icecache.HeadForest` that decides that layout and
the device residency of pages (:class:`icecache.ResidentPages`). Layers that reuse another
layer's layout keep their own keys in position order (:class:`History`) to rewrite pages that
the leader's index changes.

With ``IceCacheConfig.page_format="int8"`` the stores hold 8-bit pages: uint8 ``[H_kv, P,
page_size * (D + 4)]``, each page its rows' int8 codes, then one float32 scale per row
(:func:`dequantize_pages` reads them, on the host and on the device alike). The index reads
its keys from the K store's rows then (:meth:`PageStore.k_codes`): each key is stored once.
With ``page_format="k8v4"`` the K pages are those 8-bit pages and the V pages 4-bit ones
(:func:`value4_page_bytes`, :func:`dequantize_value4_pages`): each group of 32 values of a row
as codes 0..15 with a bfloat16 step and minimum.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from icecache import _core
from icecache.runtime.config import IceCacheConfig

__all__ = [
    "numpy_view",
    "headroom",
    "int8_page_bytes",
    "value4_page_bytes",
    "page_bytes",
    "dequantize_pages",
    "dequantize_value4_pages",
    "dequantize_kv",
    "PageStore",
    "History",
    "PageIndex",
]

#: Values of a row that share one 4-bit step and minimum.
VALUE4_GROUP = 32


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a contiguous CPU tensor; bfloat16 is viewed as uint16."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def int8_page_bytes(page_size: int, dim: int) -> int:
    """Bytes of one 8-bit page: ``page_size * dim`` int8 codes, then ``page_size`` float32 scales."""
    return page_size * (dim + 4)


def value4_page_bytes(page_size: int, dim: int) -> int:
    """Bytes of one 4-bit V page: ``page_size`` rows of ``ceil(dim / 2)`` bytes of codes (two a
    byte, the low nibble first), padded to an even size, then ``[page_size, ceil(dim / 32), 2]``
    bfloat16 ``(step, minimum)`` of each group of 32 values."""
    codes = -(-dim // 2) * page_size
    return codes + codes % 2 + page_size * -(-dim // VALUE4_GROUP) * 4


def page_bytes(page_format: str, page_size: int, dim: int) -> Tuple[int, int]:
    """Bytes of one K page and one V page of a quantised ``page_format`` (``"int8"``, ``"k8v4"``)."""
    k = int8_page_bytes(page_size, dim)
    return k, (value4_page_bytes(page_size, dim) if page_format == "k8v4" else k)


def dequantize_value4_pages(pages: torch.Tensor, page_size: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """4-bit V pages ``[..., value4_page_bytes]`` (uint8) as ``[..., page_size, dim]`` tokens in
    ``dtype``: ``minimum + code * step`` of each value's group, in float32 (the product is exact:
    a 4-bit code times a bfloat16 step), then rounded once to ``dtype``. Views and elementwise ops
    only (CUDA-graph safe); the same on CPU and CUDA."""
    half, groups = -(-dim // 2), -(-dim // VALUE4_GROUP)
    split = page_size * half
    at = split + split % 2
    packed = pages[..., :split].unflatten(-1, (page_size, half))
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # [..., S, 2 * half]
    if codes.shape[-1] != groups * VALUE4_GROUP:
        codes = torch.nn.functional.pad(codes, (0, groups * VALUE4_GROUP - codes.shape[-1]))
    params = pages[..., at:].view(torch.bfloat16).unflatten(-1, (page_size, groups, 2)).float()
    # Each group's minimum plus its codes times its step, broadcast over the group's values.
    values = torch.addcmul(params[..., 1:], codes.unflatten(-1, (groups, VALUE4_GROUP)).float(), params[..., :1])
    return values.flatten(-2)[..., :dim].to(dtype)


def dequantize_kv(
    k: torch.Tensor, v: torch.Tensor, page_format: str, page_size: int, dim: int, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantised K and V pages (``page_format`` ``"int8"`` or ``"k8v4"``) as ``[..., page_size,
    dim]`` tokens in ``dtype``."""
    dk = dequantize_pages(k, page_size, dim, dtype)
    if page_format == "k8v4":
        return dk, dequantize_value4_pages(v, page_size, dim, dtype)
    return dk, dequantize_pages(v, page_size, dim, dtype)


def dequantize_pages(pages: torch.Tensor, page_size: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """8-bit pages ``[..., page_size * (dim + 4)]`` (uint8) as ``[..., page_size, dim]`` tokens in
    ``dtype``: each code times its row's scale, in float32, then rounded once to ``dtype``.
    Views and elementwise ops only, so a CUDA graph can replay it; the same on CPU and CUDA."""
    split = page_size * dim
    codes = pages[..., :split].view(torch.int8).unflatten(-1, (page_size, dim))
    scales = pages[..., split:].view(torch.float32)  # [..., page_size]
    return (codes.float() * scales[..., None]).to(dtype)


def headroom(pages: int) -> int:
    """Pages to reserve for a store that must hold ``pages`` now: a quarter more, at least 64,
    so that thousands of decode tokens fit before the store has to grow."""
    return pages + max(64, pages // 4)


def _grow(owner, need: int, keep: int) -> None:
    """Reallocate ``owner.k`` and ``owner.v`` with room for at least ``need`` entries along
    dim 1 (and half again as many as now, so repeated growth stays amortised), keeping the
    first ``keep``."""
    size = max(need, owner.k.shape[1] + owner.k.shape[1] // 2)
    for name in ("k", "v"):
        old = getattr(owner, name)
        new = old.new_empty(old.shape[0], size, *old.shape[2:])
        new[:, :keep] = old[:, :keep]
        setattr(owner, name, new)


class PageStore:
    """K and V pages of one layer of one sequence in CPU memory: ``[H_kv, P, S, D]`` each in
    ``dtype``, or with a quantised ``page_format`` uint8 ``[H_kv, P, page bytes]`` (8-bit pages,
    and 4-bit V pages with ``"k8v4"``; see the module docs).

    Grows by half again when full; the NumPy views handed to the core are taken after any
    growth. Growing copies the pages in use and stalls the step that does it, so callers
    reserve headroom up front (:func:`headroom`). Pages past those in use are never written
    before an insert needs them (``HeadForest.write_pages`` and ``insert`` leave them alone),
    so where the allocator maps large blocks lazily (glibc for blocks over its mmap threshold)
    the headroom is address space until it is used.
    """

    def __init__(self, heads: int, page_size: int, dim: int, dtype: torch.dtype, page_format: str = "native"):
        self.page_size, self.dim, self.page_format = page_size, dim, page_format
        if page_format in ("int8", "k8v4") and (page_size * dim) % 4:
            # The device reads a page's float32 scales and bfloat16 parameters in place.
            raise ValueError(
                f"page_format={page_format!r} needs page_size * head size divisible by 4, got {page_size} x {dim}"
            )
        if page_format in ("int8", "k8v4"):
            kb, vb = page_bytes(page_format, page_size, dim)
            self.k = torch.empty(heads, 0, kb, dtype=torch.uint8)
            self.v = torch.empty(heads, 0, vb, dtype=torch.uint8)
        elif page_format == "native":
            self.k = torch.empty(heads, 0, page_size, dim, dtype=dtype)
            self.v = torch.empty_like(self.k)
        else:
            raise ValueError(f'page_format must be "native", "int8" or "k8v4", got {page_format!r}')

    def tokens(self, dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V pages as ``[H_kv, P, S, D]`` tokens in ``dtype`` (quantised pages dequantised:
        what the device attends once it loads them)."""
        if self.page_format == "native":
            return self.k.to(dtype), self.v.to(dtype)
        return dequantize_kv(self.k, self.v, self.page_format, self.page_size, self.dim, dtype)

    @property
    def pages(self) -> int:
        """Allocated pages per head."""
        return self.k.shape[1]

    def nbytes(self) -> int:
        """Bytes of the K and V stores as allocated (headroom included)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def reserve(self, pages: int, used: int) -> bool:
        """Make room for at least ``pages`` pages per head, keeping the first ``used`` (the
        pages in use); whether it grew (which invalidates views handed out before)."""
        if pages <= self.pages:
            return False
        _grow(self, pages, min(used, self.pages))
        return True

    def views(self) -> Tuple[np.ndarray, np.ndarray]:
        """NumPy views of the K and V stores (invalidated by :meth:`reserve`)."""
        return numpy_view(self.k), numpy_view(self.v)

    def k_codes(self) -> Optional[np.ndarray]:
        """What an index of these stores reads its keys from (``HeadForest``'s ``k_store``): the
        8-bit K store, or ``None`` for 16-bit stores (their index keeps its keys' int8 rows)."""
        return None if self.page_format == "native" else numpy_view(self.k)


class History:
    """K and V of one layer's offloaded tokens in position order, ``[H_kv, n, D]``; grows with
    the same headroom as the page stores (:func:`headroom`, in tokens). The prompt is appended
    here; decode-time tokens are written by the look-ahead worker into room reserved by
    :meth:`reserve`."""

    def __init__(self, heads: int, dim: int, dtype: torch.dtype):
        self.k = torch.empty(heads, 0, dim, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.n = 0

    def reserve(self, tokens: int) -> bool:
        """Make room for ``tokens`` tokens, keeping the first :attr:`n`; whether it grew."""
        if tokens <= self.k.shape[1]:
            return False
        _grow(self, headroom(tokens), self.n)
        return True

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        m = k.shape[1]
        self.reserve(self.n + m)
        self.k[:, self.n : self.n + m] = k
        self.v[:, self.n : self.n + m] = v
        self.n += m

    def views(self):
        """NumPy views of the K and V histories (invalidated when :meth:`reserve` grows them)."""
        return numpy_view(self.k), numpy_view(self.v)


class PageIndex:
    """The index of one sequence for one reuse group: the page layout and device residency.

    Built from the prompt (:meth:`add`, on the index worker); during decode the look-ahead
    worker's jobs insert flushed tokens, select pages and plan their device slots through the
    same core objects (``icecache._core.LookAheadLayer``).

    Args:
        heads: KV heads.
        config: the runtime configuration (page size, index parameters, pool size).
    """

    def __init__(self, heads: int, config: IceCacheConfig):
        self.heads = heads
        self.config = config
        self.forest: Optional[_core.HeadForest] = None
        self.resident = _core.ResidentPages(heads, config.device_pages)
        #: One :class:`icecache.Calibration` per KV head once :meth:`calibrate` has run.
        self.calibrations: Optional[List[_core.Calibration]] = None

    def add(self, k: torch.Tensor, v: torch.Tensor, store: PageStore, *, background: bool = True) -> None:
        """Index a prompt's middle tokens ``[H_kv, m, D]`` (CPU, contiguous) and write them into
        ``store`` in page order. ``background``: the build's pool, and the forest's from then
        on (``HeadForest``'s argument): ``False`` for a caller that waits for it, such as a
        decode step (see :meth:`icecache.HeadForest.insert`)."""
        k_np, v_np = numpy_view(k), numpy_view(v)
        self.forest = _core.HeadForest(k_np, **dict(self.config.index_kwargs(), background=background))
        store.reserve(headroom(self.forest.max_pages()), 0)
        self.forest.write_pages(k_np, v_np, *store.views())

    def calibrate(self, queries: torch.Tensor, store: PageStore) -> List[_core.Calibration]:
        """Calibrate each KV head's effort (``effort="auto"``) on the prompt's last queries
        ``[H_q, n, D]`` (CPU, contiguous, the keys' dtype): recall@``config.calibration_k``,
        with ``DCIIndex(effort="auto")``'s target and least effort. ``store``: the one
        :meth:`add` wrote. Kept in :attr:`calibrations`."""
        forest = self.forest
        if forest is None:
            raise RuntimeError("PageIndex.calibrate() needs an add() first: the index")
        self.calibrations = forest.calibrate(
            numpy_view(queries),
            self.config.calibration_k(len(forest)),
            _core.AUTO_TARGET,
            k_store=store.k_codes(),
            min_effort=_core.AUTO_MIN_EFFORT,
        )
        return self.calibrations

    def follow(self, history: History, store: PageStore, *, background: bool = True) -> None:
        """Write a reusing layer's prompt (``history``) into ``store`` in this index's layout
        (``background``: the write's pool, as for :meth:`add`)."""
        forest = self.forest
        if forest is None:
            raise RuntimeError("PageIndex.follow() needs an add() first: the leader's layout")
        store.reserve(headroom(forest.max_pages()), 0)
        k_src = numpy_view(history.k[:, : history.n])
        v_src = numpy_view(history.v[:, : history.n])
        forest.write_pages(k_src, v_src, *store.views(), background=background)
