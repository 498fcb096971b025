"""The prompt of one IceCache layer in host memory while it streams in, chunk by chunk.

A prompt may come in several forwards (chunked prefill). Each chunk's attention is exact over
every earlier token, but an IceCache layer keeps none of them on the device but the first chunk,
until a second comes: from then on each chunk's keys and values (the first's with the second)
leave for the host on the runtime's copy stream (:meth:`HostPrefix.offload`), and the next
chunk reads them back, layer by layer, into a device buffer that the layer before started
filling on the same stream (:meth:`HostPrefix.prefetch`), so that the copy overlaps that
layer's work. The index worker reads its middle tokens from here
(:meth:`HostPrefix.gather`). Once decoding starts, the first steps read it back the same way
until the indexes are ready (:class:`icecache.runtime.bridge.Bridge`); then it is dropped: the
page stores hold the prompt.

Pinning host memory is slow on some hosts (~4 ms per 32 MiB on the H200's, on the main thread,
even by registering pages, :func:`icecache.runtime.hostmem.pin_by_registering`), so the process
keeps the blocks of its last chunked prompt for
the next one, whichever cache takes it (:data:`PINNED`): the next prompt's prefill needs that
much host memory anyway.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["PINNED", "HostPrefix", "PinnedBlocks"]


class PinnedBlocks:
    """Pinned host blocks that chunked prompts share: a :class:`HostPrefix` takes its blocks
    here and they come back when it is dropped (from whichever thread drops it). The free blocks
    that the next prompt does not take are released when that prompt's decoding starts
    (:meth:`trim`), so at most the last chunked prompt's blocks are kept. Blocks
    are flat, in power-of-two sizes, so that a prompt's last, shorter chunk finds one too; they
    are pinned where a GPU is, plain host memory elsewhere."""

    def __init__(self) -> None:
        self._free: Dict[Tuple[int, torch.dtype], List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned tensor of ``shape``: a view of a free block, or of a new one."""
        numel = math.prod(shape)
        size = 1 << max(0, numel - 1).bit_length()
        with self._lock:
            free = self._free.get((size, dtype))
            block = free.pop() if free else None
        if block is None:
            block = torch.empty(size, dtype=dtype, pin_memory=torch.cuda.is_available())
        return block[:numel].view(shape)

    def give_back(self, blocks: List[torch.Tensor]) -> None:
        """Return views made by :meth:`take` (their whole blocks become free)."""
        with self._lock:
            for view in blocks:
                block = view._base if view._base is not None else view
                self._free.setdefault((block.numel(), block.dtype), []).append(block)

    def trim(self) -> None:
        """Release every free block."""
        with self._lock:
            self._free = {}

    def nbytes(self) -> int:
        """Bytes of the free blocks."""
        with self._lock:
            return sum(b.numel() * b.element_size() for blocks in self._free.values() for b in blocks)


#: The process's pinned blocks for chunked prompts (every IceCache's). ``PINNED.nbytes()`` is
#: what it keeps now; ``PINNED.trim()`` releases it.
PINNED = PinnedBlocks()


