"""One IceCache layer: a transformers ``CacheLayerMixin`` for a full-attention layer whose
middle tokens are offloaded to CPU semantic pages and retrieved per decode step."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from icecache import _core
from icecache.runtime.config import CALIBRATION_POSITIONS, IceCacheConfig
from icecache.runtime.integration import hand_off
from icecache.runtime.pages import History, PageIndex, PageStore, numpy_view
from icecache.runtime.step import DeviceStep
from icecache.runtime.transfer import StepBuffers, Transit

__all__ = ["Bridge", "IceLayer", "Runtime", "RuntimeStats"]


#: The step that leaves the bridge (``IceCacheConfig.exact_until_indexed``) moves at most this
#: many tokens per sequence into the index itself (a page); a larger backlog goes to the index
#: worker first, while the bridge goes on: on the H200 host, moving the 359 tokens decoded during
#: a 128k build into 30 layers' indexes took 2.3 s, a stall of that step.
CATCH_UP_ON_THE_STEP = 16


@dataclass
class RuntimeStats:
    """Counters over the decode steps of all IceCache layers of one cache.

    Seconds on the decode path are host wall time (on a GPU they include waiting for it when
    :attr:`Runtime.sync_timing` is set): ``wait_s`` waiting for the layer's host job (with
    look-ahead: the worker's job for this step, normally finished already; with fresh
    selection, or on the first step after a prompt: the whole job, run on the spot),
    ``update_s`` taking the step's keys and values into the window (and handing a full window's
    oldest page to the host),
    ``copy_s`` the host-to-device copy of the step's pages and metadata and their scatter into
    the page pool, ``attend_s`` ranking and attention, ``recall_s`` the optional recall
    measurement, ``index_wait_s`` the time decode steps waited for the prefill pipeline.
    ``calibrate_s``: what that pipeline spent calibrating the indexes (``effort="auto"``, on the
    index worker, off the device's path: part of the time until the index is ready).
    ``worker_insert_s``, ``worker_select_s`` and ``worker_gather_s`` add up what the host jobs
    spent inserting flushed tokens, selecting and planning, and gathering pages (on the
    worker's threads, mostly off the critical path).
    ``copies_ahead`` counts the layer steps whose copy was started early, on a side stream,
    while the device computed the layers before (look-ahead on a GPU, once the layer's job had
    finished: :meth:`IceLayer.upload_ahead`; their ``copy_s`` is then mostly the scatter).
    ``bridged_steps`` counts the layer steps that attended the prompt's whole cache while the
    indexes were being built (``IceCacheConfig.exact_until_indexed``; ``index_wait_s`` is
    then the wait of the step that left the bridge, normally none) and ``catch_up_s`` the time
    that step spent moving the tokens decoded meanwhile into the indexes and windows.
    ``pages_selected`` counts the pages the host selected, ``pages_loaded`` those copied,
    summed over layers, sequences and KV heads; ``recalls`` holds one recall per (layer,
    sequence, retrieving step) and ``reranked`` one share per (layer, step) of attended pages that the
    device's ranking took from outside the host's top choices (both with ``track_recall``).
    """

    layer_steps: int = 0
    update_s: float = 0.0
    wait_s: float = 0.0
    copy_s: float = 0.0
    attend_s: float = 0.0
    recall_s: float = 0.0
    index_wait_s: float = 0.0
    calibrate_s: float = 0.0
    bridged_steps: int = 0
    catch_up_s: float = 0.0
    worker_insert_s: float = 0.0
    worker_select_s: float = 0.0
    worker_gather_s: float = 0.0
    pages_selected: int = 0
    pages_loaded: int = 0
    copies_ahead: int = 0
    recalls: List[float] = field(default_factory=list)
    reranked: List[float] = field(default_factory=list)

    @property
    def recall(self) -> float:
        """Mean attention recall over tracked (layer, sequence, step)s; NaN if none."""
        return float(np.mean(self.recalls)) if self.recalls else float("nan")


@dataclass
class Runtime:
    """State shared by the layers of one IceCache."""

    config: IceCacheConfig
    device: torch.device
    track_recall: bool
    stats: RuntimeStats = field(default_factory=RuntimeStats)
    #: Synchronise the device at every timing boundary so that the breakdown in :attr:`stats`
    #: is device time, not launch time (slower; for benchmarks).
    sync_timing: bool = False
    transit: Transit = field(init=False)
    _index: Optional[ThreadPoolExecutor] = None
    _pending: List[Future] = field(default_factory=list)
    #: Query heads of every attention layer (of this process: tensor parallelism shards them).
    query_heads: int = 0
    _worker: Optional[_core.LookAhead] = None
    _graph_pool: Optional[Any] = None
    _copy_stream: Optional[Any] = None
    #: The layers that hold a bridge (``IceCacheConfig.exact_until_indexed``), in layer order
    #: (a reuse group's leader first).
    bridged: List["IceLayer"] = field(default_factory=list)
    # The decode position the bridge decision was taken at, and that decision.
    _bridge_at: int = -1
    _bridging: bool = False

    def __post_init__(self) -> None:
        self.transit = Transit(self.device)

    @property
    def worker(self) -> _core.LookAhead:
        """The look-ahead worker (a native thread and pool), made on first use."""
        if self._worker is None:
            # By default every core but one: the Python thread that drives the device needs one.
            threads = self.config.threads or max(1, (os.cpu_count() or 2) - 1)
            self._worker = _core.LookAhead(threads)
        return self._worker

    def graph_pool(self) -> Any:
        """One CUDA graph memory pool for every layer's graphs (they replay in stream order)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def copy_stream(self) -> Any:
        """The side stream that early staging copies run on (:meth:`IceLayer.upload_ahead`)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    def submit(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the index worker: one thread, jobs in submission order (so a
        reuse group's leader is indexed before the layers that follow its layout)."""
        if self._index is None:
            self._index = ThreadPoolExecutor(1, thread_name_prefix="icecache-index")
        self._pending.append(self._index.submit(fn, *args))

    def wait_indexed(self, errors: bool = True) -> None:
        """Wait until every submitted prompt is offloaded and indexed. Decoding waits for all
        layers at once: a layer's first insert would otherwise race the worker still writing
        the pages of the layers that follow its layout. Re-raises a failed job's error at every
        call (``errors=False``: forget failed jobs)."""
        if not self._pending:
            return
        t = time.perf_counter()
        while self._pending:
            try:
                self._pending[0].result()
            except BaseException:
                if errors:
                    raise
            self._pending.pop(0)
        self.stats.index_wait_s += time.perf_counter() - t

    def bridging(self, position: int) -> bool:
        """Whether the decode step at ``position`` still attends the prompt's whole cache
        (``IceCacheConfig.exact_until_indexed``): while any prompt or catch-up job is unfinished, or
        more than a page per sequence waits for the index. Decided once per step, at its first
        IceCache layer, so that every layer leaves the bridge at the same step (a layer's first
        insert must not race the worker still writing the pages of the layers that follow its
        layout)."""
        if position != self._bridge_at:
            self._bridge_at = position
            self._bridging = self._keep_bridging()
        return self._bridging

    def _keep_bridging(self) -> bool:
        """Bridge on while prompt or catch-up jobs run; once they are done, leave the bridge if
        at most :data:`CATCH_UP_ON_THE_STEP` tokens per sequence wait for the index (or a job
        failed: the step raises its error), else hand the backlog to the worker first."""
        if not all(f.done() for f in self._pending):
            return True
        if not self.bridged or any(f.exception() is not None for f in self._pending):
            return False
        if self.bridged[0].bridge_backlog() <= CATCH_UP_ON_THE_STEP:
            return False
        for layer in self.bridged:  # in layer order: a reuse group's leader first
            layer.submit_catch_up()
        return True

    def leave_bridges(self) -> None:
        """Every bridged layer hands its tokens over (``IceLayer.leave_bridge``), all at once
        before any layer's first job: a leader's first job inserts the page its window flushes,
        which the layers that follow its layout must not see before their own catch-up.
        Raises a failed prompt job's error first."""
        self.wait_indexed()
        t = time.perf_counter()
        layers, self.bridged = self.bridged, []
        for layer in layers:
            layer.leave_bridge()
        self.stats.catch_up_s += time.perf_counter() - t

    def forget(self) -> None:
        """Fresh counters and bridge state for a new prompt (the jobs must be finished)."""
        self.stats = RuntimeStats()
        self._bridge_at, self._bridging, self.bridged = -1, False, []

    def tick(self) -> float:
        """A timestamp for the breakdown (after a device sync when :attr:`sync_timing`)."""
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class Bridge:
    """A layer's whole cache on the device while the indexes are built
    (``IceCacheConfig.exact_until_indexed``): the prompt's keys and values with the tokens
    decoded since, ``[B, H_kv, T + t, D]``, attended as a full cache does."""

    k: torch.Tensor
    v: torch.Tensor
    #: ``[B, T]`` real (non-padding) prompt positions, or ``None`` for all.
    valid: Optional[torch.Tensor]
    #: Per sequence, the first real token the index does not hold (at first the prompt's
    #: window; catch-up jobs move it on).
    unindexed: List[int]
    #: Per sequence, the prompt's padding positions.
    padding: List[int]

    def real(self, b: int) -> int:
        """Sequence ``b``'s real tokens so far."""
        return self.k.shape[-2] - self.padding[b]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = torch.cat([self.k, k], dim=-2)
        self.v = torch.cat([self.v, v], dim=-2)

    def tokens(self, b: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s real tokens ``[H_kv, n, D]``, keys and values."""
        kb, vb = self.k[b], self.v[b]
        if self.valid is None or bool(self.valid[b].all()):
            return kb, vb
        T = self.valid.shape[1]
        idx = torch.cat([self.valid[b].nonzero()[:, 0], torch.arange(T, kb.shape[1], device=self.valid.device)])
        idx = idx.to(kb.device)
        return kb[:, idx], vb[:, idx]


class IceLayer(CacheLayerMixin):
    """Cache of one full-attention layer under IceCache.

    The prompt is attended exactly; then per sequence the first ``sink`` real tokens and the
    last ``window`` stay on the device and the rest goes to a CPU :class:`PageStore` in
    semantic page order, indexed by a :class:`PageIndex`. Each decode token joins the window;
    when the window is full its oldest page of tokens goes to the index.

    Device layout: the page pool ``[2, B, H_kv, device_pages, page_size, D]`` (K and V) and the
    dense tokens ``[2, B, H_kv, sink + window + page_size, D]``: the sink, then the window as a
    ring with room for a flushed page that is still attended; each with a mask of the slots
    that hold a token.

    Decode step of this layer (see ``docs/ARCHITECTURE.md``): take the host job's outcome (with
    look-ahead, the job was started one step earlier from the previous queries and normally
    has finished; otherwise it runs now), copy its pages and metadata to the device in one
    transfer and scatter them into the pool, attend (ranking the pool's pages on the device
    with look-ahead), then hand this step's queries to the host behind the attention and start
    the next step's job. Tokens the window flushes stay attended from the window until the job
    that inserts them has been applied.

    Prefill is pipelined: the offload and index build of a layer's prompt run on the runtime's
    index thread (the copy on a side stream, the build in the core without the GIL, and with
    ``effort="auto"`` the calibration of its efforts on the prompt's last queries) while the
    device computes the next layers; the first decode step waits for them.

    A layer that leads its reuse group (``leader is None``) owns the indexes and selects
    pages; the others reuse the leader's page layout, selection and device slots, and rank the
    pool pages with their own queries.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, runtime: Runtime, layer_idx: int, leader: Optional[IceLayer] = None):
        super().__init__()
        self.runtime = runtime
        self.layer_idx = layer_idx
        self.leader = leader
        #: The IceCache layer after this one in the model (the last one's: the first), whose
        #: staging copy this one starts early (:meth:`upload_ahead`); set by :class:`IceCache`.
        self.next_layer: Optional[IceLayer] = None
        # The decode steps' host buffers (pinned on a GPU: kept across resets while the shapes
        # stay the same), made at the first decode step.
        self._bufs: Optional[StepBuffers] = None
        self._forget()

    def _forget(self) -> None:
        """The state of a layer that has seen no prompt."""
        self.is_initialized = False
        self.length = 0
        self.decoding = False
        self._prompt: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.jobs: Optional[_core.LookAheadLayer] = None
        self._step: Optional[DeviceStep] = None
        self._step_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._bridge: Optional[Bridge] = None
        self.steps = 0

    # ------------------------------------------------------------------ transformers API

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.runtime.config
        B, H, _, D = key_states.shape
        self.device, self.dtype = self.runtime.device, key_states.dtype
        self.batch, self.heads, self.dim = B, H, D
        C, S = cfg.device_pages, cfg.page_size
        bufs = self._bufs
        if bufs is not None and (bufs.flush_k.shape != (B, H, S, D) or bufs.flush_k.dtype != self.dtype):
            self._bufs = None  # an earlier prompt's decode buffers (before a reset), of other shapes
        self.ring = cfg.window + S  # room for a flushed page that is still attended
        L = cfg.sink + self.ring
        # K and V together, so that one copy loads a step's pages of both: the page pool, one row
        # per slot plus a trash row that padded loads land in ([2, B*H*C + 1, S*D]), and the
        # dense tokens (sink, then the window ring) [2, B, H, L, D]; each with its valid mask.
        self._pool_rows = torch.zeros(2, B * H * C + 1, S * D, dtype=self.dtype, device=self.device)
        self._pool_masks = torch.zeros(B * H * C + 1, S, dtype=torch.bool, device=self.device)
        self.pool_kv = self._pool_rows[:, : B * H * C].view(2, B, H, C, S, D)
        self.pool_valid = self._pool_masks[: B * H * C].view(B, H, C, S)
        self.pool_k, self.pool_v = self.pool_kv[0], self.pool_kv[1]
        self.dense_kv = torch.zeros(2, B, H, L, D, dtype=self.dtype, device=self.device)
        self.dense_valid = torch.zeros(B, H, L, dtype=torch.bool, device=self.device)
        self._ring_at = cfg.sink
        # Per sequence: valid sink tokens; the window's oldest ring slot and its tokens; how
        # many of its oldest tokens were flushed to a job that has not been applied yet.
        self.sink_len = [0] * B
        self.win_start = [0] * B
        self.win_len = [0] * B
        self._flushed = [0] * B  # flushed, not yet handed to a job
        self._in_job = [0] * B  # handed to the current job, still attended from the window
        self.stores = [PageStore(H, S, D, self.dtype, cfg.page_format) for _ in range(B)]
        if self.leader is None:
            self.indexes = [PageIndex(H, cfg) for _ in range(B)]
        else:
            self.histories = [History(H, D, self.dtype) for _ in range(B)]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take this step's keys and values (post-RoPE, ``[B, H_kv, T, D]``).

        The first call is the prompt: it is returned whole for exact attention and offloaded
        afterwards (see :meth:`ingest_prompt`). Later calls take one token per sequence.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._prompt = (key_states, value_states)
            self.length = key_states.shape[-2]
            hand_off(self)
            return key_states, value_states
        if key_states.shape[-2] != 1:
            raise NotImplementedError(
                f"IceCache takes one prompt and then one token per step; layer {self.layer_idx} "
                f"got {key_states.shape[-2]} tokens after the prompt (chunked prefill and "
                "speculative decoding are not supported)"
            )
        if key_states.shape[0] != self.batch:
            raise ValueError(f"batch size changed from {self.batch} to {key_states.shape[0]}")
        if self._bridge is not None:
            if self.runtime.bridging(self.length):
                self._bridge.append(key_states.to(self.device), value_states.to(self.device))
                self.length += 1
                self.runtime.stats.bridged_steps += 1
                hand_off(self)
                return self._bridge.k, self._bridge.v
            self.runtime.leave_bridges()
        self.runtime.wait_indexed()
        t = time.perf_counter()
        self._append(key_states.to(self.device), value_states.to(self.device))
        self.runtime.stats.update_s += time.perf_counter() - t
        self.length += 1
        hand_off(self)
        return key_states, value_states

    @property
    def bridging(self) -> bool:
        """Whether this layer attends its whole cache from the device, as a full cache does,
        while the indexes are built (``IceCacheConfig.exact_until_indexed``)."""
        return self._bridge is not None

    def get_seq_length(self) -> int:
        """Logical length: every position seen, offloaded and padding ones included."""
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget everything; the layer initialises again on the next prompt. A job still
        running is waited for (its buffers must outlive it) and its outcome dropped."""
        if self.jobs is not None:
            self.runtime.worker.cancel()
            try:
                self.jobs.wait()
            except RuntimeError:
                pass  # cancelled, or failed: forgotten either way
            self.jobs.clear()
        if self._bufs is not None:
            self._bufs.forget_ahead()
        self._forget()

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("IceCache does not support beam search, cropping or batch reshuffling")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported

    # ------------------------------------------------------------------ prompt and window

    def ingest_prompt(self, valid: Optional[torch.Tensor], queries: Optional[torch.Tensor] = None) -> None:
        """Offload the prompt taken by :meth:`update` once its exact attention has run.

        Args:
            valid: ``[B, T]`` bool of real (non-padding) positions, or ``None`` for all.
            queries: the prompt's queries ``[B, H_q, T, D]`` (post-RoPE), for ``effort="auto"``
                to calibrate the index on (see :meth:`load_prompt`).
        """
        if self._prompt is None:
            raise RuntimeError(f"layer {self.layer_idx} has no prompt to offload")
        k, v = self._prompt
        self._prompt = None
        self.load_prompt(k, v, valid, queries)

    def load_prompt(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: Optional[torch.Tensor],
        queries: Optional[torch.Tensor] = None,
    ) -> None:
        """Split each sequence's prompt keys/values ``[B, H_kv, T, D]`` into sink, middle
        (offloaded and indexed) and window; ``valid`` as for :meth:`ingest_prompt`. With
        ``effort="auto"``, a leading layer also keeps each sequence's queries ``[B, H_q, T, D]``
        of its last ``CALIBRATION_POSITIONS`` real positions, and the index worker calibrates
        the sequence's index on them once it is built (layers that reuse a leader's selection
        have no index of their own)."""
        cfg = self.runtime.config
        calibrate = cfg.calibrates and self.leader is None and queries is not None
        if not self.is_initialized:
            self.lazy_initialization(k, v)
            self.length = k.shape[-2]
        k, v = k.to(self.device), v.to(self.device)
        middles, unindexed = [], []
        for b in range(self.batch):
            kb, vb = k[b], v[b]
            qb = queries[b] if calibrate and queries is not None else None
            if valid is not None and not bool(valid[b].all()):
                idx = valid[b].nonzero()[:, 0].to(self.device)
                kb, vb = kb[:, idx], vb[:, idx]
                qb = None if qb is None else qb[:, idx.to(qb.device)]
            n = kb.shape[1]
            s = min(cfg.sink, n)
            w = min(cfg.window, n - s)
            ring = slice(self._ring_at, self._ring_at + w)
            self.dense_kv[0, b, :, :s], self.dense_kv[1, b, :, :s] = kb[:, :s], vb[:, :s]
            self.dense_kv[0, b, :, ring], self.dense_kv[1, b, :, ring] = kb[:, n - w :], vb[:, n - w :]
            self.dense_valid[b, :, :s] = True
            self.dense_valid[b, :, ring] = True
            self.sink_len[b], self.win_start[b], self.win_len[b] = s, 0, w
            unindexed.append(n - w)
            if n - s - w > 0:
                # A copy of its own, in the keys' dtype, so that one transfer takes it with them.
                q_last = None if qb is None else qb[:, -CALIBRATION_POSITIONS:].to(self.device, kb.dtype).clone()
                middles.append((b, kb[:, s : n - w], vb[:, s : n - w], q_last))
        if middles:
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self.runtime.submit(self._index_prompt, middles, ready)
            if cfg.exact_until_indexed:
                T = k.shape[-2]
                padding = [T - n for n in (valid.sum(-1).tolist() if valid is not None else [T] * self.batch)]
                self._bridge = Bridge(k, v, None if valid is None else valid.to(self.device), unindexed, padding)
                self.runtime.bridged.append(self)
        self.decoding = True

    def _index_prompt(self, middles: list, ready: Optional[torch.cuda.Event]) -> None:
        """Index worker: copy each sequence's middle tokens to the host and index them (and
        make the decode steps' host buffers: pinning memory is slow on some hosts); with
        ``effort="auto"``, calibrate each index on the sequence's last prompt queries."""
        self._buffers()
        for b, k, v, q in middles:
            k_host, v_host, *q_host = self.runtime.transit.to_host(ready, k, v, *([] if q is None else [q]))
            if self.leader is None:
                self.indexes[b].add(k_host, v_host, self.stores[b])
                if q_host:
                    t = time.perf_counter()
                    self.indexes[b].calibrate(q_host[0], self.stores[b])
                    self.runtime.stats.calibrate_s += time.perf_counter() - t
            else:
                self.histories[b].append(k_host, v_host)
                self._lead.indexes[b].follow(self.histories[b], self.stores[b])

    def bridge_backlog(self) -> int:
        """The most tokens of any sequence that the bridge would move into the index now."""
        bridge, window = self._bridge, self.runtime.config.window
        if bridge is None:
            return 0
        return max(max(0, bridge.real(b) - bridge.unindexed[b] - window) for b in range(self.batch))

    def submit_catch_up(self) -> None:
        """Hand each sequence's tokens that left the window during the bridge to the index
        worker (its copy on the side stream, then inserts), while the bridge goes on; the
        bridge's tensors at this step are a snapshot: later steps make new ones."""
        bridge, window = self._bridge, self.runtime.config.window
        if bridge is None:
            return
        parts = []
        for b in range(self.batch):
            first = bridge.unindexed[b]
            c = bridge.real(b) - first - window
            if c > 0:
                kb, vb = bridge.tokens(b)
                parts.append((b, kb[:, first : first + c], vb[:, first : first + c]))
        if parts:
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self.runtime.submit(self._catch_up_job, bridge, parts, ready)

    def _catch_up_job(self, bridge: Bridge, parts: list, ready: Optional[torch.cuda.Event]) -> None:
        """Index worker: copy the tokens to the host and insert them (:meth:`_catch_up`)."""
        for b, k, v in parts:
            k_host, v_host = self.runtime.transit.to_host(ready, k, v)
            self._catch_up(b, k_host, v_host)
            bridge.unindexed[b] += k.shape[1]

    def leave_bridge(self) -> None:
        """At the first step after every index is ready (:meth:`Runtime.leave_bridges`): as if
        the tokens decoded from the bridge had been part of the prompt, each sequence's window
        takes its last ``window`` tokens and the index the ones before (inserted; a sequence
        whose prompt had no middle gets its index built from them), then the bridge's device
        copy is dropped. Nothing is resident on the device yet (the layer's first job comes
        next), so no page goes stale."""
        bridge, self._bridge = self._bridge, None
        if bridge is None:
            return
        window = self.runtime.config.window
        for b in range(self.batch):
            kb, vb = bridge.tokens(b)
            first = bridge.unindexed[b]
            k_rest, v_rest = kb[:, first:], vb[:, first:]  # the prompt's window, then the bridge's
            w = min(window, k_rest.shape[1])
            c = k_rest.shape[1] - w
            if c:
                self._catch_up(b, k_rest[:, :c].contiguous().cpu(), v_rest[:, :c].contiguous().cpu())
            ring = slice(self._ring_at, self._ring_at + w)
            self.dense_kv[0, b, :, ring], self.dense_kv[1, b, :, ring] = k_rest[:, c:], v_rest[:, c:]
            self.dense_valid[b, :, ring] = True
            self.win_start[b], self.win_len[b] = 0, w

    def _catch_up(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put sequence ``b``'s tokens ``[H_kv, c, D]`` (CPU) that left the window during the
        bridge into its index and stores, in position order after the ones indexed before."""
        if self.leader is not None:
            self.histories[b].append(k, v)
            self._lead.indexes[b].follow(self.histories[b], self.stores[b])
            return
        index, store = self.indexes[b], self.stores[b]
        if index.forest is None:
            index.add(k, v, store)
            return
        used = index.forest.max_pages()
        store.reserve(used + k.shape[1], used)  # the build left headroom
        index.forest.insert(numpy_view(k), numpy_view(v), *store.views())

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take this step's token into each sequence's window; a full window first hands its
        oldest page of tokens to the host (they stay attended until their insert lands)."""
        cfg = self.runtime.config
        ps, R = cfg.page_size, self.ring
        for b in range(self.batch):
            if self.win_len[b] - self._in_job[b] == cfg.window:
                first = (self.win_start[b] + self._in_job[b]) % R
                self._copy_flush(b, first)
                self._flushed[b] = ps
            self.win_len[b] += 1
        # The device step writes the token into the ring (at the position it keeps itself).
        self._step_kv = (k[:, :, 0], v[:, :, 0])

    def _copy_flush(self, b: int, first: int) -> None:
        """Copy the page of window tokens starting at ring slot ``first`` of sequence ``b`` to
        the host flush buffers (asynchronously on a GPU: the job that reads them starts after
        the step's flag, which the device writes later)."""
        ps, R = self.runtime.config.page_size, self.ring
        bufs = self._buffers()
        cut = min(ps, R - first)  # the ring may wrap inside the page
        for dst, src in ((bufs.flush_k, self.dense_kv[0]), (bufs.flush_v, self.dense_kv[1])):
            at = self._ring_at + first
            dst[b, :, :cut].copy_(src[b, :, at : at + cut], non_blocking=True)
            if cut < ps:
                dst[b, :, cut:].copy_(src[b, :, self._ring_at : self._ring_at + ps - cut], non_blocking=True)

    def _drop_flushed(self) -> None:
        """The applied job inserted the tokens handed to it: stop attending them in the window."""
        R = self.ring
        for b, m in enumerate(self._in_job):
            if not m:
                continue
            first = self.win_start[b]
            slots = [(first + i) % R + self._ring_at for i in range(m)]
            lo, hi = slots[0], slots[-1]
            if hi >= lo:
                self.dense_valid[b, :, lo : hi + 1] = False
            else:
                self.dense_valid[b, :, lo : self._ring_at + R] = False
                self.dense_valid[b, :, self._ring_at : hi + 1] = False
            self.win_start[b] = (first + m) % R
            self.win_len[b] -= m
            self._in_job[b] = 0

    # ------------------------------------------------------------------ host jobs

    @property
    def _jobs(self) -> _core.LookAheadLayer:
        """The layer's host jobs (made at its first decode step)."""
        if self.jobs is None:
            raise RuntimeError(f"IceCache layer {self.layer_idx} has not started decoding")
        return self.jobs

    @property
    def _lead(self) -> IceLayer:
        """The layer whose page layout this one reuses."""
        if self.leader is None:
            raise RuntimeError(f"IceCache layer {self.layer_idx} leads its reuse group")
        return self.leader

    def _buffers(self) -> StepBuffers:
        """The layer's host buffers, made at the first decode step (the query heads are known
        from the first token's keys' layer: ``runtime.query_heads``)."""
        if self._bufs is None:
            cfg = self.runtime.config
            self._bufs = StepBuffers(
                self.device,
                self.batch,
                self.heads,
                self.runtime.query_heads,
                self.dim,
                cfg.page_size,
                self.dtype,
                self._layout().bytes,
            )
        return self._bufs

    def _layout(self) -> _core.StagingLayout:
        """The fixed layout of this layer's staging buffer."""
        cfg = self.runtime.config
        return _core.LookAheadLayer.staging_layout(
            batch=self.batch,
            kv_heads=self.heads,
            dim=self.dim,
            page_size=cfg.page_size,
            itemsize=self.dtype.itemsize,
            max_pages=cfg.selected_pages,
            capacity=cfg.device_pages,
            page_format=cfg.page_format,
        )

    def _open_jobs(self, query_heads: int, scale: float) -> None:
        """Make this layer's job object and lend it every sequence's buffers (first decode
        step, after the prompt is indexed)."""
        cfg = self.runtime.config
        bufs = self._buffers()
        if bufs.queries.shape[1] != query_heads:
            raise ValueError(
                f"layer {self.layer_idx} got {query_heads} query heads, the model config says "
                f"{self.runtime.query_heads}"
            )
        leader_jobs = None if self.leader is None else self.leader.jobs
        self.jobs = _core.LookAheadLayer(
            self.runtime.worker,
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
            leader=leader_jobs,
            page_format=cfg.page_format,
            group_view=cfg.group_view,
        )
        for b in range(self.batch):
            if self.leader is None:
                self.stores[b].reserve(self._indexed_pages(b) + cfg.page_size, self._indexed_pages(b))
            else:
                self.histories[b].reserve(self.histories[b].n + cfg.page_size)
            self._lend(b)
        layout = self._step_layout = self._layout()
        self._step = DeviceStep(
            self._pool_rows,
            self._pool_masks,
            self.dense_kv,
            self.dense_valid,
            bufs.device_staging,
            layout,
            ring=(self._ring_at, self.ring),
            query_heads=query_heads,
            scale=scale,
            adaptive=cfg.budget_mode == "adaptive",
            handoff=(bufs.queries, bufs.flag) if cfg.lookahead else None,
            graphs=cfg.lookahead and cfg.cuda_graphs,
            pool=self.runtime.graph_pool() if self.device.type == "cuda" else None,
            page_format=cfg.page_format,
        )
        # This step's token is counted in win_len already, and the device step writes it.
        self._step.start_window([(w0 + n - 1) % self.ring for w0, n in zip(self.win_start, self.win_len)])

    def _indexed_pages(self, b: int) -> int:
        forest = (self.indexes if self.leader is None else self.leader.indexes)[b].forest
        return 0 if forest is None else forest.max_pages()

    def _lend(self, b: int) -> None:
        store = self.stores[b]
        if self.leader is None:
            index = self.indexes[b]
            self._jobs.set_lane(b, *store.views(), forest=index.forest, resident=index.resident)
        else:
            k_hist, v_hist = self.histories[b].views()
            self._jobs.set_lane(b, *store.views(), k_history=k_hist, v_history=v_hist)

    def _start_job(self, query: torch.Tensor, now: bool) -> None:
        """Start the job that prepares the next step, with this step's flushed tokens: run now
        (``now``: fresh selection, or the first step; its queries are copied here) or queued
        until the flag that the device step writes behind this step's queries (look-ahead)."""
        bufs = self._buffers()
        flushed, self._flushed = self._flushed, [0] * self.batch
        self._in_job = list(flushed)
        if max(flushed):
            self._first_pages(flushed)
        m = max(flushed)
        # Room for what the job writes: inserted pages (leaders; the layers that follow need
        # as many), history (followers).
        if m and self.leader is None:
            self._page_bound = max(self._indexed_pages(b) for b in range(self.batch)) + m
        for b in range(self.batch if m else 0):
            if self.leader is None:
                grown = self.stores[b].reserve(self._page_bound, self._indexed_pages(b))
            else:
                grown = self.stores[b].reserve(self.leader._page_bound, self._indexed_pages(b)) | self.histories[
                    b
                ].reserve(self.histories[b].n + flushed[b])
                self.histories[b].n += flushed[b]
            if grown:
                self._lend(b)
        lens = None if self.leader is None else [h.n for h in self.histories]
        if now:
            bufs.queries.copy_(query)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self._jobs.start(flushed, history_lens=lens)
            return
        # The device step copied the queries and wrote the step number (behind the attention).
        self.steps += 1
        self._jobs.start(flushed, step=self.steps, history_lens=lens)

    def _first_pages(self, flushed: List[int]) -> None:
        """Build the index of a sequence whose prompt fit in sink and window from its first
        flushed page, here and now (rare: short prompts), so that the job only selects; a
        reusing layer writes its first pages in that layout here too. The tokens count as
        handed to the job, which drops them from the window when applied."""
        leading = self.leader is None
        if leading:
            self._built_now = [False] * self.batch
        for b, m in enumerate(flushed):
            built = self.indexes[b].forest is None if leading else self._lead._built_now[b]
            if not (m and built):
                continue
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the flush copy
            bufs = self._buffers()
            k, v = bufs.flush_k[b, :, :m].clone(), bufs.flush_v[b, :, :m].clone()
            if leading:
                self.indexes[b].add(k, v, self.stores[b])
                self._built_now[b] = True
            else:
                self.histories[b].append(k, v)
                self._lead.indexes[b].follow(self.histories[b], self.stores[b])
            flushed[b] = 0
            self._lend(b)

    def _apply(self, o: _core.LookAheadOutcome) -> Optional[torch.Tensor]:
        """Copy the job's staging (its used prefix) to the device, for the device step to apply,
        and stop attending the tokens it inserted; returns the selection's pool slots
        ``[B, H, width]`` (rank order, -1 past the count) when fresh selection needs them.
        Without loads or clears nothing is copied: the device step re-applies the last loads,
        which changes nothing."""
        fresh = not self.runtime.config.lookahead
        table = None
        if o.loads or o.clears or fresh:
            dev = self._buffers().upload(o.end, job=self.steps)
            if fresh:
                at = self._step_layout.table_at
                table = dev[at : at + 4 * self.batch * self.heads * o.width].view(torch.int32)
                table = table.view(self.batch, self.heads, o.width)
        self._drop_flushed()
        return table

    # ------------------------------------------------------------------ decode attention

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of this step's query ``[B, H_q, 1, D]`` over sink + pages + window;
        returns ``[B, 1, H_q, D]`` as transformers expects."""
        rt, cfg = self.runtime, self.runtime.config
        stats = rt.stats
        q = query[:, :, 0].to(self.device)
        if self.jobs is None:
            self._open_jobs(q.shape[1], scale)
        t0 = rt.tick()
        if not cfg.lookahead or self.steps == 0:
            self._start_job(q, now=True)
        outcome = self._jobs.wait()
        t1 = rt.tick()
        table = self._apply(outcome)
        t2 = rt.tick()
        keep = None
        if table is not None:
            keep = torch.zeros(self.batch, self.heads, cfg.device_pages + 1, dtype=torch.bool, device=self.device)
            keep.scatter_(2, torch.where(table >= 0, table, cfg.device_pages).long(), True)
            keep = keep[..., :-1]
        # The budget: sink + window (+ a flushed page still attended) + pages.
        window = max(self.win_len)
        pages = max(0, min(cfg.retrieved_pages, (cfg.budget - max(self.sink_len) - window) // cfg.page_size))
        if self._step is None or self._step_kv is None:
            raise RuntimeError(f"IceCache layer {self.layer_idx}: attention without its update")
        k, v = self._step_kv
        staged = (outcome.loads, outcome.loads + outcome.clears)
        out, res = self._step(q, k, v, pages, staged, keep=keep, want_lse=rt.track_recall)
        t3 = rt.tick()
        if rt.track_recall:
            self._track_recall(q, res, outcome, pages, scale)
            stats.recall_s += time.perf_counter() - t3
        if cfg.lookahead:
            self._start_job(q, now=False)
        if self.next_layer is not None:
            self.next_layer.upload_ahead()

        stats.layer_steps += 1
        stats.wait_s += t1 - t0
        stats.copy_s += t2 - t1
        stats.attend_s += t3 - t2
        stats.worker_insert_s += outcome.insert_s
        stats.worker_select_s += outcome.select_s
        stats.worker_gather_s += outcome.gather_s
        stats.pages_selected += outcome.selected
        stats.pages_loaded += outcome.loads
        return out[:, None].to(query.device)

    def upload_ahead(self) -> None:
        """With look-ahead on a GPU, start the copy of this layer's next staging now, on the
        runtime's copy stream, if the job that wrote it has finished: called by the IceCache
        layer before this one, so the copy overlaps the device's work on the layers in between
        instead of stalling this layer's step (:meth:`StepBuffers.upload` then only waits for
        it). Safe without further sync: the job started only after the device wrote this
        layer's previous step number, which its step does after reading the previous staging,
        and the next job writes the staging only after the next step number, which the device
        writes after waiting for this copy."""
        if self.device.type != "cuda" or not self.runtime.config.lookahead or self.jobs is None or self.steps == 0:
            return
        if not self.jobs.done():
            return
        try:
            o = self.jobs.wait()  # finished: returns at once
        except Exception:
            return  # the job's error is raised by this layer's own step
        if o.loads or o.clears:
            self._buffers().upload_ahead(o.end, self.steps, self.runtime.copy_stream())
            self.runtime.stats.copies_ahead += 1

    def _track_recall(self, q: torch.Tensor, res, outcome: _core.LookAheadOutcome, pages: int, scale: float) -> None:
        """Measurements for evaluation (``track_recall``), after this step's attention.

        Recall, per sequence: the share of the full attention mass on the attended tokens,
        from the attended logits' log-sum-exp against one over every token (the device's sink
        and window, and every offloaded token in the CPU stores). With look-ahead, also the
        share of attended pool pages that the host's own ranking of its superset would not
        have attended (its first ``pages`` pages): what the device's ranking changed."""
        G = q.shape[1] // self.heads
        indexes = self.indexes if self.leader is None else self.leader.indexes
        dense_valid = self.dense_valid.cpu()
        dense_k = self.dense_kv[0].cpu().float()
        for b, index in enumerate(indexes):
            qb = q[b].cpu().float().view(self.heads, G, self.dim)
            dense = torch.einsum("hgd,htd->hgt", qb, dense_k[b]) * scale
            total = torch.logsumexp(dense.masked_fill(~dense_valid[b, :, None], float("-inf")), dim=-1)  # [H, G]
            if index.forest is not None:
                store = self.stores[b].tokens(self.dtype)[0].float()  # as the device attends it
                for h in range(self.heads):
                    page, slot = (torch.from_numpy(a).long() for a in index.forest.token_map(h))
                    mid = qb[h] @ store[h, page, slot].T * scale  # [G, n]
                    total[h] = torch.logaddexp(total[h], torch.logsumexp(mid, dim=-1))
            recall = torch.exp(res.lse[b].cpu().view(self.heads, G) - total)
            self.runtime.stats.recalls.append(float(recall.mean()))
        if not self.runtime.config.lookahead or outcome.selected == 0:
            return  # nothing selected this step (``refresh``): nothing for the device to change
        # The applied job's table (superset slots in the host's rank order) is still in the
        # host staging: the next job writes it only after this step's flag.
        entries, at = self.batch * self.heads * outcome.width, self._step_layout.table_at
        staged = self._buffers().staging[at : at + 4 * entries]
        table = staged.numpy().view(np.int32).reshape(self.batch, self.heads, -1)
        kept = res.kept.cpu().numpy()
        occupied = self.pool_valid.any(-1).cpu().numpy()
        moved = total_kept = 0
        for b, h in np.ndindex(self.batch, self.heads):
            host_top = set(table[b, h][table[b, h] >= 0][:pages].tolist())
            chosen = np.flatnonzero(kept[b, h] & occupied[b, h])
            total_kept += len(chosen)
            moved += sum(1 for s in chosen.tolist() if s not in host_top)
        if total_kept:
            self.runtime.stats.reranked.append(moved / total_kept)

    def nbytes(self) -> dict:
        """Bytes held on the device (sink, window, page pool; the bridge's whole cache while it
        lasts) and in host memory (page stores, the indexes, a follower's history, the decode
        steps' buffers)."""
        if not self.is_initialized:
            return {"device": 0, "host": 0}
        self.runtime.wait_indexed()
        dev = sum(t.numel() * t.element_size() for t in (self.pool_kv, self.dense_kv))
        if self._bridge is not None:
            dev += 2 * self._bridge.k.numel() * self._bridge.k.element_size()
        host = sum(s.k.numel() * s.k.element_size() * 2 for s in self.stores)
        if self.leader is None:
            host += sum(ix.forest.nbytes() for ix in self.indexes if ix.forest is not None)
        else:
            host += sum(h.k.numel() * h.k.element_size() * 2 for h in self.histories)
        if self._bufs is not None:
            host += self._bufs.nbytes()
        return {"device": dev, "host": host}
