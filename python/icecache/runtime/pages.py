"""CPU side of the runtime: page stores and the per-sequence page index.

For every sequence and IceCache layer, the offloaded ("middle") tokens live in a
:class:`PageStore`, K and V laid out as semantic pages ``[H_kv, P, page_size, D]`` in ordinary
host memory (only the staging rows that pages are gathered into take part in DMA, see
:mod:`icecache.runtime.transfer`). A :class:`PageIndex` per
sequence and reuse group owns the :class:`icecache.HeadForest` that decides that layout, the
valid length of every page, the device residency of pages (:class:`icecache.ResidentPages`)
and the current step's selection and load plan. Layers that reuse another layer's layout keep
their own keys in position order (:class:`History`) to rewrite pages that the leader's index
changes.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from icecache import _core
from icecache.runtime.config import IceCacheConfig

__all__ = ["numpy_view", "headroom", "PageStore", "History", "PageIndex"]


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy NumPy view of a contiguous CPU tensor; bfloat16 is viewed as uint16."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


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
    """K and V pages of one layer of one sequence in CPU memory: ``[H_kv, P, S, D]`` each.

    Grows by half again when full; the NumPy views handed to the core are taken after any
    growth. Growing copies the whole store and stalls the step that does it, so callers
    reserve headroom up front (:func:`headroom`).
    """

    def __init__(self, heads: int, page_size: int, dim: int, dtype: torch.dtype):
        self.k = torch.empty(heads, 0, page_size, dim, dtype=dtype)
        self.v = torch.empty_like(self.k)

    @property
    def pages(self) -> int:
        """Allocated pages per head."""
        return self.k.shape[1]

    def reserve(self, pages: int) -> None:
        """Make room for at least ``pages`` pages per head, keeping the contents."""
        if pages > self.pages:
            _grow(self, pages, self.pages)

    def views(self) -> Tuple[np.ndarray, np.ndarray]:
        """NumPy views of the K and V stores (invalidated by :meth:`reserve`)."""
        return numpy_view(self.k), numpy_view(self.v)


class History:
    """K and V of one layer's offloaded tokens in position order, ``[H_kv, n, D]``; grows with
    the same headroom as the page stores (:func:`headroom`, in tokens)."""

    def __init__(self, heads: int, dim: int, dtype: torch.dtype):
        self.k = torch.empty(heads, 0, dim, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        m = k.shape[1]
        if self.n + m > self.k.shape[1]:
            _grow(self, headroom(self.n + m), self.n)
        self.k[:, self.n : self.n + m] = k
        self.v[:, self.n : self.n + m] = v
        self.n += m


class PageIndex:
    """The index of one sequence for one reuse group: layout, page lengths, residency, plan.

    Args:
        heads: KV heads.
        config: the runtime configuration (page size, index parameters, pool size).
    """

    def __init__(self, heads: int, config: IceCacheConfig):
        self.heads = heads
        self.config = config
        self.forest: Optional[_core.HeadForest] = None
        self.resident = _core.ResidentPages(heads, config.device_pages)
        #: Valid tokens of every page, ``[H_kv, max_pages]`` (0 past a head's pages).
        self.lens = np.zeros((heads, 0), dtype=np.int32)
        #: Pages changed by the last :meth:`add`, per head; ``None`` when it built the forest
        #: (every page is new).
        self.changed: Optional[List[np.ndarray]] = None
        #: This step's ``(pages [H, M], counts [H])`` and ``ResidentPages.plan`` result (nothing
        #: selected and nothing to load until the first :meth:`select`).
        none = np.zeros(0, dtype=np.int32)
        self.selection: Tuple[np.ndarray, np.ndarray] = (np.full((heads, 0), -1, np.int32), np.zeros(heads, np.int32))
        self.plan: Tuple[np.ndarray, ...] = (none, none, none, np.full((heads, 0), -1, np.int32))

    def add(self, k: torch.Tensor, v: torch.Tensor, store: PageStore) -> None:
        """Index tokens ``[H_kv, m, D]`` (CPU, contiguous) that follow the indexed ones, and
        write them into ``store`` in page order."""
        k_np, v_np = numpy_view(k), numpy_view(v)
        if self.forest is None:
            self.forest = _core.HeadForest(k_np, **self.config.index_kwargs())
            store.reserve(headroom(self.forest.max_pages()))
            self.forest.write_pages(k_np, v_np, *store.views())
            self.changed = None
        else:
            store.reserve(self.forest.max_pages() + k.shape[1])
            self.changed = self.forest.insert(k_np, v_np, *store.views())
            for head, pages in enumerate(self.changed):
                # Stale device copies of these pages get reloaded when next selected.
                self.resident.invalidate(head, pages)
        self._update_lens()

    def _update_lens(self) -> None:
        """Bring :attr:`lens` up to date: every page after a build, only the changed pages (and
        new columns) after an insert, instead of recounting every token of every head."""
        forest = self.forest
        assert forest is not None  # add() built it
        width = forest.max_pages()
        if self.changed is None:
            lens = np.zeros((self.heads, width), dtype=np.int32)
            for head in range(self.heads):
                pages, _ = forest.token_map(head)
                counts = np.bincount(pages, minlength=forest.num_pages(head))
                lens[head, : counts.shape[0]] = counts
            self.lens = lens
            return
        if width > self.lens.shape[1]:
            self.lens = np.pad(self.lens, ((0, 0), (0, width - self.lens.shape[1])))
        for head, pages in enumerate(self.changed):
            for page in pages.tolist():
                self.lens[head, page] = len(forest.page_tokens(head, page))

    def follow(self, history: History, store: PageStore) -> None:
        """Bring a reusing layer's ``store`` up to date with this index's last :meth:`add`,
        from that layer's own keys in position order."""
        forest = self.forest
        if forest is None:
            raise RuntimeError("PageIndex.follow() needs an add() first: the leader's layout")
        store.reserve(headroom(forest.max_pages()) if self.changed is None else forest.max_pages())
        if self.changed is None:
            k_src = numpy_view(history.k[:, : history.n])
            v_src = numpy_view(history.v[:, : history.n])
            forest.write_pages(k_src, v_src, *store.views())
            return
        for head, pages in enumerate(self.changed):
            if len(pages) == 0:
                continue
            # One indexed copy per head for all its changed pages: (page, slot) <- token.
            tokens = [forest.page_tokens(head, page) for page in pages.tolist()]
            lens = np.array([len(t) for t in tokens])
            starts = np.repeat(np.cumsum(lens) - lens, lens)
            src = torch.from_numpy(np.concatenate(tokens).astype(np.int64))
            page = torch.from_numpy(np.repeat(pages.astype(np.int64), lens))
            slot = torch.from_numpy(np.arange(lens.sum()) - starts)
            store.k[head, page, slot] = history.k[head, src]
            store.v[head, page, slot] = history.v[head, src]

    def select(self, query: np.ndarray, max_pages: int, scale: float) -> None:
        """Choose this step's pages for ``query`` (``[H_q, D]``) and plan their loading."""
        pages = np.full((self.heads, max_pages), -1, dtype=np.int32)
        counts = np.zeros(self.heads, dtype=np.int32)
        forest = self.forest
        if forest is not None and forest.max_pages() <= max_pages:
            # Everything fits in the budget: take every page, no search (and exact).
            for head in range(self.heads):
                n = forest.num_pages(head)
                pages[head, :n] = np.arange(n, dtype=np.int32)
                counts[head] = n
        elif forest is not None:
            pages, counts = forest.select(query, max_pages, scale=scale)
        self.selection = (pages, counts)
        self.plan = self.resident.plan(pages, counts)

    def selected_lens(self) -> np.ndarray:
        """Valid tokens of each selected page, ``[H_kv, M]`` (0 past the selection)."""
        pages, counts = self.selection
        out = np.zeros(pages.shape, dtype=np.int32)
        if self.lens.shape[1]:
            rows = np.arange(self.heads)[:, None]
            out = np.where(pages >= 0, self.lens[rows, np.maximum(pages, 0)], 0).astype(np.int32)
        return out
