"""Sharing one index, forest or residency table between threads: queries run in parallel,
writers are serialised by a lock in the core, and what a call validates is what it indexes.
Each test runs its threads for a bounded time (a second or two)."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
from icecache import DCIIndex, HeadForest, ResidentPages

# --------------------------------------------------------------------------------------------


def run_for(seconds, workers):
    """Runs each worker (a function of a stop Event) in its own thread; returns their errors."""
    stop = threading.Event()
    errors = []

    def wrap(w):
        try:
            w(stop)
        except Exception as e:  # every error fails the test
            errors.append(repr(e))

    threads = [threading.Thread(target=wrap, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    return errors


def test_dci_index_writers_and_readers_share_an_index_without_errors():
    rng = np.random.default_rng(3)
    dim = 16
    base = rng.standard_normal((3000, dim), dtype=np.float32)
    extra = rng.standard_normal((4000, dim), dtype=np.float32)
    idx = DCIIndex(dim, seed=0)
    idx.add(base)
    queries = rng.standard_normal((8, dim), dtype=np.float32)
    added = []

    def writer(stop):
        i = 0
        while not stop.is_set() and i < len(extra) // 20:
            ids = idx.add(extra[i * 20 : (i + 1) * 20])
            idx.remove(ids[::2])
            added.append(ids[1::2])
            i += 1

    def reader(stop):
        while not stop.is_set():
            ids, scores = idx.query(queries, 10)
            assert (np.diff(scores, axis=1) <= 0).all()
            idx.query(queries[:1], 5, exact=True)
            len(idx)
            idx.stats()

    assert run_for(1.5, [writer, reader, reader, reader]) == []
    live = np.concatenate([np.arange(3000)] + added)
    keys = np.concatenate([base] + [extra[(ids - 3000)] for ids in added]) if added else base
    assert len(idx) == len(live)
    got_ids, got_scores = idx.query(queries, 10, exact=True)
    ref = np.sort(queries.astype(np.float64) @ keys.T.astype(np.float64), axis=1)[:, ::-1][:, :10]
    np.testing.assert_allclose(got_scores, ref, rtol=1e-4, atol=1e-4)


def test_head_forest_select_and_insert_from_threads_without_errors():
    keys = np.random.default_rng(0).random((2, 400, 16), dtype=np.float32)
    f = HeadForest(keys, page_size=8, seed=0)
    cap = f.max_pages() + 400
    ks = np.zeros((2, cap, 8, 16), np.float32)
    vs = np.zeros_like(ks)
    f.write_pages(keys, keys, ks, vs)
    rng = np.random.default_rng(5)
    new = rng.random((2, 200, 16), dtype=np.float32)

    def writer(stop):
        for i in range(200):
            if stop.is_set():
                break
            f.insert(new[:, i : i + 1], new[:, i : i + 1], ks, vs)

    def reader(stop):
        q = rng.random((4, 16), dtype=np.float32)
        while not stop.is_set():
            pages, counts = f.select(q, 6)
            assert (counts >= 1).all() and (pages[:, 0] < f.max_pages()).all()

    assert run_for(1.0, [writer, reader, reader]) == []


def test_resident_pages_plans_from_threads_without_errors():
    r = ResidentPages(2, 8)

    def planner(stop):
        rng = np.random.default_rng(threading.get_ident() % 2**32)
        while not stop.is_set():
            pages = np.stack([rng.choice(40, 6, replace=False) for _ in range(2)])
            heads, pages_out, slots, table = r.plan(pages, np.array([6, 6]))
            assert ((table[:, :6] >= 0) & (table[:, :6] < 8)).all()

    assert run_for(0.5, [planner, planner]) == []


def test_add_validates_what_it_indexes_while_another_thread_writes_the_input():
    """A thread flashes NaN into the key array while ``add`` runs: the call either raises
    ValueError or indexes finite keys (validation and indexing read the same copy)."""
    rng = np.random.default_rng(9)
    keys = rng.standard_normal((200_000, 8), dtype=np.float32)
    q = np.ones((1, 8), np.float32)
    state = {"bad": 0, "rejected": 0, "runs": 0}

    def flasher(stop):
        r = np.random.default_rng(1)
        while not stop.is_set():
            i = int(r.integers(0, len(keys)))
            keys[i, 0] = np.nan
            keys[i, 0] = 1.0

    def adder(stop):
        while not stop.is_set():
            idx = DCIIndex(8, seed=0)
            try:
                idx.add(keys)
            except ValueError:
                state["rejected"] += 1
                continue
            state["runs"] += 1
            _, scores = idx.query(q, 1, exact=True)
            state["bad"] += int(not np.isfinite(scores).all())

    assert run_for(2.0, [flasher, adder]) == []
    assert state["runs"] + state["rejected"] >= 1
    assert state["bad"] == 0, state


def _pool_threads(prefix):
    """(thread id, nice value) of this process's threads whose name starts with ``prefix``."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith(prefix):
                found.append((int(tid), os.getpriority(os.PRIO_PROCESS, int(tid))))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_background_forests_work_on_threads_of_lower_priority_and_the_same_results():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 3000, 16)).astype(np.float32)
    queries = rng.standard_normal((4, 16)).astype(np.float32)
    normal = HeadForest(keys, threads=3, seed=1)
    background = HeadForest(keys, threads=3, seed=1, background=True)
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's nice value; pools start with it
    want = min(own + 10, 19)
    deadline = time.monotonic() + 5  # each pool thread lowers itself as it starts
    while True:
        lowered = _pool_threads("icecache-bg-3-")
        if (len(lowered) == 3 and all(nice == want for _, nice in lowered)) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(lowered) == 3 and all(nice == want for _, nice in lowered), (own, lowered)
    assert all(nice == own for _, nice in _pool_threads("icecache-3-")), "the normal pool is unchanged"
    for a, b in zip(normal.select(queries, 8), background.select(queries, 8)):
        assert np.array_equal(a, b)


