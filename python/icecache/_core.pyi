"""Type stubs for the Rust extension ``icecache._core``.

The classes are PyO3 classes: constructed through ``__new__`` and not subclassable (``final``).

Errors: bad arguments raise ``ValueError`` (``TypeError`` for a bool, float or other non-int
where an int is expected; ``KeyError`` for an unknown id; ``IndexFileError`` for a bad save
file) and change nothing. An allocation sized by the arguments that cannot be made raises
``MemoryError``. A bug inside the core raises ``RuntimeError``; no panic crosses into Python.

Threads: every object may be shared by threads. Reading calls run in parallel with each other,
without the GIL; writing calls (named in each class) take the object exclusively: they wait for
running calls and later calls wait for them (a lock in the core, not an error). A call copies
the keys it validates, so another thread writing the caller's array cannot make it use what it
did not validate. An array a call writes (a page store, a staging buffer) must not also be one
of its inputs, nor be read or written by another running call meanwhile (``insert`` into a store
that ``gather_pages`` is reading, say): that raises ``ValueError`` at once instead of waiting,
since NumPy's borrow tracking, not the object's lock, guards the caller's arrays. Reading calls
share arrays freely.
"""

from os import PathLike
from typing import Any, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, final

__all__ = [
    "__version__",
    "AUTO_TARGET",
    "AUTO_MIN_EFFORT",
    "IndexFileError",
    "DCIIndex",
    "Calibration",
    "HeadForest",
    "ResidentPages",
    "gather_pages",
    "LookAhead",
    "LookAheadLayer",
    "LookAheadOutcome",
    "StagingLayout",
]

__version__: str
#: ``target_recall`` of ``DCIIndex(effort="auto")``'s calibration (0.975: it aims at 0.95 for the
#: queries that follow the sample); the runtime's ``IceCacheConfig(effort="auto")`` uses it too.
AUTO_TARGET: float
#: ``min_effort`` of ``effort="auto"`` (1: never below the tuned default; later queries can be
#: harder than the sample).
AUTO_MIN_EFFORT: float

class IndexFileError(ValueError):
    """A save file is truncated, corrupted, or from an incompatible version."""

