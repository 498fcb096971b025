"""CUDA graph capture and release that the rest of the process cannot break.

A stream capture is invalidated by any CUDA call that capture forbids, and torch then aborts
the whole process from a destructor (``cudaErrorStreamCaptureInvalidated``), with no Python
exception. Two sources of such calls lie outside the code being captured:

- **Destroying another graph.** Python's cyclic garbage collector runs at arbitrary
  allocations, the capture's own included. When it collects a dropped IceCache during a
  capture, that cache's graphs are destroyed (``cudaGraphDestroy``, ``cudaGraphExecDestroy``:
  "operation not permitted when stream is capturing (function reset)"). Hence a graph is never
  destroyed with its owner: an owner's graphs are *retired* when it is collected
  (:func:`retire_with`) and destroyed at a safe point (:func:`release_retired`, before each
  capture and when a cache is made). The collector is also paused during a capture.
- **Other threads.** The prefill index worker copies device tensors to the host and records
  events while decode steps capture. In torch's default ``"global"`` error mode, those calls
  invalidate the capture; in ``"thread_local"`` mode only the capturing thread's calls are
  checked, which is correct here because no other thread uses the capturing stream (the
  worker has its own stream and waits only on events recorded before the capture).

A third hazard lies in what a graph keeps using after its capture: **cuBLAS's workspace**.
torch keeps one per (handle, stream), allocated at that stream's first matmul from the ordinary
memory pool, and a graph captured there replays into it. ``torch.compile``'s CUDA graphs free
every workspace before and after their own captures (so that theirs land in their private
pools): a workspace freed under a graph of ours would be handed to other tensors, or released
to the driver by ``empty_cache``, while our replays still write into it (an illegal memory
access, or silent corruption). So :func:`guarded` frees the workspaces the same way before and
after each capture: the capture allocates its workspace in the graph's own pool, which lives as
long as the graph; eager work afterwards allocates a new one outside it.

Captures run one at a time in the process (torch allows one at a time), under one lock that
:func:`release_retired` takes too.
"""

from __future__ import annotations

import gc
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch

__all__ = ["capture", "guarded", "release_retired", "retire", "retire_with"]

_lock = threading.RLock()
_retired: List[Any] = []


def retire_with(owner: object, graphs: Dict[Any, Any]) -> None:
    """When ``owner`` is collected, keep ``graphs`` (its CUDA graphs and their outputs) alive
    until the next :func:`release_retired` instead of destroying them then (which may be in the
    middle of another capture)."""
    weakref.finalize(owner, _retired.append, graphs)


def retire(graphs: Dict[Any, Any]) -> None:
    """Empty ``graphs`` now and destroy its graphs at the next :func:`release_retired`."""
    _retired.append(dict(graphs))
    graphs.clear()


def release_retired() -> None:
    """Destroys the graphs of collected owners (a safe point: waits for any capture to end)."""
    with _lock:
        while _retired:
            _retired.pop()


def _free_blas_workspaces() -> None:
    """Free cuBLAS's workspaces once the device is idle (see the module doc)."""
    free = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if free is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        free()


@contextmanager
def guarded() -> Iterator[None]:
    """The process's one capture at a time, with the retired graphs destroyed first, the
    garbage collector paused and cuBLAS's workspaces freed before and after (see the module
    doc); for captures made by hand (``CUDAGraph.capture_begin``, in ``"thread_local"`` error
    mode)."""
    with _lock:
        release_retired()
        collecting = gc.isenabled()
        gc.disable()
        _free_blas_workspaces()
        try:
            yield
        finally:
            _free_blas_workspaces()
            if collecting:
                gc.enable()


@contextmanager
def capture(graph: "torch.cuda.CUDAGraph", pool: Optional[Any] = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` under :func:`guarded`, capture errors confined
    to this thread (see the module doc). A failed capture raises ``RuntimeError``."""
    with guarded():
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
