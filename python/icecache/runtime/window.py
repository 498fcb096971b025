"""The device window of one IceCache layer: the sink and the ring of recent tokens.

Each sequence's first ``sink`` real tokens and its last ``window`` ones stay on the device, in
one dense buffer ``[2, B, H_kv, sink + window + page_size, D]`` (K and V) with a mask of the
slots that hold a token: the sink, then the window as a ring with room for one more page. When
the window is full, its oldest page goes to the host's flush buffers for the index; those
tokens stay attended from the ring until the job that inserted them has been applied, so a
token is never attended twice nor missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from icecache.runtime.transfer import StepBuffers

__all__ = ["DeviceWindow", "PromptSplit"]


@dataclass(frozen=True)
class PromptSplit:
    """Where :meth:`DeviceWindow.load_prompt` cut one sequence's real tokens: the sink is
    ``[0, sink)``, the window ``[window_start, n)``, and the middle between them goes to the index."""

    sink: int
    window_start: int


class DeviceWindow:
    """Sink and window ring of one layer, with the per-sequence ring bookkeeping.

    Args:
        batch, heads, dim: the layer's sequences, KV heads and head dim.
        dtype, device: of the layer's keys.
        sink, window, page_size: from :class:`icecache.runtime.IceCacheConfig`.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        sink: int,
        window: int,
        page_size: int,
    ):
        self.batch, self.sink, self.window, self.page_size = batch, sink, window, page_size
        #: Ring slots: the window with room for a flushed page that is still attended.
        self.ring = window + page_size
        #: Where the ring starts in the dense tokens (after the sink).
        self.ring_at = sink
        L = sink + self.ring
        self.dense_kv = torch.zeros(2, batch, heads, L, dim, dtype=dtype, device=device)
        self.dense_valid = torch.zeros(batch, heads, L, dtype=torch.bool, device=device)
        #: Per sequence: valid sink tokens.
        self.sink_len = [0] * batch
        #: Per sequence: the window's oldest ring slot, and its tokens.
        self.win_start = [0] * batch
        self.win_len = [0] * batch
        #: Per sequence: tokens flushed and not yet handed to a job.
        self.flushed = [0] * batch
        #: Per sequence: tokens handed to the current job, still attended from the window.
        self.in_job = [0] * batch

    def load_prompt(self, b: int, k: torch.Tensor, v: torch.Tensor) -> PromptSplit:
        """Put sequence ``b``'s first ``sink`` and last ``window`` real prompt tokens
        ``[H_kv, n, D]`` on the device."""
        n = k.shape[1]
        s = min(self.sink, n)
        w = min(self.window, n - s)
        ring = slice(self.ring_at, self.ring_at + w)
        self.dense_kv[0, b, :, :s], self.dense_kv[1, b, :, :s] = k[:, :s], v[:, :s]
        self.dense_kv[0, b, :, ring], self.dense_kv[1, b, :, ring] = k[:, n - w :], v[:, n - w :]
        self.dense_valid[b, :, :s] = True
        self.dense_valid[b, :, ring] = True
        self.sink_len[b], self.win_start[b], self.win_len[b] = s, 0, w
        return PromptSplit(sink=s, window_start=n - w)

    def refill(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Make sequence ``b``'s window exactly ``k``/``v`` ``[H_kv, w, D]`` (``w <= window``),
        from the ring's start: the tokens a bridge hands over when it ends."""
        w = k.shape[1]
        ring = slice(self.ring_at, self.ring_at + w)
        self.dense_kv[0, b, :, ring], self.dense_kv[1, b, :, ring] = k, v
        self.dense_valid[b, :, self.ring_at :] = False  # the prompt's window may have been longer
        self.dense_valid[b, :, ring] = True
        self.win_start[b], self.win_len[b] = 0, w

    def append(self, bufs: StepBuffers) -> None:
        """Count this step's token into each sequence's window (the device step writes it); a
        full window first hands its oldest page of tokens to the host (``bufs``' flush
        buffers; the tokens stay attended until their insert lands)."""
        for b in range(self.batch):
            if self.win_len[b] - self.in_job[b] == self.window:
                self._copy_flush(bufs, b, (self.win_start[b] + self.in_job[b]) % self.ring)
                self.flushed[b] = self.page_size
            self.win_len[b] += 1

    def _copy_flush(self, bufs: StepBuffers, b: int, first: int) -> None:
        """Copy the page of window tokens starting at ring slot ``first`` of sequence ``b`` to
        the host flush buffers (asynchronously on a GPU: the job that reads them starts after
        the step's flag, which the device writes later)."""
        ps, R = self.page_size, self.ring
        cut = min(ps, R - first)  # the ring may wrap inside the page
        for dst, src in ((bufs.flush_k, self.dense_kv[0]), (bufs.flush_v, self.dense_kv[1])):
            at = self.ring_at + first
            dst[b, :, :cut].copy_(src[b, :, at : at + cut], non_blocking=True)
            if cut < ps:
                dst[b, :, cut:].copy_(src[b, :, self.ring_at : self.ring_at + ps - cut], non_blocking=True)

    def hand_to_job(self) -> List[int]:
        """The tokens flushed per sequence since the last job, now handed to the next one (the
        window keeps attending them until :meth:`drop_flushed`)."""
        flushed, self.flushed = self.flushed, [0] * self.batch
        self.in_job = list(flushed)
        return flushed

    def drop_flushed(self) -> None:
        """The applied job inserted the tokens handed to it: stop attending them in the window."""
        R = self.ring
        for b, m in enumerate(self.in_job):
            if not m:
                continue
            first = self.win_start[b]
            slots = [(first + i) % R + self.ring_at for i in range(m)]
            lo, hi = slots[0], slots[-1]
            if hi >= lo:
                self.dense_valid[b, :, lo : hi + 1] = False
            else:
                self.dense_valid[b, :, lo : self.ring_at + R] = False
                self.dense_valid[b, :, self.ring_at : hi + 1] = False
            self.win_start[b] = (first + m) % R
            self.win_len[b] -= m
            self.in_job[b] = 0

    def next_slots(self) -> List[int]:
        """Each sequence's ring slot for its next window token."""
        return [(w0 + n) % self.ring for w0, n in zip(self.win_start, self.win_len)]

    def last_slots(self) -> List[int]:
        """Each sequence's ring slot of its newest window token."""
        return [(w0 + n - 1) % self.ring for w0, n in zip(self.win_start, self.win_len)]