@final
class DCIIndex:
    """Approximate nearest-neighbour index: a multi-level Dynamic Continuous Indexing (M-DCI) tree.

    ``metric="ip"`` (default) ranks by inner product (largest first) through the transform
    ``T_K(k) = [k / c, sqrt(1 - |k|^2 / c^2)]``; ``metric="l2"`` ranks by squared Euclidean
    distance (smallest first).

    Keys are float32, float16, or bfloat16 passed as a ``uint16`` view; arithmetic is float32.
    The index keeps its own float32 copy of the keys.
    The first ``add`` into an empty index is a parallel bulk build; later adds insert
    incrementally, and the inserts keep the tree as a bulk build would make it: they rebuild it
    when it has doubled since it was last built (that one insert takes about a build's time)
    and its small upper tiers when those have grown by 5%. An index grown one key or one batch
    at a time answers like a bulk build of the same keys (recall and latency within a few
    percent; ``benches/bench_index.py --growth``).

    Threads: ``query``, ``save``, ``stats`` and ``len`` run in parallel; ``add`` and ``remove``
    are writers (see the module docs).

    Args:
        dim: key dimension (1..=4096).
        metric: ``"ip"`` or ``"l2"``.
        num_simple: simple indices (random directions) per composite index of P-DCI (m).
        num_composite: composite indices of P-DCI (L).
        promotion: promotion ratio of each level: ``promotion[0]`` is P(level >= 1),
            ``promotion[i]`` is P(level >= i + 1 | level >= i). A float means one level.
        seed: seed for the random directions and level draws (``None``: from the OS).
        threads: worker threads for bulk build and batch queries (``None``: all cores). Objects
            that ask for the same count share one pool of that many threads, made on first use.
        effort: default query effort (see ``query``), or ``"auto"``: the first ``query`` that runs
            at the default effort (no ``effort``, not ``exact``) first calibrates it on (at most
            256, evenly spaced, of) that call's queries, at that call's ``k`` (``calibrate``),
            then answers them; until then ``awaits_calibration`` is True. It aims at recall@k
            0.95 for the queries that follow, so it calibrates the first batch for half that miss
            rate (``target_recall=0.975``), and never below effort 1 (``min_effort=1``): later
            queries can be harder than the first ones (measured on SmolLM2 in
            ``benches/RESULTS.md``). That
            first call costs an exact scan per sample query plus about ten searches of them, so
            make it a batch of real queries (a few hundred; with very few, the estimate of the
            recall is loose). The effort is calibrated once: call ``calibrate`` again after the
            keys have changed much.
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
        effort: Union[float, Literal["auto"]] = 1.0,
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
        for ``"l2"``. ``effort`` scales the search (field of view; ``None``: the default, which
        ``calibrate`` sets, and which ``effort="auto"`` calibrates on this call when it still
        awaits that); ``exact=True`` is a brute-force scan.
        """
    def calibrate(
        self,
        queries: npt.ArrayLike,
        k: int,
        target_recall: float = 0.95,
        *,
        min_effort: float = 0.0625,
        max_effort: float = 64.0,
    ) -> "Calibration":
        """Sets the default effort to the smallest that reaches ``target_recall`` (recall@``k``)
        on the sample ``queries`` ``[nq, dim]``, and returns what it measured.

        Each query's exact top-``k`` comes from the index's own exact scan (one scan of every
        key per query: the main cost, with about ten approximate searches of the sample).
        Efforts are searched by halving or doubling from 1 (within ``min_effort`` ..
        ``max_effort``, which must hold 1), then by bisection to within 10%. An effort reaches
        the target when the sample's mean recall, less two standard errors of that mean, is at
        least ``target_recall``: other queries like the sample then reach it too (the mean
        alone would leave half of them below).
        The result holds for this ``k`` and for queries like the sample; queries unlike it can
        fall short (on SmolLM2, queries at later positions than the sample's had up to 0.10 less
        recall@100: ``benches/RESULTS.md``), so ask for a higher target when the queries to
        come may differ (``effort="auto"`` does).

        When no effort up to ``max_effort`` reaches the target (``reached`` is False), the
        default becomes the effort with the best recall measured, and no error is raised:
        check ``reached``. Bad input (shape, dtype, non-finite values, no queries, ``k``
        outside ``1..=len``, ``target_recall`` outside (0, 1], ``min_effort`` outside (0, 1],
        ``max_effort`` below 1, an empty index) raises ``ValueError`` and changes nothing. The result is kept
        (``calibration``) and saved with the index.
        """
    @property
    def calibration(self) -> Optional["Calibration"]:
        """The last calibration (``calibrate`` or ``effort="auto"``; saved with the index), or
        None."""
    @property
    def awaits_calibration(self) -> bool:
        """True while ``effort="auto"`` waits for its first query to calibrate."""
    def save(self, path: Union[str, PathLike[str]]) -> None:
        """Writes the index to ``path``: a temporary file of its own beside it, flushed to disk
        and renamed over it. A save that returns has left a whole file; of concurrent saves to
        one path the last rename wins; a crash leaves the previous file (and the next save to
        the path removes the crashed save's temporary file)."""
    @staticmethod
    def load(path: Union[str, PathLike[str]], threads: Optional[int] = None) -> "DCIIndex":
        """Reads an index written by ``save`` (this version's format, 2, or the earlier 1, whose
        files have no calibration). The header, checksum and whole structure are checked first:
        a bad file raises ``IndexFileError``, never a later call."""
    def stats(self) -> dict[str, Any]: ...

