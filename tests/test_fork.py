"""A child of ``os.fork()`` inherits the parent's thread pools without their threads: the core
must start new ones there, or the child's parallel calls never return (``multiprocessing``'s
``fork`` start method, pre-fork servers). Each case runs in a fresh interpreter that forks
after using the pools; a child that does not finish in time is killed and the test fails."""

from __future__ import annotations

import pytest
from isolated import isolated

_FORK = """
import os, signal, time
rng = np.random.default_rng(0)
x = rng.random((4000, 16), dtype=np.float32)
keys = rng.random((2, 3000, 16), dtype=np.float32)
q = rng.random((2, 16), dtype=np.float32)

def work(threads):
    a = DCIIndex(16, threads=threads, seed=0)
    a.add(x)
    ids, _ = a.query(x[:64], 5)
    f = HeadForest(keys, page_size=8, threads=threads, seed=0)
    ks = np.zeros((2, f.max_pages(), 8, 16), np.float32)
    f.write_pages(keys, keys, ks, ks.copy())
    pages, counts = f.select(q, 4)
    return ids, pages

def run(threads, inherited):
    before = work(threads)  # the parent uses its pools first
    pid = os.fork()
    if pid == 0:
        try:
            got = work(threads) if inherited is None else (inherited.query(x[:64], 5)[0], before[1])
            same = all(np.array_equal(a, b) for a, b in zip(got, before))
            os.write(1, f"child {'same' if same else 'DIFFERENT'}\\n".encode())
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("child HANG")
"""


@pytest.mark.parametrize("threads", [1, 2, None])
def test_a_forked_child_builds_queries_and_selects(threads):
    out = isolated(_FORK + f"run({threads!r}, None)\n", timeout=240)
    assert out == ["child same"], out


def test_a_forked_child_can_use_an_index_made_before_the_fork():
    code = _FORK + "a = DCIIndex(16, threads=2, seed=0)\na.add(x)\nrun(2, a)\n"
    out = isolated(code, timeout=240)
    assert out == ["child same"], out
