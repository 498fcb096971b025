"""CUDA graph capture and release (``icecache.runtime.graphs``), checked without a GPU: a
collected owner's graphs outlive it until a safe point, and a capture pauses the garbage
collector, confines capture errors to its thread and releases the retired graphs first. The
capture itself runs on the GPU in tests/test_runtime_cuda.py."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")

from icecache.runtime import graphs  # noqa: E402


class FakeGraph:
    """Stands for a CUDA graph: records when it is destroyed."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __del__(self):
        self.log.append(self.name)


class Owner:
    """Stands for a decode step that owns graphs, in a reference cycle like a real cache."""

    def __init__(self, log: list):
        self.graphs = {1: (FakeGraph(log, "a"), None), 2: (FakeGraph(log, "b"), None)}
        self.me = self
        graphs.retire_with(self, self.graphs)


def test_a_collected_owner_s_graphs_wait_for_a_safe_point():
    graphs.release_retired()
    destroyed: list = []
    Owner(destroyed)
    gc.collect()  # collects the cycle: its graphs must survive it
    assert destroyed == []
    graphs.release_retired()
    assert sorted(destroyed) == ["a", "b"]


def test_capture_pauses_the_collector_confines_errors_and_releases_first(monkeypatch):
    destroyed: list = []
    Owner(destroyed)
    gc.collect()
    seen = {}

    @contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen.update(mode=capture_error_mode, collecting=gc.isenabled(), destroyed=list(destroyed), pool=pool)
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with graphs.capture(object(), pool="p"):
        assert not gc.isenabled()
    assert gc.isenabled()
    assert (seen["mode"], seen["collecting"], seen["pool"]) == ("thread_local", False, "p")
    assert sorted(seen["destroyed"]) == ["a", "b"]


def test_a_failed_capture_raises_and_restores_the_collector(monkeypatch):
    @contextmanager
    def failing(graph, pool=None, capture_error_mode="global"):
        yield
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "graph", failing)
    with pytest.raises(RuntimeError, match="during capture"):
        with graphs.capture(object()):
            pass
    assert gc.isenabled()
