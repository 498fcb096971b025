"""The host side of one IceCache layer: its page stores, its index (or its leader's), and the
look-ahead jobs that insert flushed tokens, select pages and stage them for the device.

A layer either leads its reuse group (:class:`LeaderJobs`: it owns the group's indexes and
selects) or follows a leader (:class:`FollowerJobs`: it keeps its own keys in position order and
writes them into its stores in the leader's layout). What a follower reads of its leader is
:attr:`LeaderJobs.indexes`, :attr:`LeaderJobs.page_bound` and :attr:`LeaderJobs.built_now`; the
last two describe the leader's current job, so within a decode step the leader starts its job
before its followers start theirs (they come after it in layer order).
"""

from __future__ import annotations

import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from icecache import _core
from icecache.runtime.pages import History, PageIndex, PageStore, numpy_view
from icecache.runtime.runtime import Runtime
from icecache.runtime.staging import Staging, StagingView
from icecache.runtime.transfer import StepBuffers

__all__ = ["FollowerJobs", "LayerJobs", "LeaderJobs", "QueuedStart", "start_all", "wait_all"]

#: One sequence's prompt middle for the index worker: ``(b, keys, values, last queries or None)``.
Middle = Tuple[int, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


class QueuedStart(NamedTuple):
    """A look-ahead job ready to be queued (:meth:`LayerJobs.queued_start`): the arguments of
    ``_core.LookAheadLayer.start`` for ``lookahead``."""

    lookahead: _core.LookAheadLayer
    flushed: List[int]
    step: int
    history_lens: Optional[List[int]]


def start_all(starts: Sequence[QueuedStart]) -> None:
    """Queue the jobs of ``starts`` (one decode step of several layers, a leader before the
    layers that follow it) in one native call, which releases the GIL once instead of per layer."""
    if starts:
        _core.LookAheadLayer.start_all(
            [s.lookahead for s in starts],
            [s.flushed for s in starts],
            steps=[s.step for s in starts],
            history_lens=[s.history_lens for s in starts],
        )


def wait_all(jobs: Sequence["LayerJobs"]) -> List[_core.LookAheadOutcome]:
    """:meth:`LayerJobs.wait` for several layers in one native call (the GIL released once)."""
    return _core.LookAheadLayer.wait_all([j._started_lookahead() for j in jobs]) if jobs else []


class LayerJobs:
    """What leaders and followers share: the stores, the decode steps' host buffers (kept
    across prompts while the shapes stay the same: pinning is slow on some hosts), the staging
    layout, and the layer's ``_core.LookAheadLayer``, made at its first decode step.

    Call :meth:`open` for each prompt before anything else.
    """

    def __init__(self, runtime: Runtime, layer_idx: int):
        self.runtime = runtime
        self.layer_idx = layer_idx
        # None until buffers() and _staging_views() make them.
        self._made_buffers: Optional[StepBuffers] = None
        self._made_views: Optional[Tuple[StagingView, StagingView]] = None
        self.forget()

    def forget(self) -> None:
        """The state of a layer that has seen no prompt (the buffers stay)."""
        #: The layer's native jobs, made at its first decode step (:meth:`open_lanes`).
        self.lookahead: Optional[_core.LookAheadLayer] = None
        #: The number of the last job started behind a device step (look-ahead).
        self.steps = 0
        #: Whether the first job was started ahead of the first decode step (:meth:`start_ahead`).
        self.started_ahead = False

    def open(self, batch: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Empty stores (and index or history) for a prompt of these shapes."""
        cfg = self.runtime.config
        S = cfg.page_size
        bufs = self._made_buffers
        if bufs is not None and (bufs.flush_k.shape != (batch, heads, S, dim) or bufs.flush_k.dtype != dtype):
            self._made_buffers = self._made_views = None  # an earlier prompt's buffers, of other shapes
        self.batch, self.heads, self.dim, self.dtype, self.device = batch, heads, dim, dtype, device
        self.staging = Staging.for_layer(cfg, batch=batch, kv_heads=heads, dim=dim, dtype=dtype)
        self.stores = [PageStore(heads, S, dim, dtype, cfg.page_format) for _ in range(batch)]
        self._open_sequences()

    # -------------------------------------------------------------- what the roles differ in

    def _open_sequences(self) -> None:
        raise NotImplementedError

    def catch_up(self, b: int, k: torch.Tensor, v: torch.Tensor, *, background: bool = True) -> None:
        """Put sequence ``b``'s tokens ``[H_kv, c, D]`` (CPU) into its index and stores, in
        position order after the ones indexed before (the first ones build the index): the
        prompt's middle, and the tokens that left the window during a bridge.

        ``background``: whether the work may run on the background pool, where the index
        worker's builds run. A decode step passes ``False`` (the work runs on the normal pool):
        handed to the background pool it would wait for the threads to run out of a build's
        tasks (benches/RESULTS.md, "A decode step's inserts beside the index builds")."""
        raise NotImplementedError

    def calibrate(self, b: int, q: torch.Tensor) -> None:
        """Index worker: calibrate sequence ``b``'s index on its last prompt queries ``[H_q, n,
        D]`` (``effort="auto"``; a leader's job: followers have no index of their own)."""
        raise NotImplementedError

    def restart(self, b: int) -> None:
        """Index worker, before the first decode step: empty sequence ``b``'s stores (and index
        or history), for a build of its whole prompt."""
        cfg = self.runtime.config
        self.stores[b] = PageStore(self.heads, cfg.page_size, self.dim, self.dtype, cfg.page_format)
        self._restart_sequence(b)

    def _restart_sequence(self, b: int) -> None:
        raise NotImplementedError

    @property
    def group_indexes(self) -> List[PageIndex]:
        """The reuse group's indexes, one per sequence (the leader's)."""
        raise NotImplementedError

    @property
    def calibrates(self) -> bool:
        """Whether this layer's index calibrates on the prompt's queries (``effort="auto"``)."""
        return False

    def _leader_lookahead(self) -> Optional[_core.LookAheadLayer]:
        return None

    def _reserve_first(self, b: int) -> None:
        """Room for the first decode job's writes, before the first lending."""
        raise NotImplementedError

    def _lend(self, b: int) -> None:
        """Lend sequence ``b``'s buffers to the native jobs (again after they grew)."""
        raise NotImplementedError

    def _reserve(self, flushed: List[int], most: int) -> None:
        """Room for what the next job writes (``most``: the most tokens any sequence flushed)."""
        raise NotImplementedError

    def _history_lens(self) -> Optional[List[int]]:
        return None

    def _first_pages(self, flushed: List[int]) -> None:
        """Build the index of a sequence whose prompt fit in sink and window from its first
        flushed page, here and now (rare: short prompts), so that the job only selects; a
        following layer writes its first pages in that layout here too. The tokens count as
        handed to the job, which drops them from the window when applied; ``flushed[b]``
        becomes 0 for them."""
        raise NotImplementedError

    def host_nbytes(self) -> int:
        """Host bytes of the stores, the index or history, and the decode steps' buffers."""
        host = sum(s.nbytes() for s in self.stores)
        if self._made_buffers is not None:
            host += self._made_buffers.nbytes()
        return host

    # -------------------------------------------------------------- prompt

    def index_prompt(self, middles: List[Middle], ready: Optional[torch.cuda.Event]) -> None:
        """Index worker: copy each sequence's middle tokens (device) to the host behind
        ``ready``, the event recorded after the work that produced them, and index them (and
        make the decode steps' host buffers: pinning memory is slow on some hosts); with
        ``effort="auto"``, calibrate each index on the sequence's last prompt queries."""
        self.buffers()
        for b, k, v, q in middles:
            k_host, v_host, *q_host = self.runtime.transit.to_host(ready, k, v, *([] if q is None else [q]))
            self.catch_up(b, k_host, v_host)
            if q_host:
                self.calibrate(b, q_host[0])

    # -------------------------------------------------------------- decode

    def buffers(self) -> StepBuffers:
        """The layer's host buffers, made on first use (the query heads are known from the
        model config: ``runtime.query_heads``)."""
        if self._made_buffers is None:
            self._made_buffers = StepBuffers(
                self.device,
                self.batch,
                self.heads,
                self.runtime.query_heads,
                self.dim,
                self.runtime.config.page_size,
                self.dtype,
                self.staging.bytes,
            )
            self._made_views = None
        return self._made_buffers

    def _staging_views(self) -> Tuple[StagingView, StagingView]:
        bufs = self.buffers()
        if self._made_views is None:
            self._made_views = (self.staging.view(bufs.staging), self.staging.view(bufs.device_staging))
        return self._made_views

    @property
    def host_staging(self) -> StagingView:
        """The regions of the host staging buffer (what the last job wrote)."""
        return self._staging_views()[0]

    @property
    def device_staging(self) -> StagingView:
        """The regions of its device copy (on the CPU: the host buffer itself)."""
        return self._staging_views()[1]

    def open_lanes(self, query_heads: int, scale: float) -> None:
        """Make the native jobs and lend them every sequence's buffers (first decode step,
        after the prompt is indexed)."""
        cfg = self.runtime.config
        bufs = self.buffers()
        if bufs.queries.shape[1] != query_heads:
            raise ValueError(
                f"layer {self.layer_idx} got {query_heads} query heads, the model config says "
                f"{self.runtime.query_heads}"
            )
        self.lookahead = _core.LookAheadLayer(
            self.runtime.lookahead_worker,
            bufs.queries.numpy(),
            bufs.flag.numpy(),
            numpy_view(bufs.flush_k),
            numpy_view(bufs.flush_v),
            bufs.staging.numpy(),
            kv_heads=self.heads,
            page_size=cfg.page_size,
            max_pages=cfg.selected_pages,
            scale=scale,
            effort=None,  # each KV head's own: the configured effort, or as calibrated
            successors=cfg.successors if cfg.lookahead else 0,
            refresh=cfg.refresh,
            leader=self._leader_lookahead(),
            page_format=cfg.page_format,
            group_view=cfg.group_view,
        )
        for b in range(self.batch):
            self._reserve_first(b)
            self._lend(b)

    def _started_lookahead(self) -> _core.LookAheadLayer:
        """:attr:`lookahead`, which decoding needs: raises before the first decode step."""
        if self.lookahead is None:
            raise RuntimeError(f"IceCache layer {self.layer_idx} has not started decoding")
        return self.lookahead

    def start(self, flushed: List[int], query: Optional[torch.Tensor], now: bool) -> None:
        """Start the job that prepares the next step, with the tokens the window ``flushed``
        since the last job: run now (``now``: fresh selection, or the first step; its queries
        are copied here) or queued until the flag that the device step writes behind this
        step's queries (look-ahead)."""
        if not now:
            queued = self.queued_start(flushed)
            queued.lookahead.start(queued.flushed, step=queued.step, history_lens=queued.history_lens)
            return
        bufs = self.buffers()
        lens = self._prepare(flushed)
        if query is None:
            raise ValueError("a job that runs now needs the step's queries")
        bufs.queries.copy_(query)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._started_lookahead().start(flushed, history_lens=lens)

    def queued_start(self, flushed: List[int]) -> QueuedStart:
        """What :meth:`start` queues with look-ahead for the tokens the window ``flushed`` (the
        step counted, the job's room made), for :func:`start_all` to queue with other layers'."""
        self.buffers()
        lens = self._prepare(flushed)
        # The device step copied the queries and wrote the step number (behind the attention).
        self.steps += 1
        return QueuedStart(self._started_lookahead(), flushed, self.steps, lens)

    def start_ahead(self, flushed: List[int], query: Optional[torch.Tensor]) -> None:
        """Start the first decode step's job before that step, from the queries of the step
        before it (``[B, H_q, D]`` on the device; a follower has none), as a look-ahead job is
        started: queued on the worker until the device has copied them, behind the work queued
        so far, so the host neither waits for the device nor for the selection. The job is
        number 0: the first device step writes 1."""
        bufs = self.buffers()
        lens = self._prepare(flushed)
        if query is not None:
            bufs.queries.copy_(query.float(), non_blocking=True)
        bufs.flag.copy_(torch.zeros(1, dtype=torch.int64, device=self.device), non_blocking=True)
        self._started_lookahead().start(flushed, step=0, history_lens=lens)
        self.started_ahead = True

    def _prepare(self, flushed: List[int]) -> Optional[List[int]]:
        """What every job needs first: the first pages of sequences without an index, room for
        the job's writes; returns a follower's history lengths."""
        if max(flushed):
            self._first_pages(flushed)
        most = max(flushed)  # after _first_pages, which zeroes the flushes it built an index from
        if most:
            self._reserve(flushed, most)
        return self._history_lens()

    def wait(self) -> _core.LookAheadOutcome:
        """The current job's outcome, once it has finished."""
        return self._started_lookahead().wait()

    def upload(self, o: _core.LookAheadOutcome, fresh: bool) -> Optional[torch.Tensor]:
        """Copy the job's staging (its used prefix) to the device, for the device step to apply;
        returns the selection's pool slots ``[B, H, width]`` (rank order, -1 past the count)
        when fresh selection needs them. Without loads or clears nothing is copied: the device
        step re-applies the last loads, which changes nothing."""
        if not (o.loads or o.clears or fresh):
            return None
        self.buffers().upload(o.end, job=self.steps)
        return self.device_staging.table(o.width) if fresh else None

    def staging_part(self, o: _core.LookAheadOutcome) -> Optional[Tuple[StepBuffers, int]]:
        """What :meth:`upload` would copy for the look-ahead job's outcome ``o`` on a GPU, for a
        caller that copies several layers' staging together (``transfer.upload_together``):
        ``(buffers, bytes)``, or ``None`` where nothing is copied (no loads or clears; the CPU)."""
        if self.device.type != "cuda" or not (o.loads or o.clears):
            return None
        return self.buffers(), o.end

    def upload_ahead(self) -> None:
        """With look-ahead on a GPU, start the copy of this layer's next staging now, on the
        runtime's copy stream, if the job that wrote it has finished: called by the IceCache
        layer before this one, so the copy overlaps the device's work on the layers in between
        instead of stalling this layer's step (:meth:`StepBuffers.upload` then only waits for
        it). Safe without further sync: the job started only after the device wrote this
        layer's previous step number, which its step does after reading the previous staging,
        and the next job writes the staging only after the next step number, which the device
        writes after waiting for this copy."""
        rt = self.runtime
        if self.device.type != "cuda" or not rt.config.lookahead or self.lookahead is None or self.steps == 0:
            return
        if not self.lookahead.done():
            return
        try:
            o = self.lookahead.wait()  # finished: returns at once
        except Exception:
            return  # the job's error is raised by this layer's own step
        if o.loads or o.clears:
            self.buffers().upload_ahead(o.end, self.steps, rt.copy_stream())
            rt.stats.copies_ahead += 1

    def close(self) -> None:
        """Wait for a job still running (its buffers must outlive it) and drop its outcome,
        then forget the prompt."""
        if self.lookahead is not None:
            self.runtime.lookahead_worker.cancel()
            try:
                self.lookahead.wait()
            except RuntimeError:
                pass  # cancelled, or failed: forgotten either way
            self.lookahead.clear()
        bufs = self._made_buffers
        if bufs is not None:
            # The next prompt's jobs count their steps from 0 again: a step number left in the
            # kept flag would let them start before the device has written their queries, and
            # write the staging while the device still copies the previous one.
            if bufs.device.type == "cuda":
                torch.cuda.synchronize(bufs.device)  # the last step's write of the flag has landed
            bufs.flag.fill_(-1)
            bufs.forget_ahead()
        self.forget()


class LeaderJobs(LayerJobs):
    """A layer that leads its reuse group: it owns the indexes and selects pages."""

    def _open_sequences(self) -> None:
        #: One index per sequence: the page layout and device residency of the whole group.
        self.indexes = [PageIndex(self.heads, self.runtime.config) for _ in range(self.batch)]
        #: Pages every store of the group must have room for during the current job (the
        #: leader's inserts; its followers write as many). Set by :meth:`start` when the job
        #: has flushed tokens.
        self.page_bound = 0
        #: Per sequence: whether the current job's first pages built its index (short prompts).
        self.built_now = [False] * self.batch
        #: Per sequence, the recall probe's token maps of the current step (``track_recall``;
        #: :func:`icecache.runtime.probe.track_recall`), kept for the followers' probes.
        self.probe_maps: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def group_indexes(self) -> List[PageIndex]:
        return self.indexes

    def _restart_sequence(self, b: int) -> None:
        self.indexes[b] = PageIndex(self.heads, self.runtime.config)

    @property
    def calibrates(self) -> bool:
        return self.runtime.config.calibrates

    def calibrate(self, b: int, q: torch.Tensor) -> None:
        """Index worker: calibrate sequence ``b``'s index on its last prompt queries ``[H_q, n,
        D]`` (CPU, the keys' dtype; ``effort="auto"``)."""
        if self.indexes[b].forest is None:
            return  # the prompt fit in sink and window: the least effort stays
        t = time.perf_counter()
        self.indexes[b].calibrate(q.contiguous(), self.stores[b])
        self.runtime.stats.calibrate_s += time.perf_counter() - t

    def catch_up(self, b: int, k: torch.Tensor, v: torch.Tensor, *, background: bool = True) -> None:
        index, store = self.indexes[b], self.stores[b]
        if index.forest is None:
            index.add(k, v, store, background=background)
            return
        used = index.forest.max_pages()
        store.reserve(used + k.shape[1], used)  # the build left headroom
        index.forest.insert(numpy_view(k), numpy_view(v), *store.views(), background=background)

    def indexed_pages(self, b: int) -> int:
        """Pages sequence ``b``'s index uses now."""
        forest = self.indexes[b].forest
        return 0 if forest is None else forest.max_pages()

    def _reserve_first(self, b: int) -> None:
        self.stores[b].reserve(self.indexed_pages(b) + self.runtime.config.page_size, self.indexed_pages(b))

    def _lend(self, b: int) -> None:
        index = self.indexes[b]
        self._started_lookahead().set_lane(b, *self.stores[b].views(), forest=index.forest, resident=index.resident)

    def _reserve(self, flushed: List[int], most: int) -> None:
        self.page_bound = max(self.indexed_pages(b) for b in range(self.batch)) + most
        for b in range(self.batch):
            if self.stores[b].reserve(self.page_bound, self.indexed_pages(b)):
                self._lend(b)

    def _first_pages(self, flushed: List[int]) -> None:
        self.built_now = [False] * self.batch
        for b, m in enumerate(flushed):
            if not (m and self.indexes[b].forest is None):
                continue
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the flush copy
            bufs = self.buffers()
            k, v = bufs.flush_k[b, :, :m].clone(), bufs.flush_v[b, :, :m].clone()
            self.indexes[b].add(k, v, self.stores[b], background=False)  # the step waits for it
            self.built_now[b] = True
            flushed[b] = 0
            self._lend(b)

    def host_nbytes(self) -> int:
        return super().host_nbytes() + sum(ix.forest.nbytes() for ix in self.indexes if ix.forest is not None)


class FollowerJobs(LayerJobs):
    """A layer that reuses its leader's page layout, selection and device slots: it keeps its
    own keys in position order and writes its stores in the leader's layout."""

    def __init__(self, runtime: Runtime, layer_idx: int, leader: LeaderJobs):
        self.leader = leader
        super().__init__(runtime, layer_idx)

    def _open_sequences(self) -> None:
        #: Per sequence, the layer's offloaded keys and values in position order.
        self.histories = [History(self.heads, self.dim, self.dtype) for _ in range(self.batch)]

    @property
    def group_indexes(self) -> List[PageIndex]:
        return self.leader.indexes

    def _restart_sequence(self, b: int) -> None:
        self.histories[b] = History(self.heads, self.dim, self.dtype)

    def _leader_lookahead(self) -> Optional[_core.LookAheadLayer]:
        return self.leader.lookahead

    def catch_up(self, b: int, k: torch.Tensor, v: torch.Tensor, *, background: bool = True) -> None:
        self.histories[b].append(k, v)
        self.leader.indexes[b].follow(self.histories[b], self.stores[b], background=background)

    def _reserve_first(self, b: int) -> None:
        self.histories[b].reserve(self.histories[b].n + self.runtime.config.page_size)

    def _lend(self, b: int) -> None:
        k_hist, v_hist = self.histories[b].views()
        self._started_lookahead().set_lane(b, *self.stores[b].views(), k_history=k_hist, v_history=v_hist)

    def _reserve(self, flushed: List[int], most: int) -> None:
        for b in range(self.batch):
            history = self.histories[b]
            # Both, unconditionally: either may grow.
            grown = self.stores[b].reserve(self.leader.page_bound, self.leader.indexed_pages(b)) | history.reserve(
                history.n + flushed[b]
            )
            history.n += flushed[b]
            if grown:
                self._lend(b)

    def _history_lens(self) -> Optional[List[int]]:
        return [h.n for h in self.histories]

    def _first_pages(self, flushed: List[int]) -> None:
        for b, m in enumerate(flushed):
            if not (m and self.leader.built_now[b]):
                continue
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the flush copy
            bufs = self.buffers()
            self.catch_up(b, bufs.flush_k[b, :, :m].clone(), bufs.flush_v[b, :, :m].clone(), background=False)
            flushed[b] = 0
            self._lend(b)

    def host_nbytes(self) -> int:
        return super().host_nbytes() + sum(h.k.numel() * h.k.element_size() * 2 for h in self.histories)