class HostPrefix:
    """The prompt's keys and values so far, ``[B, H_kv, T, D]``, as host blocks in position order
    (pinned on a GPU, so that the copies are asynchronous), one block per chunk.

    Args:
        device: the layer's device.
        pinned: where its pinned blocks come from and go back to when it is dropped.
    """

    def __init__(self, device: torch.device, pinned: PinnedBlocks = PINNED):
        self.device = device
        self._blocks: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._pinned = pinned
        # The pinned tensors taken, given back when this object is dropped: the index job and
        # the bridge that read it hold it until they end. A copy from a block still in flight
        # then is ordered before the next prompt's copy into it, which runs on the same copy
        # stream behind the current stream's work.
        self._taken: List[torch.Tensor] = []
        weakref.finalize(self, pinned.give_back, self._taken)
        #: The event behind the last block's copy (``None`` on the CPU).
        self._copied: Optional[torch.cuda.Event] = None
        # A prefetched device buffer [2, B, H_kv, T + chunk, D] (tokens [0, T) being filled) and
        # the event behind its copy.
        self._ahead: Optional[Tuple[torch.Tensor, torch.cuda.Event]] = None

    @property
    def length(self) -> int:
        """Positions held."""
        return sum(k.shape[2] for k, _ in self._blocks)

    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(2 * k.numel() * k.element_size() for k, _ in self._blocks)

    def offload(self, k: torch.Tensor, v: torch.Tensor, stream: Optional["torch.cuda.Stream"]) -> None:
        """Append a chunk's keys and values ``[B, H_kv, L, D]`` (on the device), copied on
        ``stream`` behind the work queued so far (``None``: the CPU, copied now)."""
        if stream is None:
            self._blocks.append((k.clone(), v.clone()))
            return
        # Pinning made ahead on a thread of its own slowed the prefill further (benches/RESULTS.md,
        # "Chunked prefill in bounded GPU memory"): blocks are pinned here, or reused.
        pin = self._pinned.take((2, *k.shape), k.dtype)
        self._taken.append(pin)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            pin[0].copy_(k, non_blocking=True)
            pin[1].copy_(v, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        k.record_stream(stream)
        v.record_stream(stream)
        self._blocks.append((pin[0], pin[1]))
        self._copied = done

    def wait_copied(self) -> None:
        """Block until every block has reached the host."""
        if self._copied is not None:
            self._copied.synchronize()

    def prefetch(self, chunk: int, stream: "torch.cuda.Stream") -> None:
        """Start copying the blocks into a new device buffer with room for a ``chunk`` more
        positions, on ``stream`` (a GPU only; :meth:`to_device` takes it)."""
        if not self._blocks or self._ahead is not None:
            return
        with torch.cuda.stream(stream):  # behind the offloads, which run on the same stream
            buf = self._filled(chunk)
            done = torch.cuda.Event()
            done.record(stream)
        self._ahead = (buf, done)

    def to_device(self, chunk: int) -> torch.Tensor:
        """A device buffer ``[2, B, H_kv, T + chunk, D]`` whose first ``T`` positions hold the
        blocks (the prefetched one, waited for on the current stream, or copied now)."""
        ahead, self._ahead = self._ahead, None
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if ahead is not None and ahead[0].shape[3] == self.length + chunk and current is not None:
            buf, done = ahead
            current.wait_event(done)
            buf.record_stream(current)
            return buf
        if current is not None and self._copied is not None:
            current.wait_event(self._copied)  # the blocks' copies to the host
        return self._filled(chunk)

    def _filled(self, chunk: int) -> torch.Tensor:
        """A new device buffer ``[2, B, H_kv, T + chunk, D]`` with the blocks copied into its
        first ``T`` positions, on the current stream."""
        k0 = self._blocks[0][0]
        B, H, _, D = k0.shape
        buf = torch.empty(2, B, H, self.length + chunk, D, dtype=k0.dtype, device=self.device)
        at = 0
        for k, v in self._blocks:
            n = k.shape[2]
            buf[0, :, :, at : at + n].copy_(k, non_blocking=True)
            buf[1, :, :, at : at + n].copy_(v, non_blocking=True)
            at += n
        return buf

    def tail(self, start: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's keys and values at positions ``[start, T)``, ``[B, H_kv, T - start,
        D]`` host tensors; the blocks must have reached the host (:meth:`wait_copied`)."""
        ks, vs, at = [], [], 0
        for k, v in self._blocks:
            n = k.shape[2]
            if at + n > start:
                ks.append(k[:, :, max(0, start - at) :])
                vs.append(v[:, :, max(0, start - at) :])
            at += n
        return torch.cat(ks, 2), torch.cat(vs, 2)

    def gather(
        self, b: int, positions: torch.Tensor, out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s keys and values at ``positions`` (sorted, CPU int64) as contiguous
        host tensors ``[H_kv, n, D]``, written into ``out`` if given (a reused buffer: fresh
        host memory is slow to fill), else into new ones; runs of positions are copied as
        slices; the blocks must have reached the host
        (:meth:`wait_copied`)."""
        blocks = list(self._blocks)  # the main thread may append meanwhile
        if out is None:
            k0 = blocks[0][0]
            k_out = k0.new_empty(k0.shape[1], positions.numel(), k0.shape[3])
            out = (k_out, torch.empty_like(k_out))
        k_out, v_out = out
        if k_out.shape[1] != positions.numel():
            raise ValueError(f"gather: {positions.numel()} positions into a buffer of {k_out.shape[1]}")
        at, done = 0, 0
        for k, v in blocks:
            n = k.shape[2]
            lo, hi = torch.searchsorted(positions, torch.tensor([at, at + n])).tolist()
            if hi > lo:
                first, last = int(positions[lo]) - at, int(positions[hi - 1]) - at
                if last - first + 1 == hi - lo:  # a run of positions: slices, no index tensor
                    k_out[:, done : done + hi - lo].copy_(k[b, :, first : last + 1])
                    v_out[:, done : done + hi - lo].copy_(v[b, :, first : last + 1])
                else:
                    idx = positions[lo:hi] - at
                    k_out[:, done : done + hi - lo].copy_(k[b].index_select(1, idx))
                    v_out[:, done : done + hi - lo].copy_(v[b].index_select(1, idx))
                done += hi - lo
            at += n
        if done != positions.numel():
            raise ValueError(f"gather: positions beyond the {at} held")
        return k_out, v_out
