"""Transfers between the device and CPU memory.

- :class:`Staging`, decode: one host-to-device copy per layer step carries the step's small
  integer metadata and the pages to load, gathered into pinned rows.
- :class:`Transit`, prefill: the prompt's middle tokens leave the device on a side stream into a
  reused host buffer, on the index worker thread, while the device computes the next layers.

Only these buffers take part in DMA. The page stores are written and read by the CPU alone (the
index build, inserts, the gather into staging), so they live in ordinary memory: pinning is
slow on some hosts (the lent H200 pins 134 MB in 0.5 s) and buys nothing there.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

__all__ = ["Staging", "Transit"]

_ALIGN = 64  # bytes; the page rows start aligned after the metadata


class Staging:
    """Pinned staging for one layer step: metadata (int32) then K rows then V rows.

    :meth:`begin` hands out host views to fill: the metadata, and the rows that the core's
    gather writes the selected pages into; :meth:`upload` copies all of it to the device in one
    transfer and returns device views of the same parts. On a GPU the buffer is pinned and the
    copy asynchronous; two buffers alternate, and a buffer is refilled only after the event
    recorded behind its last copy, so the next layer's gather can overlap the previous copy. On
    the CPU the "device" views are the host views.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self._buffers: List[Optional[torch.Tensor]] = [None, None]
        self._events: List[Optional[torch.cuda.Event]] = [None, None]
        self._turn = 0  # buffer that the next begin() call fills
        self._layout: Optional[tuple] = None  # (buffer, meta_len, rows_at, end, rows shape, dtype)

    def begin(
        self,
        meta_len: int,
        n: int,
        page_size: int,
        dim: int,
        dtype: torch.dtype,
    ) -> Tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Host views for one step: ``(meta [meta_len] int32, k_rows [n, S, D], v_rows [n, S, D])``."""
        i = self._turn
        if self.pin:
            self._turn ^= 1
        event = self._events[i]
        if event is not None:
            event.synchronize()
            self._events[i] = None
        rows_at = -(-meta_len * 4 // _ALIGN) * _ALIGN
        row_bytes = n * page_size * dim * dtype.itemsize
        need = rows_at + 2 * row_bytes
        buf = self._buffers[i]
        if buf is None or buf.numel() < need:
            size = max(need, 2 * buf.numel()) if buf is not None else need
            buf = self._buffers[i] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        shape = (2, n, page_size, dim)
        self._layout = (i, meta_len, rows_at, need, shape, dtype)
        meta = buf[: meta_len * 4].numpy().view(np.int32)
        rows = buf[rows_at:need].view(dtype).view(shape)
        return meta, rows[0], rows[1]

    def upload(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Copy what :meth:`begin` handed out to the device in one transfer; returns
        ``(meta [meta_len] int32, rows [2, n, S, D])`` on the device."""
        if self._layout is None:
            raise RuntimeError("Staging.upload() needs a begin() first")
        i, meta_len, rows_at, end, shape, dtype = self._layout
        buf = self._buffers[i]
        assert buf is not None  # begin() allocated it
        flat = buf[:end]
        if self.pin:
            flat = flat.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._events[i] = event
        meta = flat[: meta_len * 4].view(torch.int32)
        rows = flat[rows_at:].view(dtype).view(shape)
        return meta, rows

    def nbytes(self) -> int:
        """Host bytes held by the staging buffers."""
        return sum(b.numel() for b in self._buffers if b is not None)


class Transit:
    """A reused host buffer that device tensors are copied into on a side stream.

    Used by the index worker only (one thread): fresh host memory makes a device-to-host copy
    ~10x slower (the lent H200: 113 ms vs 11 ms for 134 MB), so one buffer serves every layer.

    Args:
        device: the device the tensors come from.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._buffer: Optional[torch.Tensor] = None

    def to_host(self, ready: Optional["torch.cuda.Event"], *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Contiguous host copies of ``tensors`` (same dtype), valid until the next call.
        ``ready``: the event behind the work that produced them (``None`` on the CPU)."""
        dtype = tensors[0].dtype
        need = sum(t.numel() for t in tensors)
        buf = self._buffer
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            buf = self._buffer = torch.empty(need, dtype=dtype)
        out, start = [], 0
        for t in tensors:
            out.append(buf[start : start + t.numel()].view(t.shape))
            start += t.numel()
        if self.stream is None:
            for o, t in zip(out, tensors):
                o.copy_(t)
            return tuple(out)
        if ready is None:
            raise ValueError("Transit.to_host needs the ready event of the device work")
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for o, t in zip(out, tensors):
                o.copy_(t)  # blocking: waits for this stream only, not for the layers queued since
        return tuple(out)

    def nbytes(self) -> int:
        """Host bytes held."""
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()
