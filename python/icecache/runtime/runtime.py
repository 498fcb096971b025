"""State shared by the IceCache layers of one cache: the configuration, the workers, the
bridges and the counters."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

from icecache import _core
from icecache.runtime import hostmem
from icecache.runtime.bridge import Bridges
from icecache.runtime.config import IceCacheConfig
from icecache.runtime.prefix import PINNED
from icecache.runtime.transfer import Transit

__all__ = ["Runtime", "RuntimeStats"]


@dataclass
class RuntimeStats:
    """Counters over the decode steps of all IceCache layers of one cache.

    Seconds on the decode path are host wall time; on a GPU they include waiting for it when
    :attr:`Runtime.sync_timing` is set.
    """

    #: IceCache layer steps that ran the device step (the bridged ones: :attr:`bridged_steps`).
    layer_steps: int = 0
    #: Taking the step's keys and values into the window (and handing a full window's oldest
    #: page to the host).
    update_s: float = 0.0
    #: Waiting for the layer's host job: with look-ahead the worker's job for this step,
    #: normally finished already; with fresh selection, or on the first step after a prompt
    #: without a bridge, the whole job, run on the spot.
    wait_s: float = 0.0
    #: The host-to-device copy of the step's pages and metadata and their scatter into the pool.
    copy_s: float = 0.0
    #: Ranking and attention.
    attend_s: float = 0.0
    #: The optional recall measurement (``track_recall``).
    recall_s: float = 0.0
    #: Decode steps waiting for the prefill pipeline (with the bridge: the wait of the step
    #: that left it, normally none).
    index_wait_s: float = 0.0
    #: What the prefill pipeline spent calibrating the indexes (``effort="auto"``, on the
    #: index worker, off the device's path: part of the time until the index is ready).
    calibrate_s: float = 0.0
    #: Layer steps that attended the prompt's whole cache while the indexes were being built
    #: (``IceCacheConfig.exact_until_indexed``).
    bridged_steps: int = 0
    #: What the step that left the bridge spent moving the tokens decoded meanwhile into the
    #: indexes and windows.
    catch_up_s: float = 0.0
    #: Host jobs inserting flushed tokens (on the worker's threads, mostly off the critical path).
    worker_insert_s: float = 0.0
    #: Host jobs selecting and planning.
    worker_select_s: float = 0.0
    #: Host jobs gathering pages into staging.
    worker_gather_s: float = 0.0
    #: Pages the host selected, summed over layers, sequences and KV heads.
    pages_selected: int = 0
    #: Pages copied to the device, summed likewise.
    pages_loaded: int = 0
    #: Layer steps whose copy started early, on a side stream, while the device computed the
    #: layers before (look-ahead on a GPU, once the layer's job had finished; their ``copy_s``
    #: is then mostly the scatter).
    copies_ahead: int = 0
    #: Decode steps replayed from step graphs; their host time (the layers' host work around
    #: the replays, the waits for the look-ahead worker and the replay calls included), the
    #: parts of it waiting for the worker and in the replay calls; with ``sync_timing`` the
    #: device time from the first replay to the last one's end.
    graph_steps: int = 0
    graph_host_s: float = 0.0
    graph_wait_s: float = 0.0
    graph_replay_s: float = 0.0
    graph_device_s: float = 0.0
    #: Steps in the step graph's phases that captured their graphs instead (once per shape and
    #: window phase; on the CPU every such step, run eagerly), and their host time.
    graph_capture_steps: int = 0
    graph_capture_s: float = 0.0
    #: One attention recall per (layer, sequence, retrieving step) (``track_recall``).
    recalls: List[float] = field(default_factory=list)
    #: One share per (layer, step) of attended pages that the device's ranking took from
    #: outside the host's top choices (``track_recall``, look-ahead).
    reranked: List[float] = field(default_factory=list)

    @property
    def recall(self) -> float:
        """Mean attention recall over tracked (layer, sequence, step)s; NaN if none."""
        return float(np.mean(self.recalls)) if self.recalls else float("nan")


class Runtime:
    """State shared by the layers of one IceCache.

    Args:
        config: the configuration as this process runs it.
        device: where sinks, windows and page pools live.
        track_recall: measure each step's attention recall (:class:`RuntimeStats`).
        query_heads: query heads of every attention layer (of this process: tensor parallelism
            shards them).
    """

    def __init__(self, config: IceCacheConfig, device: torch.device, track_recall: bool, *, query_heads: int):
        self.config = config
        self.device = device
        self.track_recall = track_recall
        if device.type == "cuda":
            hostmem.pin_by_registering()  # chunked prompts pin their host copy as they come
        #: Query heads of every attention layer (of this process).
        self.query_heads = query_heads
        #: The decode steps' counters.
        self.stats = RuntimeStats()
        #: Synchronise the device at every timing boundary so that the breakdown in :attr:`stats`
        #: is device time, not launch time (slower; for benchmarks).
        self.sync_timing = False
        #: Set while a step graph's forward runs (captured, or eagerly as its reference): the
        #: layers' host work ran before it (:mod:`icecache.runtime.stepgraph`).
        self.in_step_graph = False
        #: While a step graph is captured: called with each IceCache layer as its update runs
        #: (where the capture moves on to the next graph segment).
        self.step_hook: Optional[Callable[[Any], None]] = None
        #: Whether each IceCache layer captures CUDA graphs of its own device step: only where
        #: no step graph replays the decode steps (:class:`icecache.runtime.stepgraph.StepGraph`
        #: sets it), since the step graph captures every layer itself, and a layer's own
        #: capture would only stall the eager step it happens in (the first after a prompt or
        #: a bridge) for the device to drain.
        self.layer_graphs = True
        #: The prefill's reused host buffer for device-to-host copies on the index worker.
        self.transit = Transit(device)
        #: The pinned host blocks of chunked prompts, kept for the next prompt (the process's).
        self.pinned = PINNED
        #: The layers' bridges (``IceCacheConfig.exact_until_indexed``) and when they end.
        self.bridges = Bridges()
        #: The IceCache layers this runtime serves (set by :class:`icecache.IceCache`).
        self.served_layers = 0
        # Prompt positions whose host memory has been checked, and the host memory available when
        # the prompt began (check_prompt_memory).
        self._host_checked = 0
        self._host_available: Optional[int] = None
        self._index_worker: Optional[ThreadPoolExecutor] = None
        # The index worker's unfinished jobs, each with its reuse group (its leader's layer
        # index; ``None``: no group's).
        self._pending: List[Tuple[Optional[int], Future]] = []
        # None until their accessors make them.
        self._made_lookahead_worker: Optional[_core.LookAhead] = None
        self._made_graph_pool: Optional[Any] = None
        self._made_copy_stream: Optional[Any] = None

    @property
    def lookahead_worker(self) -> _core.LookAhead:
        """The look-ahead worker (a native thread and pool), made on first use."""
        if self._made_lookahead_worker is None:
            # By default every core but one: the Python thread that drives the device needs one.
            threads = self.config.threads or max(1, (os.cpu_count() or 2) - 1)
            self._made_lookahead_worker = _core.LookAhead(threads)
        return self._made_lookahead_worker

    def graph_pool(self) -> Any:
        """One CUDA graph memory pool for every layer's graphs (they replay in stream order)."""
        if self._made_graph_pool is None:
            self._made_graph_pool = torch.cuda.graph_pool_handle()
        return self._made_graph_pool

    def copy_stream(self) -> Any:
        """The side stream that early staging copies run on (``LayerJobs.upload_ahead``)."""
        if self._made_copy_stream is None:
            self._made_copy_stream = torch.cuda.Stream(self.device)
        return self._made_copy_stream

    def submit(self, fn, *args, group: Optional[int] = None) -> None:
        """Run ``fn(*args)`` on the index worker: one thread, jobs in submission order (so a
        reuse group's leader is indexed before the layers that follow its layout). ``group``:
        the reuse group the job indexes (its leader's layer index), which waits for it."""
        if self._index_worker is None:
            self._index_worker = ThreadPoolExecutor(1, thread_name_prefix="icecache-index")
        self._pending.append((group, self._index_worker.submit(fn, *args)))

    def wait_indexed(self, errors: bool = True, group: Optional[int] = None) -> None:
        """Wait until every submitted prompt is offloaded and indexed, or (``group``) that reuse
        group's jobs: a layer decodes from its index once its group's jobs are done, since its
        first insert must not race the worker still writing the pages of the layers that
        follow its layout, and nothing else of the group's is shared with the worker's later
        jobs. Re-raises a failed job's error at every call (``errors=False``: forget failed
        jobs)."""
        mine = [(g, f) for g, f in self._pending if group is None or g == group]
        if not mine:
            return
        t = time.perf_counter()
        for job in mine:
            try:
                job[1].result()
            except BaseException:
                if errors:
                    raise
            self._pending.remove(job)
        self.stats.index_wait_s += time.perf_counter() - t

    def check_prompt_memory(self, length: int, batch: int, per_token: int) -> None:
        """Called by every IceCache layer before it takes a prompt chunk that ends at position
        ``length``: the first layer to reach it checks that the prompt so far fits in the host
        memory that was available when it began, for every served layer, at ``per_token`` bytes
        per token and layer (:func:`icecache.runtime.hostmem.check_prompt_fits`; raises
        :class:`MemoryError`)."""
        if length > self._host_checked:
            if self._host_checked == 0:
                available = hostmem.available_bytes()
                # The pinned blocks kept from the last prompt serve this one's host copy.
                self._host_available = None if available is None else available + self.pinned.nbytes()
            hostmem.check_prompt_fits(length * batch, per_token, self.served_layers, self._host_available)
            self._host_checked = length

    def decide_bridging(self, position: int) -> None:
        """Decide which layers the decode step at ``position`` still bridges (:meth:`Bridges.decide`,
        over the index worker's unfinished jobs: the step's first layer decides, and may hand
        catch-up jobs to the worker), and have the reuse groups whose jobs are done leave their
        bridges now, before any layer's step. Raises a failed prompt job's error."""
        for group in self.bridges.decide(position, self._pending):
            self.wait_indexed(group=group)
            t = time.perf_counter()
            self.bridges.leave(group)
            self.stats.catch_up_s += time.perf_counter() - t

    def forget(self) -> None:
        """Fresh counters and bridge state for a new prompt (the jobs must be finished), and a
        new graph pool for the graphs it captures: a layer whose shapes change drops its graphs,
        and once every graph of a pool is gone, torch refuses a capture into that pool."""
        self.stats = RuntimeStats()
        self.bridges.forget()
        self._made_graph_pool = None
        self._host_checked, self._host_available = 0, None

    def tick(self) -> float:
        """A timestamp for the breakdown (after a device sync when :attr:`sync_timing`)."""
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
