"""Transfers between the device and CPU memory.

- :class:`StepBuffers`, decode: per layer, the queries and flushed tokens going to the host and
  the staging that carries a step's metadata and pages to the device in one copy.
- :class:`Transit`, prefill: the prompt's middle tokens leave the device on a side stream into a
  reused host buffer, on the index worker thread, while the device computes the next layers.

Only these buffers take part in DMA. The page stores are written and read by the CPU alone (the
index build, inserts, the gather into staging), so they live in ordinary memory: pinning is
slow on some hosts and buys nothing there (benches/RESULTS.md, "GPU decode on the H200,
synchronous selection", under "What moved the figures").
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["StepBuffers", "Transit", "upload_together"]


class StepBuffers:
    """The host buffers of one IceCache layer's decode steps, and the device copy of staging.

    - ``queries`` ``[B, H_q, D]`` float32: each step's queries, copied from the device behind
      the layer's attention (asynchronously on a GPU) for the look-ahead worker;
    - ``flag`` ``[1]`` int64: a step number the device writes after the queries; the worker
      starts the layer's job once it sees it;
    - ``flush_k``, ``flush_v`` ``[B, H_kv, page_size, D]``: tokens the window hands to the index;
    - ``staging`` uint8: what a job writes for the device (metadata, then page rows; layout in
      ``icecache._core.LookAheadLayer``), copied to the device in one transfer by :meth:`upload`.

    On a GPU the host buffers are pinned, so that these copies are asynchronous; on the CPU
    "uploading" is a view of the staging buffer.

    Args:
        device: where the layer's tokens live.
        batch, kv_heads, query_heads, dim, page_size: the layer's shapes.
        dtype: the KV dtype.
        staging_bytes: the largest staging a job may need.
    """

    def __init__(
        self,
        device: torch.device,
        batch: int,
        kv_heads: int,
        query_heads: int,
        dim: int,
        page_size: int,
        dtype: torch.dtype,
        staging_bytes: int,
    ):
        self.device = device
        pin = device.type == "cuda"
        self.queries = torch.zeros(batch, query_heads, dim, dtype=torch.float32, pin_memory=pin)
        self.flag = torch.full((1,), -1, dtype=torch.int64, pin_memory=pin)
        self.flush_k = torch.zeros(batch, kv_heads, page_size, dim, dtype=dtype, pin_memory=pin)
        self.flush_v = torch.zeros_like(self.flush_k, pin_memory=pin)
        self.staging = torch.zeros(staging_bytes, dtype=torch.uint8, pin_memory=pin)
        self._device_staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device) if pin else None
        # The job whose staging :meth:`upload_ahead` is copying, and the event behind that copy
        # (one event, recorded again by each early copy: the upload waits before the next).
        self._ahead: Optional[int] = None
        self._ahead_done = torch.cuda.Event() if pin else None

    @property
    def device_staging(self) -> torch.Tensor:
        """The device's copy of the staging buffer (on the CPU: the staging buffer itself)."""
        return self.staging if self._device_staging is None else self._device_staging

    def upload(self, nbytes: int, job: int) -> torch.Tensor:
        """Copy the first ``nbytes`` of staging, which job number ``job`` wrote, to the device
        (one asynchronous copy on a GPU); returns the device copy. If :meth:`upload_ahead`
        already started that copy for ``job``, the current stream only waits for it."""
        if self._device_staging is not None:
            ahead, self._ahead = self._ahead, None
            if ahead == job and self._ahead_done is not None:
                torch.cuda.current_stream(self.device).wait_event(self._ahead_done)
            else:
                self._device_staging[:nbytes].copy_(self.staging[:nbytes], non_blocking=True)
        return self.device_staging

    def upload_ahead(self, nbytes: int, job: int, stream: "torch.cuda.Stream") -> None:
        """Start :meth:`upload` of ``job``'s staging early, on ``stream`` (a GPU only), so that
        the copy runs while the device computes the layers before this one; the caller must
        know that the device has finished reading the previous upload (see
        ``LayerJobs.upload_ahead``)."""
        if self._device_staging is None or self._ahead_done is None:
            return
        with torch.cuda.stream(stream):
            self.copy_staging(nbytes)
        self._ahead_done.record(stream)
        self._ahead = job

    def copy_staging(self, nbytes: int) -> None:
        """Start the copy of the first ``nbytes`` of staging to the device on the current stream
        (asynchronous; nothing on the CPU). The caller orders it with the device's reads."""
        if self._device_staging is not None:
            self._device_staging[:nbytes].copy_(self.staging[:nbytes], non_blocking=True)

    def forget_ahead(self) -> None:
        """Drop an early copy that no :meth:`upload` will wait for (the layer was reset)."""
        self._ahead = None

    def nbytes(self) -> int:
        """Host bytes held."""
        parts = (self.queries, self.flag, self.flush_k, self.flush_v, self.staging)
        return sum(t.numel() * t.element_size() for t in parts)


def upload_together(
    parts: Sequence[Tuple[StepBuffers, int]], stream: "torch.cuda.Stream", done: "torch.cuda.Event"
) -> None:
    """Copy the first ``nbytes`` of each ``(buffers, nbytes)``'s staging to the device on
    ``stream``, and make the current stream wait for them all: one stream switch and one event
    for several layers (a step graph segment's), where :meth:`StepBuffers.upload_ahead` takes one
    each. Any early copy of theirs is forgotten: these copies replace it. A GPU only."""
    if not parts:
        return
    with torch.cuda.stream(stream):
        for bufs, nbytes in parts:
            bufs.forget_ahead()
            bufs.copy_staging(nbytes)
    done.record(stream)
    torch.cuda.current_stream(stream.device).wait_event(done)


class Transit:
    """A reused host buffer that device tensors are copied into on a side stream.

    Used by the index worker only (one thread): a device-to-host copy into fresh host memory is
    far slower than into a reused buffer (benches/RESULTS.md, "GPU decode on the H200,
    synchronous selection", under "What moved the figures"), so one buffer serves every layer;
    so does a chunked prompt's middle, gathered from the host prompt for its build.

    Args:
        device: the device the tensors come from.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._buffer: Optional[torch.Tensor] = None

    def views(self, dtype: torch.dtype, *shapes: Tuple[int, ...]) -> Tuple[torch.Tensor, ...]:
        """Contiguous host tensors of ``shapes`` in the buffer, valid until the next call (of
        this or :meth:`to_host`)."""
        sizes = [math.prod(shape) for shape in shapes]
        buf = self._buffer
        if buf is None or buf.numel() < sum(sizes) or buf.dtype != dtype:
            buf = self._buffer = torch.empty(sum(sizes), dtype=dtype)
        out, start = [], 0
        for shape, size in zip(shapes, sizes):
            out.append(buf[start : start + size].view(shape))
            start += size
        return tuple(out)

    def to_host(self, ready: Optional["torch.cuda.Event"], *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Contiguous host copies of ``tensors`` (same dtype), valid until the next call.
        ``ready``: the event behind the work that produced them (``None`` on the CPU)."""
        out = self.views(tensors[0].dtype, *(tuple(t.shape) for t in tensors))
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
