"""One IceCache layer: a transformers ``CacheLayerMixin`` for a full-attention layer whose
middle tokens are offloaded to CPU semantic pages and retrieved per decode step.

The layer keeps the order of a step; its parts are the device window (:mod:`.window`), the
host side with its look-ahead jobs (:mod:`.jobs`), the bridge while the indexes are built
(:mod:`.bridge`), the device step (:mod:`.step`) and, for evaluation, the recall probe
(:mod:`.probe`)."""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

import torch
from transformers.cache_utils import CacheLayerMixin

from icecache.runtime.bridge import Bridge
from icecache.runtime.config import CALIBRATION_POSITIONS
from icecache.runtime.integration import hand_off
from icecache.runtime.jobs import FollowerJobs, LayerJobs, LeaderJobs, Middle
from icecache.runtime.pages import PageIndex, PageStore
from icecache.runtime.probe import track_recall
from icecache.runtime.runtime import Runtime
from icecache.runtime.step import DeviceStep
from icecache.runtime.window import DeviceWindow

__all__ = ["IceLayer"]


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
        self._prompt: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._device_step: Optional[DeviceStep] = None
        self._step_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

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
        bridge = self.bridge
        if bridge is not None:
            if self.runtime.decide_bridging(self.length):
                bridge.append(key_states.to(self.device), value_states.to(self.device))
                self.length += 1
                self.runtime.stats.bridged_steps += 1
                hand_off(self)
                return bridge.k, bridge.v
            self.runtime.leave_bridges()
        self.runtime.wait_indexed()
        t = time.perf_counter()
        k, v = key_states.to(self.device), value_states.to(self.device)
        self.window.append(self.jobs.buffers())
        # The device step writes the token into the ring (at the position it keeps itself).
        self._step_kv = (k[:, :, 0], v[:, :, 0])
        self.runtime.stats.update_s += time.perf_counter() - t
        self.length += 1
        hand_off(self)
        return key_states, value_states

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
    def indexes(self) -> List[PageIndex]:
        """Per sequence, the index of this layer's reuse group (its leader's)."""
        return self.jobs.group_indexes

    # ------------------------------------------------------------------ prompt

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
        if not self.is_initialized:
            self.lazy_initialization(k, v)
            self.length = k.shape[-2]
        calibrate = self.jobs.calibrates and queries is not None
        k, v = k.to(self.device), v.to(self.device)
        middles: List[Middle] = []
        unindexed = []
        for b in range(self.batch):
            kb, vb = k[b], v[b]
            qb = queries[b] if calibrate and queries is not None else None
            if valid is not None and not bool(valid[b].all()):
                idx = valid[b].nonzero()[:, 0].to(self.device)
                kb, vb = kb[:, idx], vb[:, idx]
                qb = None if qb is None else qb[:, idx.to(qb.device)]
            split = self.window.load_prompt(b, kb, vb)
            unindexed.append(split.window_start)
            if split.window_start > split.sink:
                middle = slice(split.sink, split.window_start)
                # A copy of its own, in the keys' dtype, so that one transfer takes it with them.
                q_last = None if qb is None else qb[:, -CALIBRATION_POSITIONS:].to(self.device, kb.dtype).clone()
                middles.append((b, kb[:, middle], vb[:, middle], q_last))
        if middles:
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self.runtime.submit(self.jobs.index_prompt, middles, ready)
            if cfg.exact_until_indexed:
                T = k.shape[-2]
                padding = [T - n for n in (valid.sum(-1).tolist() if valid is not None else [T] * self.batch)]
                bridge = Bridge(
                    k,
                    v,
                    None if valid is None else valid.to(self.device),
                    unindexed,
                    padding,
                    window=self.window,
                    catch_up=self.jobs.catch_up,
                    submit=self.runtime.submit,
                    transit=self.runtime.transit,
                )
                self.runtime.bridges.add(self.layer_idx, bridge)
        self.decoding = True

    # ------------------------------------------------------------------ decode attention

    def _open_device_step(self, query_heads: int, scale: float) -> DeviceStep:
        """The first decode step: the host jobs lend their buffers, and the device step is made."""
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
        # This step's token is counted in win_len already, and the device step writes it.
        step.start_window(w.last_slots())
        return step

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of this step's query ``[B, H_q, 1, D]`` over sink + pages + window;
        returns ``[B, 1, H_q, D]`` as transformers expects."""
        rt, cfg = self.runtime, self.runtime.config
        stats, jobs, w = rt.stats, self.jobs, self.window
        q = query[:, :, 0].to(self.device)
        if self._device_step is None:
            self._device_step = self._open_device_step(q.shape[1], scale)
        t0 = rt.tick()
        if not cfg.lookahead or jobs.steps == 0:
            jobs.start(w.hand_to_job(), q, now=True)
        outcome = jobs.wait()
        t1 = rt.tick()
        table = jobs.upload(outcome, fresh=not cfg.lookahead)
        w.drop_flushed()
        t2 = rt.tick()
        keep = None
        if table is not None:
            keep = torch.zeros(self.batch, self.heads, cfg.device_pages + 1, dtype=torch.bool, device=self.device)
            keep.scatter_(2, torch.where(table >= 0, table, cfg.device_pages).long(), True)
            keep = keep[..., :-1]
        # The budget: sink + window (+ a flushed page still attended) + pages.
        pages = max(0, min(cfg.retrieved_pages, (cfg.budget - max(w.sink_len) - max(w.win_len)) // cfg.page_size))
        if self._step_kv is None:
            raise RuntimeError(f"IceCache layer {self.layer_idx}: attention without its update")
        k, v = self._step_kv
        staged = (outcome.loads, outcome.loads + outcome.clears)
        out, res = self._device_step(q, k, v, pages, staged, keep=keep, want_lse=rt.track_recall)
        t3 = rt.tick()
        if rt.track_recall:
            if res is None:
                raise RuntimeError("recall tracking needs the device step's full result")
            track_recall(
                q,
                res,
                outcome,
                pages=pages,
                scale=scale,
                window=w,
                jobs=jobs,
                pool_valid=self.pool_valid,
                lookahead=cfg.lookahead,
                stats=stats,
            )
            stats.recall_s += time.perf_counter() - t3
        if cfg.lookahead:
            jobs.start(w.hand_to_job(), q, now=False)
        if self.next_layer is not None:
            self.next_layer.jobs.upload_ahead()

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

    def nbytes(self) -> dict:
        """Bytes held on the device (sink, window, page pool; the bridge's whole cache while it
        lasts) and in host memory (page stores, the indexes, a follower's history, the decode
        steps' buffers)."""
        if not self.is_initialized:
            return {"device": 0, "host": 0}
        self.runtime.wait_indexed()
        dev = sum(t.numel() * t.element_size() for t in (self.pool_kv, self.window.dense_kv))
        bridge = self.bridge
        if bridge is not None:
            dev += 2 * bridge.k.numel() * bridge.k.element_size()
        return {"device": dev, "host": self.jobs.host_nbytes()}