@final
class Calibration:
    """What ``DCIIndex.calibrate`` (or ``effort="auto"``) measured.

    Attributes:
        effort: the effort chosen (now the index's default): the smallest tried that reached
            the target, or, when none did, the one with the best recall.
        recall: mean recall@``k`` of the sample queries at ``effort``.
        recall_stderr: standard error of that mean (0 with one query).
        reached: whether ``recall - 2 * recall_stderr >= target_recall``.
        target_recall: the target asked for.
        k: neighbours per query the recall counts.
        queries: sample queries used.
        evaluations: efforts tried (each an approximate search of every sample query).
        seconds: wall time of the calibration, exact scans included.
    """

    @property
    def effort(self) -> float: ...
    @property
    def recall(self) -> float: ...
    @property
    def recall_stderr(self) -> float: ...
    @property
    def reached(self) -> bool: ...
    @property
    def target_recall(self) -> float: ...
    @property
    def k(self) -> int: ...
    @property
    def queries(self) -> int: ...
    @property
    def evaluations(self) -> int: ...
    @property
    def seconds(self) -> float: ...

@final
class HeadForest:
    """One tree per KV head of one layer of one sequence, with the leaf cells of an M-DCI tree
    over the keys laid out as **semantic pages**: runs of at most ``page_size`` tokens whose keys
    are close (the leaf cells are refined by three k-means steps, then each is cut along its
    principal axes into full pages and at most one part-filled one).

    ``keys`` is ``[H_kv, n, d]`` (float32, float16, or bfloat16 as a ``uint16`` view). Token ``i``
    of every head has position ``i``; inserted tokens continue at ``n, n + 1, ...``.
    Trees are built in parallel (one per head), without the GIL.

    Each key is kept once, as the int8 row of its page (``max |x| / 127`` scale per row, the
    rows 8-bit stores hold): with ``page_format="int8"`` or ``"k8v4"`` in the caller's K store, which
    ``select``, ``calibrate`` and ``insert`` then read (pass it as ``k_store``), otherwise in
    the forest itself (``nbytes`` counts it). Selection scores keys from these rows. The build's
    float32 keys are not kept.

    Threads: ``select``, ``write_pages`` and the getters run in parallel; ``insert`` is a writer
    (see the module docs).

    Args:
        page_size: tokens per page (8..=64).
        page_format: the page stores' format, ``"native"`` (the tokens' dtype), ``"int8"`` or
            ``"k8v4"`` (see :meth:`write_pages`).
        seed, threads, num_simple, num_composite: as for ``DCIIndex``; head ``h`` uses
            ``seed + h``.
        effort: the query effort (a number; ``"auto"`` is ``DCIIndex``'s only).
        promotion: as for ``DCIIndex``; the default ``[0.01, 1/16, 1/16]`` gives leaf cells of
            about 100 keys.
        background: run the forest's parallel work (the build, ``write_pages``, ``calibrate``,
            ``select``, ``insert``) on a pool of ``threads`` threads of lower scheduling priority
            (on Linux, nice raised by 10; elsewhere normal threads), so that other threads of the process
            (a decode step's) take the cores first where they compete. The IceCache runtime
            builds its indexes this way. :meth:`write_pages` and :meth:`insert` take
            ``background`` per call as well.
    """

    def __new__(
        cls,
        keys: npt.ArrayLike,
        *,
        page_size: int = 16,
        page_format: str = "native",
        seed: Optional[int] = None,
        threads: Optional[int] = None,
        num_simple: Optional[int] = None,
        num_composite: Optional[int] = None,
        promotion: Union[float, Sequence[float], None] = None,
        effort: float = 1.0,
        background: bool = False,
    ) -> Self: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def page_format(self) -> str:
        """The page stores' format: ``"native"``, ``"int8"`` or ``"k8v4"``."""
    def __len__(self) -> int:
        """Tokens per head."""
    def num_pages(self, head: int) -> int:
        """Pages of ``head`` (numbered ``0..num_pages``; pages are never freed)."""
    def max_pages(self) -> int:
        """Largest ``num_pages`` over the heads: the page stores need at least this many."""
    def nbytes(self) -> int:
        """Approximate host bytes of the trees, cells and page layouts, and, with
        ``page_format="native"``, the int8 rows of the keys the forest keeps. The page stores,
        which the caller owns, are not counted."""
    def page_tokens(self, head: int, page: int) -> npt.NDArray[np.int64]:
        """Token positions in ``page`` of ``head``, in slot order (at most ``page_size``)."""
    def token_map(self, head: int) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """``(page, slot)`` of every token position of ``head``."""
    def write_pages(
        self,
        k_src: npt.ArrayLike,
        v_src: npt.ArrayLike,
        k_store: npt.ArrayLike,
        v_store: npt.ArrayLike,
        *,
        background: Optional[bool] = None,
    ) -> None:
        """Writes K and V of every token (``[H_kv, n, d]`` in position order) into the page stores
        (``[H_kv, P, page_size, d]``, same dtype, writable, ``P >= max_pages()``), in parallel.
        Unfilled slots of the forest's pages are zeroed; pages past them are left untouched.

        8-bit stores (``page_format="int8"``): uint8 ``[H_kv, P, page_size * (d + 4)]``; each page
        holds its rows' int8 codes (``page_size * d`` bytes), then one float32 scale per row
        (``max |x| / 127``; a row is ``code * scale`` within ``scale / 2``). Values must then be
        finite (``ValueError``). The K store written is where the forest reads its keys from
        afterwards.

        ``page_format="k8v4"``: the K store as for ``"int8"``; the V store uint8 ``[H_kv, P,
        codes + page_size * ceil(d / 32) * 4]`` with ``codes = page_size * ceil(d / 2)`` rounded
        up to even: each row's 4-bit codes, two a byte (value ``2j`` in the low nibble of byte
        ``j``), then per row and group of 32 values a bfloat16 ``step`` and ``minimum`` (native
        byte order). A value is ``minimum + code * step`` within ``step / 2``; ``minimum`` is
        the group's, rounded down, ``step`` its span over 15, rounded up.

        ``k_src`` must be the keys the forest was built on (plus those ``insert`` added), in the
        same dtype, and finite: other keys or NaN/inf are a ``ValueError`` and nothing is
        written. One exception: once the forest's own keys were written, a layer that reuses its
        page layout (a reuse group's follower) may write its own keys into its own stores, which
        then must not be the forest's (they are told apart by a checksum of each head's page 0).
        The check reads every key once more (measured: about as long again as the write of
        16-bit pages).

        ``background``: the pool the write runs on, as for :meth:`insert`."""
    def select(
        self,
        queries: npt.ArrayLike,
        max_pages: int,
        *,
        k_store: Optional[npt.ArrayLike] = None,
        scale: Optional[float] = None,
        effort: Optional[float] = None,
        exact: bool = False,
        successors: int = 0,
        group_view: bool = False,
    ) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """Pages for one decode step: ``queries`` is ``[H_q, d]`` (``H_q`` a multiple of ``H_kv``;
        query head ``j`` belongs to KV head ``j // (H_q // H_kv)``). Returns ``(pages, counts)``:
        ``pages[h, :counts[h]]`` are KV head ``h``'s pages ranked by the group's attention mass
        (each query head's softmax with ``scale``, default ``1/sqrt(d)``, over the keys its search
        scores, summed over the group); the rest is -1. Keys are scored from their int8 rows
        against the int8 query; ``exact`` scores every key instead of searching. ``k_store``: the
        8-bit K store the forest's keys live in (``page_format="int8"`` or ``"k8v4"``; ``None`` otherwise): the
        one ``write_pages`` wrote them to, or a copy of it (``ValueError`` otherwise).
        ``effort``: the search effort of every head; ``None``: each head's own (``efforts``, as
        ``calibrate`` set them). ``successors``: the weight of each query head's ``successors``
        heaviest keys also goes to the page holding the next position (for selecting a step
        ahead: a head that copies text attends one token further on at the next step).
        ``group_view``: the query heads of a group search one shared field of view instead of
        one each: the leaf cells each head ranks best, taken in turn (every head's best, then
        every head's second best, ...) until the view holds as many cells as one head's own;
        every head of the group scores every key in it. The group's keys are read once instead
        of once per query head. Ignored with ``exact``."""
    def calibrate(
        self,
        queries: npt.ArrayLike,
        k: int,
        target_recall: float = 0.95,
        *,
        k_store: Optional[npt.ArrayLike] = None,
        min_effort: float = 0.0625,
        max_effort: float = 64.0,
    ) -> List[Calibration]:
        """Calibrates each KV head's own effort (``efforts``; what ``select`` uses with
        ``effort=None``) as ``DCIIndex.calibrate`` does, on the queries of its GQA group:
        ``queries`` is ``[H_q, n, d]`` (e.g. the last queries of the prompt at this layer; query
        head ``j`` belongs to KV head ``j // (H_q // H_kv)``). A query's recall@``k`` is the share
        of its ``k`` best keys (one scan of every key's int8 row per query, scored as selection
        scores them) in the field of view of a selection of ``2 * k`` tokens at that effort, so
        a selection with ``max_pages * page_size >= 2 * k`` scores at least the calibrated share
        of each query's top ``k``. ``k_store`` as for :meth:`select`. Returns one
        ``Calibration`` per KV head. Every head is measured (in parallel) before any changes:
        bad input raises ``ValueError`` and changes nothing."""
    @property
    def efforts(self) -> List[float]:
        """Each KV head's own search effort (the constructor's, or as ``calibrate`` set it)."""
    def insert(
        self,
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        k_store: npt.ArrayLike,
        v_store: npt.ArrayLike,
        *,
        background: Optional[bool] = None,
    ) -> List[npt.NDArray[np.int32]]:
        """Appends ``m`` tokens per head (``[H_kv, m, d]``), writes their K/V (and any tokens a page
        split moves) into the stores, and returns per head the pages whose contents changed.
        The stores need ``P >= max_pages() + m`` and must be those :meth:`write_pages` wrote the
        forest's keys to (or a copy; ``ValueError`` otherwise, nothing inserted). 8-bit stores as
        for :meth:`write_pages`: new tokens are quantised, moved tokens keep their codes and scales.
        Each new key joins the leaf cell nearest it (or, with the first promotion ratio, opens one of its own) and the
        nearest page of that cell with room; when all are full, the nearest page splits in two.

        ``background``: the pool the insert runs on, as the constructor's argument (``None``: the
        forest's own). A caller that waits for the insert while builds keep the background pool
        busy passes ``False``: work handed to a busy pool waits until its threads run out of the
        build's tasks (up to most of the build), while the normal pool's threads are free and
        take the cores first."""

