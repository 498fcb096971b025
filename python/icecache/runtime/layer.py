"""One IceCache layer: a transformers ``CacheLayerMixin`` for a full-attention layer whose
middle tokens are offloaded to CPU semantic pages and retrieved per decode step."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from icecache import _core
from icecache.attend import attention_recall, sparse_decode_attention
from icecache.attend import flashinfer as fi
from icecache.runtime.config import IceCacheConfig
from icecache.runtime.integration import hand_off
from icecache.runtime.pages import History, PageIndex, PageStore, numpy_view
from icecache.runtime.transfer import Staging, Transit

__all__ = ["IceLayer", "Runtime", "RuntimeStats"]


@dataclass
class RuntimeStats:
    """Counters over the decode steps of all IceCache layers of one cache.

    Seconds are host wall time (on a GPU they include waiting for it): ``select_s`` the page
    selection and load planning, ``gather_s`` the step's metadata and the gather of missing
    pages into staging, ``copy_s`` the bulk host-to-device copy and the scatter into the page
    pool, ``attend_s`` the attention, ``recall_s`` the optional recall measurement,
    ``index_wait_s`` the time decode steps waited for the prefill pipeline to finish
    offloading and indexing the prompt.
    ``pages_selected`` counts the pages attended and ``pages_loaded`` those copied, summed over
    layers, sequences and KV heads; ``recalls`` holds one recall per (layer, sequence, step).
    """

    layer_steps: int = 0
    select_s: float = 0.0
    gather_s: float = 0.0
    copy_s: float = 0.0
    attend_s: float = 0.0
    recall_s: float = 0.0
    index_wait_s: float = 0.0
    pages_selected: int = 0
    pages_loaded: int = 0
    recalls: List[float] = field(default_factory=list)

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
    staging: Staging = field(init=False)
    #: FlashInfer decode shared by the layers (``None``: the torch path), from ``config.attention``.
    flashinfer: Optional["fi.FlashInferDecode"] = None
    #: Synchronise the device at every timing boundary so that the breakdown in :attr:`stats`
    #: is device time, not launch time (slower; for benchmarks).
    sync_timing: bool = False
    transit: Transit = field(init=False)
    _worker: Optional[ThreadPoolExecutor] = None
    _pending: List[Future] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.staging = Staging(self.device)
        self.transit = Transit(self.device)
        choice = self.config.attention
        if choice == "flashinfer" and not (self.device.type == "cuda" and fi.available()):
            raise ValueError(
                "IceCacheConfig(attention='flashinfer') needs a CUDA device and FlashInfer "
                "(pip install icecache[gpu]); use 'auto' to fall back to torch"
            )
        if choice != "torch" and self.device.type == "cuda" and fi.available():
            self.flashinfer = fi.FlashInferDecode(self.device)

    def use_flashinfer(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether layers of this dtype and head dim attend through FlashInfer."""
        if self.flashinfer is None:
            return False
        if fi.supports(self.device, dtype, head_dim):
            return True
        if self.config.attention == "flashinfer":
            raise ValueError(
                f"FlashInfer decode serves fp16/bf16 with head dim 64, 128 or 256, "
                f"not {dtype} with head dim {head_dim}; use attention='auto' or 'torch'"
            )
        return False

    def submit(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the index worker: one thread, jobs in submission order (so a
        reuse group's leader is indexed before the layers that follow its layout)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="icecache-index")
        self._pending.append(self._worker.submit(fn, *args))

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

    def tick(self) -> float:
        """A timestamp for the breakdown (after a device sync when :attr:`sync_timing`)."""
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class IceLayer(CacheLayerMixin):
    """Cache of one full-attention layer under IceCache.

    The prompt is attended exactly; then per sequence the first ``sink`` real tokens and the
    last ``window`` stay on the device and the rest goes to a CPU :class:`PageStore` in
    semantic page order, indexed by a :class:`PageIndex`. Each decode token joins the window;
    when the window is full its oldest page of tokens is inserted into the index.

    Prefill is pipelined: the offload and index build of a layer's prompt run on the runtime's
    worker thread (the copy on a side stream, the build in the core without the GIL) while the
    device computes the next layers; the first decode step waits for them. The prompt's
    device keys and values stay alive until the worker has copied them.

    A layer that leads its reuse group (``leader is None``) owns the indexes and selects
    pages; the others reuse the leader's page layout, selection and device-slot plan.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, runtime: Runtime, layer_idx: int, leader: Optional["IceLayer"] = None):
        super().__init__()
        self.runtime = runtime
        self.layer_idx = layer_idx
        self.leader = leader
        self.length = 0
        self.decoding = False
        self._prompt: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    # ------------------------------------------------------------------ transformers API

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.runtime.config
        B, H, _, D = key_states.shape
        self.device, self.dtype = self.runtime.device, key_states.dtype
        self.batch, self.heads, self.dim = B, H, D

        # All device tokens of a layer in one buffer per K/V, [B, H, pool | sink | window, D]:
        # the page pool, sink and window are views of it, so that FlashInfer can address all
        # three through one folded page table (icecache.attend.flashinfer).
        C, S = cfg.device_pages, cfg.page_size
        pool_tokens = C * S
        T = pool_tokens + cfg.sink + cfg.window
        self.kv_k = torch.zeros(B, H, T, D, dtype=self.dtype, device=self.device)
        self.kv_v = torch.zeros_like(self.kv_k)
        self.pool_k, self.pool_v = (t[:, :, :pool_tokens].view(B, H, C, S, D) for t in (self.kv_k, self.kv_v))
        self.sink_k, self.sink_v = (t[:, :, pool_tokens : pool_tokens + cfg.sink] for t in (self.kv_k, self.kv_v))
        self.win_k, self.win_v = (t[:, :, pool_tokens + cfg.sink :] for t in (self.kv_k, self.kv_v))
        self.sink_len = [0] * B
        self.win_len = [0] * B
        self.use_flashinfer = self.runtime.use_flashinfer(self.dtype, D)
        self.stores = [PageStore(H, cfg.page_size, D, self.dtype) for _ in range(B)]
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
        self.runtime.wait_indexed()
        self._append(key_states.to(self.device), value_states.to(self.device))
        self.length += 1
        hand_off(self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        """Logical length: every position seen, offloaded and padding ones included."""
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget everything; the layer initialises again on the next prompt."""
        IceLayer.__init__(self, self.runtime, self.layer_idx, self.leader)

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("IceCache does not support beam search, cropping or batch reshuffling")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported

    # ------------------------------------------------------------------ prompt and window

    def ingest_prompt(self, valid: Optional[torch.Tensor]) -> None:
        """Offload the prompt taken by :meth:`update` once its exact attention has run.

        Args:
            valid: ``[B, T]`` bool of real (non-padding) positions, or ``None`` for all.
        """
        if self._prompt is None:
            raise RuntimeError(f"layer {self.layer_idx} has no prompt to offload")
        k, v = self._prompt
        self._prompt = None
        self.load_prompt(k, v, valid)

    def load_prompt(self, k: torch.Tensor, v: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        """Split each sequence's prompt keys/values ``[B, H_kv, T, D]`` into sink, middle
        (offloaded and indexed) and window; ``valid`` as for :meth:`ingest_prompt`."""
        cfg = self.runtime.config
        if not self.is_initialized:
            self.lazy_initialization(k, v)
            self.length = k.shape[-2]
        k, v = k.to(self.device), v.to(self.device)
        middles = []
        for b in range(self.batch):
            kb, vb = k[b], v[b]
            if valid is not None and not bool(valid[b].all()):
                idx = valid[b].nonzero()[:, 0].to(self.device)
                kb, vb = kb[:, idx], vb[:, idx]
            n = kb.shape[1]
            s = min(cfg.sink, n)
            w = min(cfg.window, n - s)
            self.sink_k[b, :, :s], self.sink_v[b, :, :s] = kb[:, :s], vb[:, :s]
            self.win_k[b, :, :w], self.win_v[b, :, :w] = kb[:, n - w :], vb[:, n - w :]
            self.sink_len[b], self.win_len[b] = s, w
            if n - s - w > 0:
                middles.append((b, kb[:, s : n - w], vb[:, s : n - w]))
        if middles:
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self.runtime.submit(self._index_prompt, middles, ready)
        self.decoding = True

    def _index_prompt(self, middles: list, ready: Optional["torch.cuda.Event"]) -> None:
        """Index worker: copy each sequence's middle tokens to the host and index them."""
        for b, k, v in middles:
            k_host, v_host = self.runtime.transit.to_host(ready, k, v)
            self._offload(b, k_host, v_host)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        cfg = self.runtime.config
        ps = cfg.page_size
        for b in range(self.batch):
            w = self.win_len[b]
            if w == cfg.window:
                # The window is full: its oldest page of tokens goes to the index.
                old_k = self.win_k[b, :, :ps].to("cpu", copy=True)  # a copy on the CPU too
                old_v = self.win_v[b, :, :ps].to("cpu", copy=True)
                self.win_k[b, :, : w - ps] = self.win_k[b, :, ps:].clone()
                self.win_v[b, :, : w - ps] = self.win_v[b, :, ps:].clone()
                w -= ps
                self._offload(b, old_k.contiguous(), old_v.contiguous())
            # Python-int slots: no index tensor to upload, so no wait for the device.
            self.win_k[b, :, w] = k[b, :, 0]
            self.win_v[b, :, w] = v[b, :, 0]
            self.win_len[b] = w + 1

    def _offload(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``[H, m, D]`` host tokens (contiguous) that follow sequence ``b``'s offloaded
        ones to its index and store."""
        if self.leader is None:
            self.indexes[b].add(k, v, self.stores[b])
        else:
            self.histories[b].append(k, v)
            self.leader.indexes[b].follow(self.histories[b], self.stores[b])

    # ------------------------------------------------------------------ decode attention

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of this step's query ``[B, H_q, 1, D]`` over sink + selected pages +
        window; returns ``[B, 1, H_q, D]`` as transformers expects."""
        rt, cfg = self.runtime, self.runtime.config
        stats = rt.stats
        q = query[:, :, 0].to(self.device)
        indexes = self.indexes if self.leader is None else self.leader.indexes

        t0 = rt.tick()
        if self.leader is None:
            q_host = q.float().cpu().numpy()
            for b, index in enumerate(indexes):
                index.select(q_host[b], cfg.retrieved_pages, scale)
        t1 = rt.tick()
        parts, starts, n = self._stage(indexes)
        t2 = rt.tick()
        flat, rows = rt.staging.upload()
        meta = {name: flat[starts[name] : starts[name] + a.size].view(a.shape) for name, a in parts.items()}
        if n:
            bh, slot = meta["load_bh"], meta["load_slot"]
            B, H, C, S, D = self.pool_k.shape
            self.pool_k.view(B * H, C, S, D)[bh, slot] = rows[0]
            self.pool_v.view(B * H, C, S, D)[bh, slot] = rows[1]
        t3 = rt.tick()
        if self.use_flashinfer:
            assert rt.flashinfer is not None  # use_flashinfer says it serves this layer
            out = rt.flashinfer.run(q, self.kv_k, self.kv_v, meta["fi_indptr"], meta["fi_indices"], scale)
        else:
            out = sparse_decode_attention(
                q,
                self.sink_k,
                self.sink_v,
                meta["sink_len"],
                self.pool_k,
                self.pool_v,
                meta["table"],
                meta["page_len"],
                self.win_k,
                self.win_v,
                meta["win_len"],
                scale,
            )
        t4 = rt.tick()

        stats.layer_steps += 1
        stats.select_s += t1 - t0
        stats.gather_s += t2 - t1
        stats.copy_s += t3 - t2
        stats.attend_s += t4 - t3
        stats.pages_selected += sum(int(ix.selection[1].sum()) for ix in indexes)
        stats.pages_loaded += n
        if rt.track_recall:
            self._track_recall(q, indexes, scale)
            stats.recall_s += time.perf_counter() - t4
        return out[:, None].to(query.device)

    def _stage(self, indexes: List[PageIndex]) -> tuple:
        """Put this step's integer metadata and the planned pages (gathered by the core) in
        staging, for one host-to-device copy (a reusing layer loads what its leader planned).
        Returns ``(parts, starts, n)``: the metadata arrays by name, where each starts in the
        int32 metadata, and the number of pages loaded."""
        cfg = self.runtime.config
        plans = [ix.plan for ix in indexes]
        H, S = self.heads, cfg.page_size
        # Attend only over the columns some head uses (fewer pages than the budget allows
        # while the offloaded part is short).
        used = max(int(ix.selection[1].max(initial=0)) for ix in indexes)
        table = np.stack([p[3][:, :used] for p in plans])
        page_len = np.stack([ix.selected_lens()[:, :used] for ix in indexes])
        parts = {
            "load_bh": np.concatenate([b * H + p[0] for b, p in enumerate(plans)]),
            "load_slot": np.concatenate([p[2] for p in plans]),
        }
        if self.use_flashinfer:
            parts["fi_indptr"], parts["fi_indices"] = fi.token_lists(
                table,
                page_len,
                np.asarray(self.sink_len),
                np.asarray(self.win_len),
                cfg.device_pages,
                S,
                cfg.sink,
                cfg.window,
            )
        else:
            parts.update(
                sink_len=np.asarray(self.sink_len), win_len=np.asarray(self.win_len), table=table, page_len=page_len
            )
        # Each part starts 16-byte aligned in the upload.
        starts, at = {}, 0
        for name, a in parts.items():
            starts[name] = at
            at += -(-a.size // 4) * 4
        n = len(parts["load_bh"])
        meta_host, k_rows, v_rows = self.runtime.staging.begin(at, n, S, self.dim, self.dtype)
        for name, a in parts.items():
            meta_host[starts[name] : starts[name] + a.size] = a.ravel()
        start = 0
        for b, (heads, pages, _, _) in enumerate(plans):
            m = len(heads)
            if m:
                _core.gather_pages(
                    *self.stores[b].views(),
                    heads,
                    pages,
                    numpy_view(k_rows[start : start + m]),
                    numpy_view(v_rows[start : start + m]),
                )
                start += m
        return parts, starts, n

    def _track_recall(self, q: torch.Tensor, indexes: List[PageIndex], scale: float) -> None:
        for b, index in enumerate(indexes):
            if index.forest is None:
                continue
            s, w = self.sink_len[b], self.win_len[b]
            dense = torch.cat([self.sink_k[b, :, :s], self.win_k[b, :, :w]], dim=1).cpu()
            pages = index.lens.shape[1]
            recall = attention_recall(
                q[b].cpu(),
                dense,
                self.stores[b].k[:, :pages],
                torch.from_numpy(index.lens),
                torch.from_numpy(index.selection[0]),
                scale,
            )
            self.runtime.stats.recalls.append(float(recall.mean()))

    def nbytes(self) -> dict:
        """Bytes held on the device (sink, window, page pool) and in host memory (stores)."""
        if not self.is_initialized:
            return {"device": 0, "host": 0}
        self.runtime.wait_indexed()
        dev = sum(t.numel() * t.element_size() for t in (self.kv_k, self.kv_v))
        host = sum(s.k.numel() * s.k.element_size() * 2 for s in self.stores)
        return {"device": dev, "host": host}