def test_the_runtime_builds_its_indexes_in_the_background():
    from icecache.runtime import IceCacheConfig

    assert IceCacheConfig().index_kwargs()["background"] is True


def _cpu_seconds(prefix):
    """CPU time so far of this process's threads whose name starts with ``prefix``."""
    ticks = 0
    for tid, _ in _pool_threads(prefix):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _insert_beside_a_build(background):
    """Whether an insert into a background forest, on the pool ``background`` names, returns
    while another background forest of that pool size is being built."""
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2, 2000, 32)).astype(np.float32)
    forest = HeadForest(keys, threads=1, seed=1, page_format="int8", background=True)
    k_store = np.zeros((2, forest.max_pages() + 64, 16 * (32 + 4)), np.uint8)
    v_store = np.zeros_like(k_store)
    forest.write_pages(keys, keys, k_store, v_store)
    big = rng.standard_normal((8, 32768, 64)).astype(np.float32)  # a build of a second or so on one thread
    started, done = threading.Event(), threading.Event()

    def build():
        started.set()
        HeadForest(big, threads=1, seed=2, background=True)
        done.set()

    before = _cpu_seconds("icecache-bg-1-")
    worker = threading.Thread(target=build)
    worker.start()
    started.wait()
    # Until the build holds the pool's one thread: it has run there for a while.
    deadline = time.monotonic() + 30
    while _cpu_seconds("icecache-bg-1-") < before + 0.05 and not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not done.is_set(), "the build ended before the insert could start: make it larger"
    new = rng.standard_normal((2, 16, 32)).astype(np.float32)
    forest.insert(new, new, k_store, v_store, background=background)
    during = not done.is_set()
    worker.join()
    return during


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the pool threads' CPU time from /proc")
def test_an_insert_on_the_normal_pool_does_not_wait_for_a_background_build():
    # A decode step's inserts pass background=False: on the background pool they would wait
    # for the threads to finish the index worker's build (the second call shows that they do).
    assert _insert_beside_a_build(background=False)
    assert not _insert_beside_a_build(background=True)


def test_the_pool_an_insert_runs_on_changes_nothing_it_writes():
    rng = np.random.default_rng(4)
    keys = rng.standard_normal((3, 1500, 16)).astype(np.float32)
    new = rng.standard_normal((3, 40, 16)).astype(np.float32)
    out = []
    for background in (None, False, True):
        forest = HeadForest(keys, threads=2, seed=5, page_format="int8", background=True)
        k_store = np.zeros((3, forest.max_pages() + 40, 16 * (16 + 4)), np.uint8)
        v_store = np.zeros_like(k_store)
        forest.write_pages(keys, keys, k_store, v_store, background=background)
        changed = forest.insert(new, new, k_store, v_store, background=background)
        out.append((changed, k_store, v_store, [forest.token_map(h) for h in range(3)]))
    for changed, k_store, v_store, maps in out[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(changed, out[0][0]))
        assert np.array_equal(k_store, out[0][1]) and np.array_equal(v_store, out[0][2])
        assert all(np.array_equal(x, y) for m, m0 in zip(maps, out[0][3]) for x, y in zip(m, m0))