@final
class ResidentPages:
    """Which pages of each KV head are on the device, and in which device page slot.

    ``capacity`` device slots per head (at most 2**31 - 1; memory follows the slots in use).
    ``plan`` maps a step's selection to device slots, reusing resident unchanged pages and
    evicting the least recently used ones. ``plan`` and ``invalidate`` are writers (see the
    module docs)."""

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
    def slot_pages(self) -> npt.NDArray[np.int32]:
        """``[H_kv, capacity]``: the page in each device slot, -1 for an empty one."""

def gather_pages(
    k_store: npt.ArrayLike,
    v_store: npt.ArrayLike,
    heads: npt.ArrayLike,
    pages: npt.ArrayLike,
    k_stage: npt.ArrayLike,
    v_stage: npt.ArrayLike,
) -> None:
    """Copies page ``pages[i]`` of head ``heads[i]`` from the stores (``[H_kv, P, S, d]``) into row
    ``i`` of the staging buffers (``[R, S, d]``, same dtype, ``R >= len(pages)``), in parallel.
    A standalone building block (benches, other runtimes): IceCache's runtime gathers inside its
    look-ahead jobs (:class:`LookAheadLayer`), which also plan residency and write the staging
    layout in the same call."""

@final
class LookAhead:
    """The look-ahead worker: one native dispatcher thread and a pool of ``threads`` threads
    (``None``: one per core) that run :class:`LookAheadLayer` jobs without the GIL. A job waits
    until the device has written its step number into the job's flag (behind the step's
    queries), so queued jobs start while Python and the device carry on."""

    def __new__(cls, threads: Optional[int] = None) -> Self: ...
    def cancel(self) -> None:
        """Makes every queued job that has not started yet finish as cancelled (a decode step
        was abandoned, so its flags will never come)."""

