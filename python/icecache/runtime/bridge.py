"""The bridge (``IceCacheConfig.exact_until_indexed``): decode steps attend a layer's whole
cache on the device until its index is ready; each reuse group leaves it once its own index
jobs are done, while the layers after it may still be indexed.

Per layer, a :class:`Bridge` holds the prompt's keys and values with the tokens decoded since
(on the device, or, for a prompt that came in chunks, mostly on the host, streamed back to the
device layer by layer at each step, as the chunks' attention read it) and moves the tokens that
left the window into the index: by catch-up jobs on the index
worker while the bridge goes on, and the rest itself when it ends. :class:`Bridges`, one per
cache, decides once per step, at its first IceCache layer, which layers that step bridges, so
that a reuse group's layers leave at the same step (docs/ARCHITECTURE.md, section Runtime).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from icecache.runtime.prefix import HostPrefix
from icecache.runtime.transfer import Transit
from icecache.runtime.window import DeviceWindow

__all__ = ["CATCH_UP_ON_THE_STEP", "Bridge", "Bridges"]

#: The step that leaves the bridge moves at most this many tokens per sequence into the index
#: itself (a page) when the index worker is free; a larger backlog goes to the worker first,
#: while the bridge goes on, because moving it on the step stalls that step (benches/RESULTS.md,
#: section "Decode from the whole cache until the index is ready"). While the worker still
#: indexes later layers, the step moves any backlog itself (:meth:`Bridges.decide`).
CATCH_UP_ON_THE_STEP = 16


class Bridge:
    """A layer's whole cache while the indexes are built: the prompt's keys and values with the
    tokens decoded since, ``[B, H_kv, T + t, D]``, attended as a full cache does.

    Args:
        k, v: the prompt's keys and values on the device from position ``T - k.shape[-2]`` on
            (all of them when ``host`` is ``None``); decode steps append to them.
        valid: ``[B, T]`` real (non-padding) prompt positions, or ``None`` for all.
        unindexed: per sequence, the first real token the index does not hold (the prompt's
            window; catch-up jobs move it on). Its position must be on the device.
        padding: per sequence, the prompt's padding positions.
        window: the layer's device window, which takes the last tokens when the bridge ends.
        catch_up: puts sequence ``b``'s tokens ``[H_kv, c, D]`` (CPU) into its index, in
            position order after those indexed before (``LayerJobs.catch_up``, with its
            ``background`` keyword).
        submit: runs a function on the runtime's index worker.
        transit: the runtime's host buffer for device-to-host copies on that worker.
        host: the whole prompt in host memory (a chunked prefill's :class:`HostPrefix`), whose
            positions before ``k``'s each step reads back to the device (:meth:`attended`), so
            that the device holds the prompt of one layer at a time; ``None``: ``k`` and ``v``
            hold the whole prompt.
        first_job: starts the layer's first job after the bridge, once its reuse group has
            handed its tokens over (``IceLayer.start_ahead``).
    """

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: Optional[torch.Tensor],
        unindexed: List[int],
        padding: List[int],
        *,
        window: DeviceWindow,
        catch_up: Callable[..., None],
        submit: Callable[..., None],
        transit: Transit,
        host: Optional[HostPrefix] = None,
        first_job: Optional[Callable[[], None]] = None,
    ):
        self.k, self.v, self.valid, self.host = k, v, valid, host
        self.first_job = first_job
        #: The first position that ``k`` and ``v`` hold.
        self.start = 0 if host is None else host.length - k.shape[-2]
        #: Positions of the prompt (padding included): the decoded tokens come after.
        self.prompt_length = self.length
        self.unindexed, self.padding = unindexed, padding
        self._window, self._catch_up, self._submit, self._transit = window, catch_up, submit, transit

    @property
    def length(self) -> int:
        """Positions so far, padding included."""
        return self.start + self.k.shape[-2]

    def real(self, b: int) -> int:
        """Sequence ``b``'s real tokens so far."""
        return self.length - self.padding[b]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = torch.cat([self.k, k], dim=-2)
        self.v = torch.cat([self.v, v], dim=-2)

    def attended(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The whole cache on the device, keys and values ``[B, H_kv, T + t, D]``: with a host
        prompt, a buffer of this step (the prompt read back, then the device part)."""
        host = self.host
        if host is None:
            return self.k, self.v
        buf = host.to_device(self.length - host.length)
        # From start on, the device part: the prompt's last positions again (the same values),
        # then the decoded tokens.
        buf[0, :, :, self.start :], buf[1, :, :, self.start :] = self.k, self.v
        return buf[0], buf[1]

    def prefetch(self, stream: "torch.cuda.Stream") -> None:
        """Start reading the host prompt back for this layer's next :meth:`attended`, one token
        longer than now, on ``stream`` (the layer before calls it)."""
        if self.host is not None:
            self.host.prefetch(self.length + 1 - self.host.length, stream)

    def nbytes(self) -> dict:
        """Bytes held on the device (the device part) and in host memory (the host prompt)."""
        device = 2 * self.k.numel() * self.k.element_size()
        return {"device": device, "host": 0 if self.host is None else self.host.nbytes()}

    def since(self, b: int, first: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s real tokens from its ``first`` one on, ``[H_kv, n, D]`` on the device,
        keys and values."""
        kb, vb = self.k[b], self.v[b]
        if self.valid is None or bool(self.valid[b].all()):
            at = first - self.start  # real tokens are positions
            if at < 0:
                raise RuntimeError(f"bridge: token {first} of sequence {b} is not on the device")
            return kb[:, at:], vb[:, at:]
        T = self.valid.shape[1]
        real = torch.cat([self.valid[b].nonzero()[:, 0], torch.arange(T, self.length, device=self.valid.device)])
        idx = real[first:] - self.start
        if idx.numel() and int(idx[0]) < 0:
            raise RuntimeError(f"bridge: token {first} of sequence {b} is not on the device")
        idx = idx.to(kb.device)
        return kb[:, idx], vb[:, idx]

    def backlog(self) -> int:
        """The most tokens of any sequence that leaving the bridge would move into the index now."""
        window = self._window.window
        return max(max(0, self.real(b) - self.unindexed[b] - window) for b in range(len(self.padding)))

    def submit_catch_up(self) -> None:
        """Hand each sequence's tokens that left the window to the index worker (its copy on the
        side stream, then inserts), while the bridge goes on; the tensors at this step are a
        snapshot: later steps make new ones."""
        window = self._window.window
        parts = []
        for b in range(len(self.padding)):
            first = self.unindexed[b]
            c = self.real(b) - first - window
            if c > 0:
                kb, vb = self.since(b, first)
                parts.append((b, kb[:, :c], vb[:, :c]))
        if parts:
            ready = None
            if self.k.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self._submit(self._catch_up_job, parts, ready)

    def _catch_up_job(self, parts: list, ready: Optional[torch.cuda.Event]) -> None:
        """Index worker: copy the tokens to the host and put them into the index."""
        for b, k, v in parts:
            k_host, v_host = self._transit.to_host(ready, k, v)
            self._catch_up(b, k_host, v_host)
            self.unindexed[b] += k.shape[1]

    def hand_over(self) -> None:
        """Each sequence's window takes the tokens that a layer which never bridged would hold
        now, its last ones, and the index the ones before (inserted; a sequence whose prompt
        had no middle gets its index built from them). Nothing is resident on the device yet
        (the layer's first job comes next), so no page goes stale.

        A window fills for ``page_size`` steps and then moves its oldest page to the index, so
        what it holds depends on the steps decoded since the prompt. Taking that length here
        keeps the windows of the groups that left at different steps in step with each other:
        each step attends as many pages in every layer, and a step graph, captured per pages
        attended, keeps one graph per window phase instead of one per mix of phases."""
        window, page = self._window.window, self._window.page_size
        # The prompt left a full window; each page_size steps after, it flushed a page.
        keep = window - (page - (self.length - self.prompt_length) % page) % page
        for b in range(len(self.padding)):
            # The prompt's window, then the bridge's tokens.
            k_rest, v_rest = self.since(b, self.unindexed[b])
            w = min(keep, k_rest.shape[1])
            c = k_rest.shape[1] - w
            if c:
                # On the normal pool: this step waits for it, and the worker may still be
                # building later layers' indexes on the background pool.
                k_c, v_c = k_rest[:, :c].contiguous().cpu(), v_rest[:, :c].contiguous().cpu()
                self._catch_up(b, k_c, v_c, background=False)
            self._window.refill(b, k_rest[:, c:], v_rest[:, c:])


class Bridges:
    """The bridges of one cache's layers, in layer order (a reuse group's leader first), and
    the policy of when they end."""

    def __init__(self) -> None:
        # Each bridged layer's reuse group (its leader's layer index) and bridge.
        self._of_layer: Dict[int, Tuple[int, Bridge]] = {}
        # The decode position the last decision was taken at, and the groups it let leave.
        self._decided_at = -1
        self._leaving: List[int] = []

    def add(self, layer_idx: int, bridge: Bridge, group: int) -> None:
        """Layer ``layer_idx``'s bridge, for reuse group ``group`` (its leader's layer index)."""
        self._of_layer[layer_idx] = (group, bridge)

    @property
    def active(self) -> bool:
        """Whether any layer still attends its whole cache."""
        return bool(self._of_layer)

    def of_layer(self, layer_idx: int) -> Optional[Bridge]:
        """Layer ``layer_idx``'s bridge while it lasts."""
        entry = self._of_layer.get(layer_idx)
        return None if entry is None else entry[1]

    def _groups(self) -> Dict[int, List[Bridge]]:
        """The bridges of each reuse group, groups and layers in layer order."""
        groups: Dict[int, List[Bridge]] = {}
        for group, bridge in self._of_layer.values():
            groups.setdefault(group, []).append(bridge)
        return groups

    def decide(self, position: int, pending: Sequence[Tuple[Optional[int], Future]]) -> List[int]:
        """Decide, for the decode step at ``position``, which reuse groups leave their bridges;
        returns them (the caller has them :meth:`leave`). A group bridges on while any of its
        jobs (``pending``: the index worker's unfinished jobs with their groups) runs. Once
        they are done it leaves, moving the tokens decoded meanwhile into its index on the
        step; except where more than :data:`CATCH_UP_ON_THE_STEP` of them per sequence wait
        and the worker has nothing else to do: then they go to the worker first (this call
        submits them) and the group bridges on. While the worker still indexes later layers,
        a catch-up job would queue behind them, so the group moves its backlog itself.
        Decided once per step, at its first IceCache layer: a reuse group's layers leave at
        the same step (a leader's first insert must not race the worker still writing the
        pages of the layers that follow its layout). Asked again at the same position, the
        groups of that decision that have not left yet (a failed job raised as they left)."""
        if position == self._decided_at:
            bridged = {group for group, _ in self._of_layer.values()}
            return [g for g in self._leaving if g in bridged]
        self._decided_at = position
        busy = any(not f.done() for _, f in pending)
        leaving = []
        for group, bridges in self._groups().items():
            jobs = [f for g, f in pending if g == group]
            if not all(f.done() for f in jobs):
                continue
            # A failed job: leave, and the step raises its error.
            failed = any(f.exception() is not None for f in jobs)
            if failed or busy or bridges[0].backlog() <= CATCH_UP_ON_THE_STEP:
                leaving.append(group)
            else:
                for bridge in bridges:  # in layer order: the group's leader first
                    bridge.submit_catch_up()
        self._leaving = leaving
        return leaving

    def leave(self, group: int) -> None:
        """The bridges of reuse group ``group`` hand their tokens over, all at once before any
        of its layers' first job: a leader's first job inserts the page its window flushes,
        which the layers that follow its layout must not see before their own catch-up. Then
        the layers' first jobs start, in layer order (a follower's waits for its leader's), so
        that they run on the worker while the device computes the layers before them instead
        of in each layer's step. Frees the bridges' device copies."""
        bridges = [self._of_layer.pop(i)[1] for i, (g, _) in list(self._of_layer.items()) if g == group]
        for bridge in bridges:
            bridge.hand_over()
        for bridge in bridges:
            if bridge.first_job is not None:
                bridge.first_job()

    def forget(self) -> None:
        """No bridges and no decision (a new prompt)."""
        self._of_layer, self._decided_at, self._leaving = {}, -1, []
