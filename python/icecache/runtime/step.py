"""One IceCache layer's device work in a decode step, eager or replayed from CUDA graphs.

Per layer and step the device: writes the step's token into the window ring, applies the host
job's pages (two index copies over the fixed staging layout, padded entries going to a trash
slot, see ``icecache._core.StagingLayout``), ranks the pool's pages and attends
(:func:`icecache.attend.ranked_decode_attention`), and, with look-ahead, hands the step's
queries and a step number to the host for the next job.

Eager, that is about twenty small kernels, whose launches cost far more host time than the
device spends on them on slow hosts. Every shape is fixed per layer, so on CUDA each value of
``pages`` (two occur) is captured once into a CUDA graph and replayed: per step, one call that
copies the step's query, key and value into the graph's inputs, and one replay. The window
position and the step counter live on the device and advance inside the graph.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from icecache.attend.ranked import RankedAttention, ranked_decode_attention
from icecache.runtime.graphs import capture, retire_with
from icecache.runtime.pages import dequantize_kv, dequantize_pages, page_bytes
from icecache.runtime.staging import StagingView

__all__ = ["DeviceStep"]


class DeviceStep:
    """The device side of one IceCache layer's decode steps.

    Args:
        pool_rows: ``[2, B*H*C + 1, S*D]`` K and V of the page pool, one row per slot and the
            last row a trash slot.
        pool_masks: ``[B*H*C + 1, S]`` bool, which tokens of each pool slot are valid (trash last).
        dense_kv: ``[2, B, H, L, D]`` the sink, the window ring and a trash slot last.
        dense_valid: ``[B, H, L]`` bool.
        staging: the regions of the device copy of the layer's staging buffer.
        ring: ``(first, size)``: where the window ring starts in the dense tokens, and its slots.
        query_heads, scale: of the layer's attention.
        adaptive: share the pages among the KV heads by mass (``budget_mode="adaptive"``).
        handoff: ``(host_query, host_flag)`` pinned host tensors to hand each step's queries and
            step number to (look-ahead), or ``None``.
        graphs: replay from CUDA graphs (CUDA only); ``pool``: their shared memory pool.
        page_format: how staging carries pages (``IceCacheConfig.page_format``): quantised
            pages are dequantised into the pool's dtype as they are scattered.
    """

    def __init__(
        self,
        pool_rows: torch.Tensor,
        pool_masks: torch.Tensor,
        dense_kv: torch.Tensor,
        dense_valid: torch.Tensor,
        staging: StagingView,
        *,
        ring: Tuple[int, int],
        query_heads: int,
        scale: float,
        adaptive: bool = False,
        handoff: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        graphs: bool = False,
        pool: Optional[Any] = None,
        page_format: str = "native",
    ):
        _, B, H, L, D = dense_kv.shape
        S = pool_masks.shape[1]
        C = (pool_masks.shape[0] - 1) // (B * H)
        dev = dense_kv.device
        self._pool_rows, self._pool_masks = pool_rows, pool_masks
        self.pool_kv = pool_rows[:, : B * H * C].view(2, B, H, C, S, D)
        self.pool_valid = pool_masks[: B * H * C].view(B, H, C, S)
        self.dense_kv, self.dense_valid = dense_kv, dense_valid
        self._ring_first, self._ring = ring
        self._scale = scale
        self._adaptive = adaptive
        self._load_idx, self._mask_idx, self._masks = staging.load_idx, staging.mask_idx, staging.masks
        # Quantised: [n, K page bytes + V page bytes], dequantised per step (only the staged
        # pages when eager).
        self._format = page_format
        self._rows = staging.rows if page_format != "native" else staging.rows.transpose(0, 1)
        self._page = (S, D)
        self._k_bytes = page_bytes(page_format, S, D)[0] if page_format != "native" else 0
        # Until a job's outcome arrives, every entry names the trash slot.
        self._load_idx.fill_(staging.trash)
        self._mask_idx.fill_(staging.trash)
        # The step's inputs, and the device state that the graphs advance.
        self.query = torch.zeros(B, query_heads, D, dtype=dense_kv.dtype, device=dev)
        self.kv = torch.zeros(2, B, H, D, dtype=dense_kv.dtype, device=dev)
        self.window_at = torch.zeros(B, dtype=torch.int64, device=dev)  # dense slot of the next token
        self.counter = torch.zeros(1, dtype=torch.int64, device=dev)
        # A device True: a Python value would be copied from host memory, which a graph
        # capture refuses.
        self._true = torch.ones((), dtype=torch.bool, device=dev)
        self._b = torch.arange(B, device=dev)[:, None]
        self._h = torch.arange(H, device=dev)[None, :]
        self._handoff = handoff
        self._graphs_on = graphs and dev.type == "cuda"
        self._pool = pool
        self._graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Destroyed at a safe point after this step is collected, never during a capture.
        retire_with(self, self._graphs)

    def start_window(self, next_slots) -> None:
        """Where each sequence's next window token goes: ring slot ``next_slots[b]``."""
        slots = torch.tensor([self._ring_first + s for s in next_slots], dtype=torch.int64)
        self.window_at.copy_(slots)

    def _ops(
        self,
        pages: int,
        keep: Optional[torch.Tensor] = None,
        want_lse: bool = False,
        staged: Optional[Tuple[int, int]] = None,
    ) -> RankedAttention:
        # The step's token into the window ring, then the next position.
        at = self.window_at[:, None]
        self.dense_kv[:, self._b, self._h, at] = self.kv
        self.dense_valid.index_put_((self._b, self._h, at), self._true)
        self.window_at.sub_(self._ring_first - 1).remainder_(self._ring).add_(self._ring_first)
        # The job's pages and masks: all entries in a graph (padded ones land in the trash
        # slot), only the ``staged`` (loads, masks) ones eagerly.
        n, m = staged if staged is not None else (len(self._load_idx), len(self._mask_idx))
        if n:
            idx = self._load_idx[:n]
            if self._format == "native":
                self._pool_rows.index_copy_(1, idx, self._rows[:, :n])
            elif self._format == "int8":  # K and V pages of one size: one dequantisation
                both = dequantize_pages(self._rows[:n].unflatten(-1, (2, -1)), *self._page, self._pool_rows.dtype)
                self._pool_rows.index_copy_(1, idx, both.flatten(-2).transpose(0, 1))
            else:
                loaded = self._rows[:n]
                kv = dequantize_kv(
                    loaded[:, : self._k_bytes],
                    loaded[:, self._k_bytes :],
                    self._format,
                    *self._page,
                    self._pool_rows.dtype,
                )
                for pool, tokens in zip(self._pool_rows, kv):
                    pool.index_copy_(0, idx, tokens.flatten(-2))
        if m:
            self._pool_masks.index_copy_(0, self._mask_idx[:m], self._masks[:m])
        res = ranked_decode_attention(
            self.query,
            self.pool_kv,
            self.pool_valid,
            self.dense_kv,
            self.dense_valid,
            pages=pages,
            scale=self._scale,
            keep=keep,
            adaptive=self._adaptive,
            want_lse=want_lse,
        )
        if self._handoff is not None:
            host_query, host_flag = self._handoff
            host_query.copy_(self.query.float(), non_blocking=True)
            self.counter.add_(1)
            host_flag.copy_(self.counter, non_blocking=True)
        return res

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: int,
        staged: Tuple[int, int],
        keep: Optional[torch.Tensor] = None,
        want_lse: bool = False,
        capture: bool = True,
    ) -> Tuple[torch.Tensor, Optional[RankedAttention]]:
        """One step for ``query`` ``[B, H_q, D]``, ``key``/``value`` ``[B, H, D]``, applying the
        ``staged`` ``(loads, masks)`` entries of the device staging: the output ``[B, H_q, D]``,
        and the full result when run eagerly (``keep``, ``want_lse``, no graphs, or no graph
        for ``pages`` yet and ``capture`` off). A graph's output stays valid until its next
        replay."""
        torch._foreach_copy_([self.query, self.kv[0], self.kv[1]], [query, key, value])
        if self._graphs_on and keep is None and not want_lse and (capture or pages in self._graphs):
            try:
                graph, out = self._graphs.get(pages) or self._capture(pages)
            except RuntimeError as exc:
                warnings.warn(f"CUDA graph capture failed ({exc}); this layer runs eagerly from now on", stacklevel=2)
                self._graphs_on = False
            else:
                graph.replay()
                return out, None
        res = self._ops(pages, keep, want_lse, staged)
        return res.out, res

    def inline(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: int) -> torch.Tensor:
        """The step as it runs inside a larger CUDA graph (a step graph of the whole model,
        :mod:`icecache.runtime.stepgraph`), or eagerly as its reference: every staging entry
        applied, as in this layer's own graphs; returns the output ``[B, H_q, D]``."""
        torch._foreach_copy_([self.query, self.kv[0], self.kv[1]], [query, key, value])
        return self._ops(pages).out

    def saved_state(self) -> list:
        """Copies of the state a step advances (window, step counter, and the step number
        handed to the host), for :meth:`restore_state` after warm-up runs."""
        state = [t.clone() for t in (self.dense_kv, self.dense_valid, self.window_at, self.counter)]
        if self._handoff is not None:
            state.append(self._handoff[1].clone())
        return state

    def restore_state(self, saved: list) -> None:
        """Put back the state of :meth:`saved_state`. The host's step number too: a warm-up
        wrote the step's number before the step, and the job started behind it would start
        early, and write the next staging while the step still reads the current one."""
        for t, s in zip((self.dense_kv, self.dense_valid, self.window_at, self.counter), saved):
            t.copy_(s)
        if self._handoff is not None:
            if self.query.is_cuda:
                torch.cuda.synchronize(self.query.device)  # the warm-up's copy has landed
            self._handoff[1].copy_(saved[4])

    def _capture(self, pages: int) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up runs (outside the capture: library workspaces) write the window and count:
        # put that state back afterwards. Their page loads repeat the step's own.
        saved = self.saved_state()
        try:
            side = torch.cuda.Stream(self.query.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._ops(pages)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool=self._pool):
                out = self._ops(pages).out
        finally:
            self.restore_state(saved)
        self._graphs[pages] = (graph, out)
        return self._graphs[pages]
