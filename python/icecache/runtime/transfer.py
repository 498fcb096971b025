"""Host-to-device page transfer: pinned staging buffers and one bulk copy per layer step."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["Staging"]


class Staging:
    """Staging rows for the pages one layer loads in one step, then one copy to the device.

    The selected pages are gathered (by the core, in parallel) into a contiguous host buffer,
    K rows then V rows, so a single host-to-device copy moves them all. On a GPU the buffers
    are pinned and the copy is asynchronous; two buffers alternate, and a buffer is reused only
    after the event recorded behind its last copy, so the next layer's gather can overlap the
    previous copy. On the CPU the "copy" is the scatter into the page pool itself.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self._buffers: list = [None, None]
        self._events: list = [None, None]
        self._turn = 0  # buffer that the next rows() call fills
        self._current = 0  # buffer filled by the last rows() call

    def rows(self, n: int, page_size: int, dim: int, dtype: torch.dtype,
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host rows for ``n`` pages: ``(k_rows [n, S, D], v_rows [n, S, D], flat)``, where
        ``flat`` is both, contiguous, for :meth:`upload`."""
        i = self._current = self._turn
        if self.pin:
            self._turn ^= 1
        if self._events[i] is not None:
            self._events[i].synchronize()
            self._events[i] = None
        page = page_size * dim
        need = 2 * n * page
        buf: Optional[torch.Tensor] = self._buffers[i]
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            size = max(need, 2 * buf.numel()) if buf is not None and buf.dtype == dtype else need
            buf = torch.empty(size, dtype=dtype, pin_memory=self.pin)
            self._buffers[i] = buf
        flat = buf[:need]
        return flat[: n * page].view(n, page_size, dim), flat[n * page :].view(n, page_size, dim), flat

    def upload(self, flat: torch.Tensor) -> torch.Tensor:
        """Copy ``flat`` (from :meth:`rows`) to the device in one transfer."""
        out = flat.to(self.device, non_blocking=self.pin)
        if self.pin:
            event = torch.cuda.Event()
            event.record()
            self._events[self._current] = event
        return out

    def nbytes(self) -> int:
        """Host bytes held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers if b is not None)