@final
class StagingLayout:
    """The fixed layout of a layer's staging buffer (byte offsets), for
    :meth:`LookAheadLayer.staging_layout`. Every region has room for the most a job can write;
    padded entries name the device pool's ``trash`` slot, so that the device applies any step
    with the same operations and only the used prefix (``LookAheadOutcome.end``) is copied:

    - from ``load_idx_at`` (0): int64 ``load_idx [max_loads]``, the device slot of each loaded page
      as ``(b * H_kv + head) * capacity + slot``;
    - from ``mask_idx_at``: int64 ``mask_idx [max_masks]``, the slots whose valid-token mask
      changes (the loaded ones, then the slots cleared because their page changed and was not
      selected again);
    - from ``table_at``: int32 ``table [table_entries]`` (``[B, H_kv, width]``), the device slot of
      each selected page in the host's rank order (-1 past the head's count);
    - from ``table_len_at``: int32 ``table_len [table_entries]``, the valid tokens of each;
    - from ``mask_at``: ``[max_masks, page_size]`` bytes, 1 where the slot holds a token;
    - from ``rows_at``: each loaded page's K then V, as the stores hold them: ``[max_loads,
      k_page_bytes + v_page_bytes]`` bytes (``[max_loads, 2, page_size, d]`` elements with
      ``page_format="native"``; see :meth:`HeadForest.write_pages` for the quantised pages).

    Offsets are in bytes, entries in native byte order; ``mask_idx_at == 8 * max_loads`` and each
    region ends where the next begins, up to ``mask_at`` (``rows_at`` is aligned to 64 bytes).
    """

    max_loads: int
    max_masks: int
    #: Entries of ``table`` and of ``table_len``: ``batch * kv_heads * max_pages``.
    table_entries: int
    trash: int
    load_idx_at: int
    mask_idx_at: int
    table_at: int
    table_len_at: int
    mask_at: int
    rows_at: int
    #: Bytes of one K page and of one V page in the stores and in staging.
    k_page_bytes: int
    v_page_bytes: int
    bytes: int

