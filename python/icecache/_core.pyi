"""Type stubs for the Rust extension ``icecache._core``.

The classes are PyO3 classes: constructed through ``__new__`` and not subclassable (``final``).
"""

from os import PathLike
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, final

__all__ = [
    "__version__",
    "IndexFileError",
    "DCIIndex",
    "HeadForest",
    "ResidentPages",
    "gather_pages",
    "fold_token_lists",
]

__version__: str

class IndexFileError(ValueError):
    """A save file is truncated, corrupted, or from an incompatible version."""

@final
class DCIIndex:
    """Approximate nearest-neighbour index: a multi-level Dynamic Continuous Indexing (M-DCI) tree.

    ``metric="ip"`` (default) ranks by inner product (largest first) through the transform
    ``T_K(k) = [k / c, sqrt(1 - |k|^2 / c^2)]``; ``metric="l2"`` ranks by squared Euclidean
    distance (smallest first).

    Keys are float32, float16, or bfloat16 passed as a ``uint16`` view; arithmetic is float32.
    C-contiguous arrays are read without a copy; other layouts are copied first.
    The first ``add`` into an empty index is a parallel bulk build; later adds insert
    incrementally (no rebuild).

    Args:
        dim: key dimension (1..=4096).
        metric: ``"ip"`` or ``"l2"``.
        num_simple: simple indices (random directions) per composite index of P-DCI (m).
        num_composite: composite indices of P-DCI (L).
        promotion: promotion ratio of each level: ``promotion[0]`` is P(level >= 1),
            ``promotion[i]`` is P(level >= i + 1 | level >= i). A float means one level.
        seed: seed for the random directions and level draws (``None``: from the OS).
        threads: worker threads for bulk build and batch queries (``None``: all cores).
        effort: default query effort (see ``query``).
    """

    def __new__(
        cls,
        dim: int,
        metric: str = "ip",
        *,
        num_simple: Optional[int] = None,
        num_composite: Optional[int] = None,
        promotion: Union[float, Sequence[float], None] = None,
        seed: Optional[int] = None,
        threads: Optional[int] = None,
        effort: float = 1.0,
    ) -> Self: ...
    @property
    def dim(self) -> int: ...
    @property
    def metric(self) -> str: ...
    def __len__(self) -> int: ...
    def add(self, keys: npt.ArrayLike, ids: Optional[npt.ArrayLike] = None) -> npt.NDArray[np.int64]:
        """Add ``keys`` (``[n, dim]``); returns their ids (``ids``, or fresh ones)."""
    def remove(self, ids: npt.ArrayLike) -> None:
        """Remove the points with these ids (all must exist)."""
    def query(
        self,
        queries: npt.ArrayLike,
        k: int,
        *,
        effort: Optional[float] = None,
        exact: bool = False,
    ) -> Tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """Top-``k`` neighbours of each query row: ``(ids [nq, k], scores [nq, k])``.

        Scores are inner products (descending) for ``"ip"``, squared distances (ascending)
        for ``"l2"``. ``effort`` scales the search (field of view); ``exact=True`` is a
        brute-force scan.
        """
    def save(self, path: Union[str, PathLike[str]]) -> None: ...
    @staticmethod
    def load(path: Union[str, PathLike[str]], threads: Optional[int] = None) -> "DCIIndex": ...
    def stats(self) -> dict[str, Any]: ...

