"""One IceCache layer: a transformers ``CacheLayerMixin`` for a full-attention layer whose
middle tokens are offloaded to CPU semantic pages and retrieved per decode step.

The layer keeps the order of a step; its parts are the device window (:mod:`.window`), the
host side with its look-ahead jobs (:mod:`.jobs`), the bridge while the indexes are built
(:mod:`.bridge`), the device step (:mod:`.step`) and, for evaluation, the recall probe
(:mod:`.probe`)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from transformers.cache_utils import CacheLayerMixin

from icecache import _core
from icecache.runtime.bridge import Bridge
from icecache.runtime.config import CALIBRATION_POSITIONS
from icecache.runtime.hostmem import bytes_per_token
from icecache.runtime.integration import hand_off
from icecache.runtime.jobs import FollowerJobs, LayerJobs, LeaderJobs, Middle, QueuedStart
from icecache.runtime.pages import PageIndex, PageStore
from icecache.runtime.prefix import HostPrefix
from icecache.runtime.probe import track_recall
from icecache.runtime.runtime import Runtime
from icecache.runtime.step import DeviceStep
from icecache.runtime.transfer import StepBuffers
from icecache.runtime.window import DeviceWindow

__all__ = ["IceLayer"]


@dataclass
class _Before:
    """The host's part of a decode step before the device's: the job's outcome, the pages the
    step attends, the pool slots to keep (fresh selection) and the timestamps around the wait
    and the copy."""

    outcome: _core.LookAheadOutcome
    pages: int
    keep: Optional[torch.Tensor]
    t0: float
    t1: float
    t2: float


class IceLayer(CacheLayerMixin):
    """Cache of one full-attention layer under IceCache.

    The prompt is attended exactly; then per sequence the first ``sink`` real tokens and the
    last ``window`` stay on the device (:class:`DeviceWindow`) and the rest goes to a CPU
    :class:`PageStore` in semantic page order, indexed by a :class:`PageIndex`. Each decode
    token joins the window; when the window is full its oldest page of tokens goes to the index.

    Device layout: the page pool ``[2, B, H_kv, device_pages, page_size, D]`` (K and V) and the
    window's dense tokens; each with a mask of the slots that hold a token.

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
    pages (:class:`LeaderJobs`); the others reuse the leader's page layout, selection and device
    slots (:class:`FollowerJobs`), and rank the pool pages with their own queries.
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
        #: staging copy this one starts early (``LayerJobs.upload_ahead``); set by :class:`IceCache`.
        self.next_layer: Optional[IceLayer] = None
        #: The host side: stores, index or history, buffers and look-ahead jobs.
        self.jobs: LayerJobs
        if leader is None:
            self.jobs = LeaderJobs(runtime, layer_idx)
        elif isinstance(leader.jobs, LeaderJobs):
            self.jobs = FollowerJobs(runtime, layer_idx, leader.jobs)
        else:
            raise ValueError(f"IceCache layer {layer_idx}: its leader {leader.layer_idx} follows a leader itself")
        self._forget()

    def _forget(self) -> None:
        """The state of a layer that has seen no prompt."""
        self.is_initialized = False
        self.length = 0
        self.decoding = False
        #: The prompt's keys and values in host memory while it streams in (chunked prefill).
        self.prefix = HostPrefix(self.runtime.device, self.runtime.pinned)
        # The current chunk's keys and values on the device, until its attention has run; the
        # first chunk's until a second one comes (a bridge decodes from them).
        self._chunk_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._first_chunk: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._chunks = 0
        # The prompt's real (non-padding) positions so far, [B, T] on the host; per sequence its
        # real tokens, and the real tokens [0, indexed) handed to the index worker (sink included).
        self._valid: Optional[torch.Tensor] = None
        self._real: List[int] = []
        self._indexed: List[int] = []
        # Per sequence, the queries of its last CALIBRATION_POSITIONS real prompt positions.
        self._q_last: List[Optional[torch.Tensor]] = []
        self._device_step: Optional[DeviceStep] = None
        self._step_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        # A step graph's step (step_count to step_after): the host's part, and the page count
        # that the graph was captured with.
        self._graph_before: Optional[_Before] = None
        self._graph_pages: Optional[int] = None
        # The queries of the last forward (the prompt's last real position, then each bridged
        # step's), [B, H_q, D] on the device, that the first job after the bridge selects with;
        # kept by a reuse group's leader while it bridges, with look-ahead.
        self._last_query: Optional[torch.Tensor] = None
        self._scale: Optional[float] = None

    # ------------------------------------------------------------------ transformers API

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.runtime.config
        B, H, _, D = key_states.shape
        self.device, self.dtype = self.runtime.device, key_states.dtype
        self.batch, self.heads, self.dim = B, H, D
        C, S = cfg.device_pages, cfg.page_size
        self.jobs.open(B, H, D, self.dtype, self.device)
        # K and V together, so that one copy loads a step's pages of both: the page pool, one row
        # per slot plus a trash row that padded loads land in ([2, B*H*C + 1, S*D]); with its
        # valid mask.
        self._pool_rows = torch.zeros(2, B * H * C + 1, S * D, dtype=self.dtype, device=self.device)
        self._pool_masks = torch.zeros(B * H * C + 1, S, dtype=torch.bool, device=self.device)
        self.pool_kv = self._pool_rows[:, : B * H * C].view(2, B, H, C, S, D)
        self.pool_valid = self._pool_masks[: B * H * C].view(B, H, C, S)
        self.window = DeviceWindow(B, H, D, self.dtype, self.device, sink=cfg.sink, window=cfg.window, page_size=S)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take this step's keys and values (post-RoPE, ``[B, H_kv, T, D]``).

        Calls of several tokens before the first decode step are the prompt, in one chunk or
        several: each is returned with every earlier token for exact attention (the earlier ones
        read back from the host, :class:`HostPrefix`) and offloaded afterwards
        (:meth:`ingest_chunk`). A call of one token is a decode step; the first one ends the
        prompt of every IceCache layer (:meth:`_finish_prompts`).
        """
        T = key_states.shape[-2]
        if self.runtime.in_step_graph:  # the host's part runs around the step graph (step_count)
            if self.runtime.step_hook is not None:
                self.runtime.step_hook(self)
            self._step_kv = (key_states[:, :, 0], value_states[:, :, 0])
            hand_off(self)
            return key_states, value_states
        if not self.is_initialized:
            self._check_host_memory(key_states, T, streamed=False)
            self.lazy_initialization(key_states, value_states)
            self._chunk_kv = self._first_chunk = (key_states, value_states)
            self.length = T
            hand_off(self)
            return key_states, value_states
        if key_states.shape[0] != self.batch:
            raise ValueError(f"batch size changed from {self.batch} to {key_states.shape[0]}")
        if not self.decoding:
            if T > 1:
                return self._prompt_chunk(key_states, value_states)
            self._finish_prompts()
        if T != 1:
            raise NotImplementedError(
                f"IceCache takes a prompt (in chunks or not) and then one token per step; layer "
                f"{self.layer_idx} got {T} tokens after the first decode step (speculative "
                "decoding is not supported)"
            )
        if self.runtime.bridges.active:
            self.runtime.decide_bridging(self.length)
        bridge = self.bridge
        if bridge is not None:
            bridge.append(key_states.to(self.device), value_states.to(self.device))
            self.length += 1
            self.runtime.stats.bridged_steps += 1
            k_all, v_all = bridge.attended()
            after = self.next_layer
            if self.device.type == "cuda" and after is not None and after.layer_idx > self.layer_idx:
                ahead = after.bridge
                if ahead is not None:
                    ahead.prefetch(self.runtime.copy_stream())
            hand_off(self)
            return k_all, v_all
        # While other layers bridge on, only this layer's group need be indexed.
        self.runtime.wait_indexed(group=self.group if self.runtime.bridges.active else None)
        t = time.perf_counter()
        k, v = key_states.to(self.device), value_states.to(self.device)
        self.window.append(self.jobs.buffers())
        # The device step writes the token into the ring (at the position it keeps itself).
        self._step_kv = (k[:, :, 0], v[:, :, 0])
        self.runtime.stats.update_s += time.perf_counter() - t
        self.length += 1
        hand_off(self)
        return key_states, value_states

    def keep_query(self, query: torch.Tensor, scale: float) -> None:
        """Keep this forward's queries ``[B, H_q, D]`` (the prompt's last real position, or a
        bridged step's) and attention scale for the first job after the bridge
        (:meth:`start_ahead`); only a reuse group's leader selects, so only its queries are
        kept."""
        self._scale = scale
        if self._keeps_queries:
            self._last_query = query

    @property
    def _keeps_queries(self) -> bool:
        cfg = self.runtime.config
        return self.leader is None and cfg.lookahead and cfg.exact_until_indexed

    def start_ahead(self) -> None:
        """This layer has just left the bridge, at the start of a decode step: start that
        step's job now, from the last bridged step's queries (:meth:`keep_query`), on the
        worker while the device computes the layers before, as every later step's job is
        started from the step before. Without those queries (a prompt that came from
        :meth:`load_prompt`), or with fresh selection, the step runs its job itself."""
        if not self.runtime.config.lookahead or self._scale is None:
            return
        query = None
        if self.leader is None:
            query, self._last_query = self._last_query, None
            if query is None:
                return
        elif not self.leader.jobs.started_ahead:
            return
        # Made before the job: it resets the device staging, which on the CPU is the host's.
        self._device_step = self._open_device_step(self.runtime.query_heads, self._scale, self.window.next_slots())
        self.jobs.start_ahead(self.window.hand_to_job(), query)

    @property
    def bridge(self) -> Optional[Bridge]:
        """This layer's whole cache on the device while the indexes are built, or ``None``."""
        return self.runtime.bridges.of_layer(self.layer_idx)

    @property
    def bridging(self) -> bool:
        """Whether this layer attends its whole cache from the device, as a full cache does,
        while the indexes are built (``IceCacheConfig.exact_until_indexed``)."""
        return self.bridge is not None

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
        self.jobs.close()
        self._forget()

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("IceCache does not support beam search, cropping or batch reshuffling")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported

    @property
    def stores(self) -> List[PageStore]:
        """Per sequence, the CPU page stores of this layer."""
        return self.jobs.stores

    @property
    def group(self) -> int:
        """This layer's reuse group: its leader's layer index (its own if it leads)."""
        return self.layer_idx if self.leader is None else self.leader.layer_idx

    @property
    def indexes(self) -> List[PageIndex]:
        """Per sequence, the index of this layer's reuse group (its leader's)."""
        return self.jobs.group_indexes

    # ------------------------------------------------------------------ prompt

    def _check_host_memory(self, k: torch.Tensor, length: int, streamed: bool) -> None:
        """Raise :class:`MemoryError` before a prompt chunk ending at ``length`` whose host memory
        the machine does not have (the first layer checks for all); ``streamed``: a later chunk,
        so the prompt is held on the host as it came too."""
        B, H, _, D = k.shape
        cfg = self.runtime.config
        per_token = bytes_per_token(H, D, k.dtype, cfg.page_format, streamed, cfg.page_size)
        self.runtime.check_prompt_memory(length, B, per_token)

    def _prompt_chunk(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """A prompt chunk after the first: the earlier tokens (prefetched from the host by the
        layer before, or copied now; the second chunk finds the first on the device) followed
        by the chunk's, ``[B, H_kv, T + L, D]``."""
        P, L = self.length, k.shape[-2]
        first = self._first_chunk
        if self._chunk_kv is not None or self.prefix.length + (0 if first is None else first[0].shape[-2]) != P:
            raise RuntimeError(f"IceCache layer {self.layer_idx}: a prompt chunk before the last one's attention")
        self._check_host_memory(k, P + L, streamed=True)
        if first is None:
            buf = self.prefix.to_device(L)
        else:  # the second chunk: the first goes to the host now (several chunks: no bridge from it)
            self.prefix.offload(*first, self.runtime.copy_stream() if self.device.type == "cuda" else None)
            self._first_chunk = None
            B, H, _, D = k.shape
            buf = torch.empty(2, B, H, P + L, D, dtype=self.dtype, device=self.device)
            buf[0, :, :, :P], buf[1, :, :, :P] = first
        buf[0, :, :, P:], buf[1, :, :, P:] = k.to(self.device), v.to(self.device)
        self._chunk_kv = (buf[0, :, :, P:], buf[1, :, :, P:])
        self.length = P + L
        after = self.next_layer
        if self.device.type == "cuda" and after is not None and after.layer_idx > self.layer_idx:
            after.prefix.prefetch(L, self.runtime.copy_stream())
        hand_off(self)
        return buf[0], buf[1]

    def ingest_chunk(
        self, valid: Optional[torch.Tensor], queries: Optional[torch.Tensor] = None, scale: Optional[float] = None
    ) -> None:
        """Offload the prompt chunk taken by :meth:`update` once its exact attention has run.
        Each sequence's real tokens that are neither its first ``sink`` nor among its last
        ``window`` so far are its middle. The first chunk stays on the device, and its middle
        goes to the index worker right away, copied on the worker's side stream (a prompt of one
        chunk is then indexed as it always was, with no host copy of its own); a later chunk's
        keys and values go to the host (:class:`HostPrefix`, the first's with the second), and
        the whole prompt is indexed in one build when decoding starts (:meth:`_finish_prompt`).

        Args:
            valid: ``[B, L]`` bool of the chunk's real (non-padding) positions, or ``None``.
            queries: the chunk's queries ``[B, H_q, L, D]`` (post-RoPE), for ``effort="auto"``
                to calibrate the index on the prompt's last ones, and for the first job after
                the bridge (:meth:`keep_query`).
            scale: the attention's scale, with ``queries``.
        """
        if self._chunk_kv is None:
            raise RuntimeError(f"layer {self.layer_idx} has no prompt chunk to offload")
        cfg = self.runtime.config
        k, v = self._chunk_kv
        self._chunk_kv = None
        B, L = self.batch, k.shape[-2]
        if not self._chunks:
            self._real, self._indexed, self._q_last = [0] * B, [0] * B, [None] * B
        self._chunks += 1
        if self._chunks > 1:
            self.prefix.offload(k, v, self.runtime.copy_stream() if self.device.type == "cuda" else None)
        valid_host = torch.ones(B, L, dtype=torch.bool) if valid is None else valid.to("cpu", torch.bool)
        self._valid = valid_host if self._valid is None else torch.cat([self._valid, valid_host], 1)
        calibrate = self.jobs.calibrates and queries is not None
        last = []  # each sequence's last real position of the chunk
        parts = []
        for b in range(B):
            real = valid_host[b].nonzero()[:, 0]
            last.append(int(real[-1]) if real.numel() else L - 1)
            self._real[b] += real.numel()
            if calibrate and queries is not None and real.numel():
                q = queries[b][:, real[-CALIBRATION_POSITIONS:].to(queries.device)].to(self.device, k.dtype)
                kept = self._q_last[b]
                self._q_last[b] = (q if kept is None else torch.cat([kept, q], 1))[:, -CALIBRATION_POSITIONS:]
            lo, hi = max(cfg.sink, self._indexed[b]), self._real[b] - cfg.window
            if hi > lo:
                parts.append((b, lo, hi))
                self._indexed[b] = hi
        if queries is not None and scale is not None:
            self.keep_query(queries[torch.arange(B), :, torch.tensor(last)], scale)
        # The first chunk's middle is indexed behind the next layers' compute; a prompt of one
        # chunk is then ready as soon as that build is. Later chunks wait for the whole prompt,
        # which is indexed in one build (_finish_prompt): inserting chunk by chunk as they
        # come ran at a fraction of a build's pace (benches/RESULTS.md, "Chunked prefill in
        # bounded GPU memory").
        if parts and self._chunks == 1:
            middles: List[Middle] = []
            for b, lo, hi in parts:
                at = valid_host[b].nonzero()[lo:hi, 0]
                if int(at[-1]) - int(at[0]) + 1 == at.numel():  # contiguous (left padding): a view
                    kb, vb = k[b][:, int(at[0]) : int(at[-1]) + 1], v[b][:, int(at[0]) : int(at[-1]) + 1]
                else:
                    kb, vb = k[b].index_select(1, at.to(k.device)), v[b].index_select(1, at.to(k.device))
                middles.append((b, kb, vb, self._q_last[b]))
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self.runtime.submit(self.jobs.index_prompt, middles, ready, group=self.group)

    def _index_whole(
        self,
        parts: List[Tuple[int, int, int]],
        valid: torch.Tensor,
        prefix: HostPrefix,
        q_last: List[Optional[torch.Tensor]],
    ) -> None:
        """Index worker: index each sequence's whole middle, real tokens ``[lo, hi)``, from the
        host prompt once its copies have landed, in one build replacing the first chunk's
        index; then calibrate it on ``q_last`` (``effort="auto"``; ``None``: none)."""
        prefix.wait_copied()
        for b, lo, hi in parts:
            self.jobs.restart(b)
            positions = valid[b].nonzero()[lo:hi, 0]
            shape = (self.heads, positions.numel(), self.dim)
            k_buf, v_buf = self.runtime.transit.views(self.dtype, shape, shape)
            k, v = prefix.gather(b, positions, out=(k_buf, v_buf))
            self.jobs.catch_up(b, k, v)  # copies them: the buffer serves the next layer
        for b, q in enumerate(q_last):
            if q is not None:
                self.jobs.calibrate(b, q)

    def _finish_prompts(self) -> None:
        """The first decode step: every IceCache layer's prompt is complete (this layer is the
        model's first IceCache layer; the others follow it in order)."""
        layer: Optional[IceLayer] = self
        while layer is not None and not layer.decoding:
            layer._finish_prompt()
            layer = layer.next_layer
        self.runtime.pinned.trim()  # what this prompt did not take of the last one's blocks

    def _finish_prompt(self) -> None:
        """Put each sequence's first ``sink`` and last real prompt tokens on the device (the
        window) and, with ``exact_until_indexed``, decode from the whole cache until the indexes
        are ready (:meth:`_bridge`). A prompt of several chunks is indexed now, in one build of
        its whole middle (calibrated on its last queries with ``effort="auto"``)."""
        cfg = self.runtime.config
        self.prefix.wait_copied()
        valid = self._valid
        if valid is None:
            raise RuntimeError(f"IceCache layer {self.layer_idx} got no prompt")
        unindexed = []
        for b in range(self.batch):
            positions = valid[b].nonzero()[:, 0]
            s = min(cfg.sink, positions.numel())
            first = max(s, self._indexed[b])  # the window's first real token
            keep = torch.cat([positions[:s], positions[first:]])
            if self._first_chunk is None:
                k, v = self.prefix.gather(b, keep)
            else:  # one chunk: still on the device
                k, v = (t[b].index_select(1, keep.to(self.device)) for t in self._first_chunk)
            self.window.load_prompt(b, k.to(self.device), v.to(self.device))
            unindexed.append(first)
        if self._chunks > 1:
            parts = [(b, min(cfg.sink, self._real[b]), i) for b, i in enumerate(self._indexed) if i > 0]
            q_last = [None if q is None else q.cpu() for q in self._q_last]
            self.runtime.submit(self._index_whole, parts, valid, self.prefix, q_last, group=self.group)
        if any(i > 0 for i in self._indexed) and cfg.exact_until_indexed:
            self.runtime.bridges.add(self.layer_idx, self._bridge(valid, unindexed), self.group)
        # Dropped here: the index jobs and a bridge that still read it hold it until they end.
        self.prefix = HostPrefix(self.runtime.device, self.runtime.pinned)
        self._first_chunk = None
        self._valid = None
        self._q_last = []
        self.decoding = True

    def _bridge(self, valid: torch.Tensor, unindexed: List[int]) -> Bridge:
        """The bridge of a prompt whose indexes are being built: a prompt of one chunk is still
        on the device; a longer one stays on the host but for the positions from the first
        unindexed token of any sequence on, and each bridged step reads it back."""
        T = valid.shape[1]
        padding = [T - n for n in self._real]
        if self._first_chunk is not None:
            k, v = self._first_chunk
            host = None
        else:
            host = self.prefix
            starts = [int(valid[b].nonzero()[first, 0]) for b, first in enumerate(unindexed) if first < self._real[b]]
            k, v = host.tail(min(starts, default=T))
        return Bridge(
            k.to(self.device),
            v.to(self.device),
            None if bool(valid.all()) else valid.to(self.device),
            unindexed,
            padding,
            window=self.window,
            catch_up=self.jobs.catch_up,
            submit=functools.partial(self.runtime.submit, group=self.group),
            transit=self.runtime.transit,
            host=host,
            first_job=self.start_ahead,
        )

    def load_prompt(self, k: torch.Tensor, v: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        """Take a whole prompt's keys/values ``[B, H_kv, T, D]`` as one chunk whose attention
        ran elsewhere (:meth:`IceCache.from_prefilled`); ``valid`` as for :meth:`ingest_chunk`."""
        if self.is_initialized:
            raise RuntimeError(f"IceCache layer {self.layer_idx} holds a prompt already")
        self._check_host_memory(k, k.shape[-2], streamed=False)
        k, v = k.to(self.runtime.device), v.to(self.runtime.device)
        self.lazy_initialization(k, v)
        self.length = k.shape[-2]
        self._chunk_kv = self._first_chunk = (k, v)
        self.ingest_chunk(valid)

    # ------------------------------------------------------------------ decode attention

    def _open_device_step(self, query_heads: int, scale: float, next_slots: List[int]) -> DeviceStep:
        """Before the first decode step's job: the host jobs lend their buffers, and the device
        step is made, writing each sequence's next token at ring slot ``next_slots[b]``."""
        cfg = self.runtime.config
        self.jobs.open_lanes(query_heads, scale)
        bufs = self.jobs.buffers()
        w = self.window
        step = DeviceStep(
            self._pool_rows,
            self._pool_masks,
            w.dense_kv,
            w.dense_valid,
            self.jobs.device_staging,
            ring=(w.ring_at, w.ring),
            query_heads=query_heads,
            scale=scale,
            adaptive=cfg.budget_mode == "adaptive",
            handoff=(bufs.queries, bufs.flag) if cfg.lookahead else None,
            graphs=cfg.lookahead and cfg.cuda_graphs,
            pool=self.runtime.graph_pool() if self.device.type == "cuda" else None,
            page_format=cfg.page_format,
        )
        step.start_window(next_slots)
        return step

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of this step's query ``[B, H_q, 1, D]`` over sink + pages + window;
        returns ``[B, 1, H_q, D]`` as transformers expects."""
        rt, cfg = self.runtime, self.runtime.config
        q = query[:, :, 0].to(self.device)
        if self._step_kv is None:
            raise RuntimeError(f"IceCache layer {self.layer_idx}: attention without its update")
        k, v = self._step_kv
        if rt.in_step_graph:  # the host's part runs around the step graph (step_count)
            if self._device_step is None or self._graph_pages is None:
                raise RuntimeError(f"IceCache layer {self.layer_idx}: a step graph's attention without step_count")
            return self._device_step.inline(q, k, v, self._graph_pages)[:, None]
        if self._device_step is None:
            # This step's token is counted in the window already, and the device step writes it.
            self._device_step = self._open_device_step(q.shape[1], scale, self.window.last_slots())
        t0 = rt.tick()
        if not cfg.lookahead or (self.jobs.steps == 0 and not self.jobs.started_ahead):
            self.jobs.start(self.window.hand_to_job(), q, now=True)
        before = self._before_device_step(t0)
        staged = (before.outcome.loads, before.outcome.loads + before.outcome.clears)
        out, res = self._device_step(
            q, k, v, before.pages, staged, keep=before.keep, want_lse=rt.track_recall, capture=rt.layer_graphs
        )
        t3 = rt.tick()
        if rt.track_recall:
            if res is None:
                raise RuntimeError("recall tracking needs the device step's full result")
            track_recall(
                q,
                res,
                before.outcome,
                pages=before.pages,
                scale=scale,
                window=self.window,
                jobs=self.jobs,
                pool_valid=self.pool_valid,
                lookahead=cfg.lookahead,
                stats=rt.stats,
            )
            rt.stats.recall_s += time.perf_counter() - t3
        self._after_device_step(before, q, t3)
        if self.next_layer is not None:
            self.next_layer.jobs.upload_ahead()
        return out[:, None].to(query.device)

    def _before_device_step(self, t0: float) -> _Before:
        """The host's part of a decode step before the device's (from ``t0``): the job's
        outcome, its staging copied to the device, the window's inserted tokens dropped, and
        the step's page count."""
        rt, cfg, w = self.runtime, self.runtime.config, self.window
        outcome = self.jobs.wait()
        t1 = rt.tick()
        table = self.jobs.upload(outcome, fresh=not cfg.lookahead)
        w.drop_flushed()
        t2 = rt.tick()
        keep = None
        if table is not None:
            keep = torch.zeros(self.batch, self.heads, cfg.device_pages + 1, dtype=torch.bool, device=self.device)
            keep.scatter_(2, torch.where(table >= 0, table, cfg.device_pages).long(), True)
            keep = keep[..., :-1]
        return _Before(outcome, self._step_pages(max(w.win_len)), keep, t0, t1, t2)

    def _step_pages(self, window: int) -> int:
        """The pages a step attends beside the sink and ``window`` tokens of the window (the
        most of any sequence; a flushed page still attended included), within the budget."""
        cfg = self.runtime.config
        return max(0, min(cfg.retrieved_pages, (cfg.budget - max(self.window.sink_len) - window) // cfg.page_size))

    def _after_device_step(self, before: _Before, q: Optional[torch.Tensor], t3: float) -> None:
        """The host's part after the device's: the next step's job (look-ahead) and the counters."""
        if self.runtime.config.lookahead:
            self.jobs.start(self.window.hand_to_job(), q, now=False)
        self._count_step(before, t3)

    def _count_step(self, before: _Before, t3: float) -> None:
        """The step's counters (:class:`icecache.runtime.Stats`)."""
        stats, o = self.runtime.stats, before.outcome
        stats.layer_steps += 1
        stats.wait_s += before.t1 - before.t0
        stats.copy_s += before.t2 - before.t1
        stats.attend_s += t3 - before.t2
        stats.worker_insert_s += o.insert_s
        stats.worker_select_s += o.select_s
        stats.worker_gather_s += o.gather_s
        stats.pages_selected += o.selected
        stats.pages_loaded += o.loads

    # ------------------------------------------------------------------ the step graph

    @property
    def graph_ready(self) -> bool:
        """Whether this layer's decode steps can run in a step graph (:mod:`.stepgraph`): with
        look-ahead, past its first decode step and its bridge, without recall tracking."""
        return (
            self.decoding
            and self.bridge is None
            and self._device_step is not None
            and self.jobs.steps > 0
            and self.runtime.config.lookahead
            and not self.runtime.track_recall
        )

    @property
    def device_step(self) -> Optional[DeviceStep]:
        """The device side of the decode steps (made at the first one)."""
        return self._device_step

    def step_count(self) -> int:
        """First of a step graph's host work for this layer (all layers' before the replay):
        the token counted into the window (a full window's oldest page to the flush buffers);
        returns the pages the step will attend, which the graph is captured for."""
        t = time.perf_counter()
        w = self.window
        w.append(self.jobs.buffers())
        self.length += 1
        self.runtime.stats.update_s += time.perf_counter() - t
        # The window as _before_device_step will find it once the job's tokens are dropped.
        self._graph_pages = self._step_pages(max(n - m for n, m in zip(w.win_len, w.in_job)))
        return self._graph_pages

    def step_stage(self, outcome: _core.LookAheadOutcome, t0: float, t1: float) -> Optional[Tuple[StepBuffers, int]]:
        """Then, before the replay of the graph segment holding this layer, with the outcome of
        its look-ahead job (which the step graph waited for from ``t0`` to ``t1``, with the
        segment's other layers'): the tokens the job inserted dropped from the window. Returns
        the staging copy the step needs, ``(buffers, bytes)`` or ``None``: the step graph copies
        the staging of a segment's layers together (``transfer.upload_together``)."""
        rt = self.runtime
        self.window.drop_flushed()
        self._graph_before = _Before(outcome, self._step_pages(max(self.window.win_len)), None, t0, t1, t1)
        if self._graph_before.pages != self._graph_pages:
            raise RuntimeError(f"IceCache layer {self.layer_idx}: a step graph's pages changed while staged")
        part = self.jobs.staging_part(outcome)
        if part is not None:
            rt.stats.copies_ahead += 1
        return part

    def step_after(self) -> QueuedStart:
        """After a step graph's replay: what ``attend`` does on the host after the device's
        work, but the next job is returned, for the step graph to queue with the other layers'
        (``jobs.start_all``)."""
        if self._graph_before is None:
            raise RuntimeError(f"IceCache layer {self.layer_idx}: step_after without step_stage")
        before, self._graph_before = self._graph_before, None
        queued = self.jobs.queued_start(self.window.hand_to_job())
        # The device's attention ran inside the graph: no host time of its own.
        self._count_step(before, before.t2)
        return queued

    def nbytes(self) -> dict:
        """Bytes held on the device (sink, window, page pool; the bridge's whole cache while it
        lasts) and in host memory (page stores, the indexes, a follower's history, the decode
        steps' buffers)."""
        if not self.is_initialized:
            return {"device": 0, "host": 0}
        self.runtime.wait_indexed()
        dev = sum(t.numel() * t.element_size() for t in (self.pool_kv, self.window.dense_kv))
        host = self.jobs.host_nbytes() + self.prefix.nbytes()
        if self._first_chunk is not None:
            dev += 2 * self._first_chunk[0].numel() * self._first_chunk[0].element_size()
        bridge = self.bridge
        if bridge is not None:
            held = bridge.nbytes()
            dev, host = dev + held["device"], host + held["host"]
        return {"device": dev, "host": host}