@final
class LookAheadOutcome:
    """What a finished job did: ``loads`` pages loaded and ``clears`` slots cleared (see
    :class:`StagingLayout` for where; ``end``: the used prefix of the staging buffer, in bytes),
    ``width`` pages selected per (sequence, KV head) at most."""

    loads: int
    clears: int
    width: int
    end: int
    #: Pages selected, over sequences and KV heads.
    selected: int
    #: Seconds the job waited for its flag (and leader), inserted, selected and planned, gathered.
    wait_s: float
    insert_s: float
    select_s: float
    gather_s: float

@final
class LookAheadLayer:
    """One IceCache layer's host jobs: insert the tokens its window flushed, select pages for the
    step's queries, plan their device slots (:class:`ResidentPages`), gather the missing pages and
    the metadata into ``staging`` (:class:`LookAheadOutcome`).

    The arrays are lent, not copied: ``queries`` ``[B, H_q, d]`` float32, ``flag`` ``[1]`` int64,
    ``flush_k``/``flush_v`` ``[B, kv_heads, page_size, d]`` (the stores' dtype: float32, float16
    or bfloat16 as uint16), ``staging`` uint8 of :meth:`staging_layout` ``bytes``; every job keeps a
    reference to each until it has finished. The caller must not touch them, nor a lane's
    stores and histories, while a job runs (:meth:`done`, :meth:`wait`).

    A layer with a ``leader`` reuses that layer's page layout: its ``n``-th job waits for the
    leader's ``n``-th, appends its flushed tokens to its history, rewrites the pages the leader's
    insert changed and gathers the same pages from its own stores.

    Args:
        worker: the :class:`LookAhead` that runs the jobs.
        max_pages: pages selected per (sequence, KV head).
        scale, effort, successors, group_view: as for :meth:`HeadForest.select`
            (``effort=None``: each KV head's own, ``HeadForest.efforts``, as the constructor or
            ``calibrate`` set them).
        refresh: queued jobs select anew every ``refresh`` jobs, and whenever tokens were
            flushed; the others only insert (jobs run now always select).
        page_format: ``"native"``: the stores hold the flushed tokens' dtype; ``"int8"`` or
            ``"k8v4"``: uint8 quantised stores (see :meth:`HeadForest.write_pages`), which inserts
            and a follower's rewrites quantise (values must be finite).
    """

    def __new__(
        cls,
        worker: LookAhead,
        queries: npt.NDArray[np.float32],
        flag: npt.NDArray[np.int64],
        flush_k: npt.NDArray[Any],
        flush_v: npt.NDArray[Any],
        staging: npt.NDArray[np.uint8],
        *,
        kv_heads: int,
        page_size: int,
        max_pages: int,
        scale: float,
        effort: Optional[float] = None,
        successors: int = 0,
        refresh: int = 1,
        leader: Optional[LookAheadLayer] = None,
        page_format: str = "native",
        group_view: bool = False,
    ) -> Self: ...
    def set_lane(
        self,
        b: int,
        k_store: npt.NDArray[Any],
        v_store: npt.NDArray[Any],
        *,
        forest: Optional[HeadForest] = None,
        resident: Optional[ResidentPages] = None,
        k_history: Optional[npt.NDArray[Any]] = None,
        v_history: Optional[npt.NDArray[Any]] = None,
    ) -> None:
        """Lends sequence ``b``'s page stores ``[kv_heads, P, page_size, d]`` (quantised formats:
        uint8 ``[kv_heads, P, page bytes]``, see :meth:`HeadForest.write_pages`), and its index
        (``forest``, ``None`` while nothing is offloaded, and ``resident``; leading layers) or its
        histories ``[kv_heads, n, d]`` (layers with a leader). Call again after reallocating any
        of them; not while a job runs (``RuntimeError``)."""
    def start(
        self, flushed: Sequence[int], *, step: Optional[int] = None, history_lens: Optional[Sequence[int]] = None
    ) -> None:
        """Starts the job for one step: ``flushed[b]`` tokens of sequence ``b`` wait in the flush
        buffers for the index. ``step``: queue the job until ``flag[0] == step``; ``None``: run
        it now, on this thread (without the GIL). ``history_lens`` (layers with a leader): each
        history's length once the flushed tokens are appended. Raises ``RuntimeError`` while the
        previous job runs."""
    @staticmethod
    def start_all(
        layers: Sequence[LookAheadLayer],
        flushed: Sequence[Sequence[int]],
        *,
        steps: Sequence[int],
        history_lens: Sequence[Optional[Sequence[int]]],
    ) -> None:
        """:meth:`start` for one decode step of several layers, queued in their order (a layer
        with a leader after it) with the GIL released once, which a step of many layers would
        otherwise pay per layer: ``layers[i].start(flushed[i], step=steps[i],
        history_lens=history_lens[i])``. Every layer's arguments are checked before any job
        starts (``ValueError``); a layer whose job cannot start (``RuntimeError``: its previous
        job still runs, or its leader's has not started) raises after the layers before it
        started theirs, as separate calls would."""
    def done(self) -> bool:
        """Whether the current job has finished (``True`` when there is none)."""
    def wait(self) -> LookAheadOutcome:
        """Blocks (without the GIL) until the current job has finished; its outcome. Raises its
        error (``RuntimeError``) as often as it is asked."""
    @staticmethod
    def wait_all(layers: Sequence[LookAheadLayer]) -> List[LookAheadOutcome]:
        """:meth:`wait` for several layers, with the GIL released once: their outcomes, in
        order. Raises the first error among them (``RuntimeError``; also for a layer that started
        no job)."""
    def selected(self) -> npt.NDArray[np.int32]:
        """``[B, kv_heads, max_pages]``: the pages the current job selected, ranked (-1 past each
        head's count; a following layer gives its leader's). Waits for the job."""
    def clear(self) -> None:
        """Forgets the current job and every lane (after the job finished or was cancelled)."""
    @staticmethod
    def staging_layout(
        *,
        batch: int,
        kv_heads: int,
        dim: int,
        page_size: int,
        itemsize: int,
        max_pages: int,
        capacity: int,
        page_format: str = "native",
    ) -> StagingLayout:
        """The staging layout of a layer of this shape: ``capacity`` device page slots per
        (sequence, KV head), ``max_pages`` selected per step, pages in ``page_format``."""