@final
class HeadForest:
    """One M-DCI tree per KV head of one layer of one sequence, with the tree's leaf cells laid
    out as **semantic pages**: runs of at most ``page_size`` tokens whose keys are close (each
    leaf cell is cut along its principal axes into full pages and at most one part-filled one).

    ``keys`` is ``[H_kv, n, d]`` (float32, float16, or bfloat16 as a ``uint16`` view). Token ``i``
    of every head has position ``i``; inserted tokens continue at ``n, n + 1, ...``.
    Trees are built in parallel (one per head), without the GIL.

    Args:
        page_size: tokens per page (8..=64).
        seed, threads, num_simple, num_composite, effort: as for ``DCIIndex``; head ``h`` uses
            ``seed + h``.
        promotion: as for ``DCIIndex``; the default ``[0.01, 1/16, 1/16]`` gives leaf cells of
            about 100 keys.
    """

    def __new__(
        cls,
        keys: npt.ArrayLike,
        *,
        page_size: int = 16,
        seed: Optional[int] = None,
        threads: Optional[int] = None,
        num_simple: Optional[int] = None,
        num_composite: Optional[int] = None,
        promotion: Union[float, Sequence[float], None] = None,
        effort: float = 1.0,
    ) -> Self: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    def __len__(self) -> int:
        """Tokens per head."""
    def num_pages(self, head: int) -> int:
        """Pages of ``head`` (numbered ``0..num_pages``; pages are never freed)."""
    def max_pages(self) -> int:
        """Largest ``num_pages`` over the heads: the page stores need at least this many."""
    def page_tokens(self, head: int, page: int) -> npt.NDArray[np.int64]:
        """Token positions in ``page`` of ``head``, in slot order (at most ``page_size``)."""
    def token_map(self, head: int) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """``(page, slot)`` of every token position of ``head``."""
    def write_pages(
        self, k_src: npt.ArrayLike, v_src: npt.ArrayLike, k_store: npt.ArrayLike, v_store: npt.ArrayLike
    ) -> None:
        """Writes K and V of every token (``[H_kv, n, d]`` in position order) into the page stores
        (``[H_kv, P, page_size, d]``, same dtype, writable, ``P >= max_pages()``), in parallel."""
    def select(
        self,
        queries: npt.ArrayLike,
        max_pages: int,
        *,
        scale: Optional[float] = None,
        effort: Optional[float] = None,
        exact: bool = False,
    ) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """Pages for one decode step: ``queries`` is ``[H_q, d]`` (``H_q`` a multiple of ``H_kv``;
        query head ``j`` belongs to KV head ``j // (H_q // H_kv)``). Returns ``(pages, counts)``:
        ``pages[h, :counts[h]]`` are KV head ``h``'s pages ranked by the group's attention mass
        (each query head's softmax with ``scale``, default ``1/sqrt(d)``, over the keys its search
        scores, summed over the group); the rest is -1. ``exact`` scores every key exactly."""
    def insert(
        self, keys: npt.ArrayLike, values: npt.ArrayLike, k_store: npt.ArrayLike, v_store: npt.ArrayLike
    ) -> List[npt.NDArray[np.int32]]:
        """Appends ``m`` tokens per head (``[H_kv, m, d]``), writes their K/V (and any tokens a page
        split moves) into the stores, and returns per head the pages whose contents changed.
        The stores need ``P >= max_pages() + m``."""

@final
class ResidentPages:
    """Which pages of each KV head are on the device, and in which device page slot.

    ``capacity`` device slots per head. ``plan`` maps a step's selection to device slots, reusing
    resident unchanged pages and evicting the least recently used ones."""

    def __new__(cls, num_heads: int, capacity: int) -> Self: ...
    def invalidate(self, head: int, pages: npt.ArrayLike) -> None:
        """Marks pages whose contents changed (e.g. from ``HeadForest.insert``) as stale."""
    def plan(
        self, pages: npt.ArrayLike, counts: npt.ArrayLike
    ) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """For ``pages [H_kv, max_pages]`` / ``counts [H_kv]`` (as ``select`` returns) gives
        ``(load_heads, load_pages, load_slots, table)``: the pages to load (sorted by source
        address), the device slot each goes to, and ``table [H_kv, max_pages]``, the device slot of
        every selected page (-1 past ``counts``)."""

def gather_pages(
    k_store: npt.ArrayLike,
    v_store: npt.ArrayLike,
    heads: npt.ArrayLike,
    pages: npt.ArrayLike,
    k_stage: npt.ArrayLike,
    v_stage: npt.ArrayLike,
) -> None:
    """Copies page ``pages[i]`` of head ``heads[i]`` from the stores (``[H_kv, P, S, d]``) into row
    ``i`` of the staging buffers (``[R, S, d]``, same dtype, ``R >= len(pages)``), in parallel."""

def fold_token_lists(
    table: npt.ArrayLike,
    page_len: npt.ArrayLike,
    sink_len: npt.ArrayLike,
    win_len: npt.ArrayLike,
    *,
    pool_slots: int,
    page_size: int,
    sink_cap: int,
    win_cap: int,
) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Token lists of decode attention over a layer's device buffer folded to one-token pages.

    The buffer holds, per (sequence ``b``, KV head ``h``), ``T = pool_slots * page_size +
    sink_cap + win_cap`` token slots: the page pool, then the sink, then the window. Request
    ``r = b * H + h`` reads the ``sink_len[b]`` sink tokens, the first ``page_len[b, h, j]``
    tokens of each selected page (pool slot ``table[b, h, j]``, ``-1`` for none), then the
    ``win_len[b]`` window tokens; token ``t`` of request ``r`` is folded index ``r * T + t``.

    Args:
        table, page_len: ``[B, H, M]`` integers.
        sink_len, win_len: ``[B]`` integers.

    Returns:
        ``(indptr [B*H + 1], indices [indptr[-1]])``, int32.

    Raises:
        ValueError: mismatched shapes, a slot outside ``-1..pool_slots``, a length outside
            ``0..=page_size`` (``sink_cap``, ``win_cap``), or more than 2**31 token slots.
    """
