#!/usr/bin/env python
"""What an index build costs the threads beside it: a forest built on a normal pool against one
built in the background (``HeadForest(background=True)``, threads of lower priority, as the
runtime builds its indexes).

First table: the main thread runs a fixed unit of work (``--unit`` products of two 256 x 256
float32 matrices, one thread) over and over while another thread builds a forest of ``--heads``
x ``--tokens`` Gaussian keys of ``--dim`` on ``--threads`` threads (every core by default) and
writes its 8-bit pages, as the runtime's index worker does while decode steps run. Reported per
round and mode (interleaved): the unit alone, the unit's mean and 90th percentile during the
build, and the build's time. The main thread stands for a decode step's host work (launches,
waits, the look-ahead worker's jobs); where it slows down, so does the step.

Second table: a decode step's own index work beside a background build. The main thread
inserts ``--insert`` tokens per head into another forest (as the step that leaves the bridge
hands its window's tokens to the index while the worker still builds later layers' indexes),
every ``--gap`` ms while the build runs. Reported per round and pool (interleaved): the insert
alone, and its median, 90th percentile and maximum during the build. ``background=True`` hands
the insert to the background pool that the build occupies; ``background=False`` (what the
runtime's decode steps pass) to the normal pool of the same size.

    python benches/bench_background.py [--rounds 2] [--tokens 32768] [--heads 8] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any, Tuple

import numpy as np

#: The most inserts into one forest (its stores' room).
INSERTS = 64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="build threads (default: every core)")
    ap.add_argument("--unit", type=int, default=20, help="matrix products per unit of main-thread work")
    ap.add_argument("--insert", type=int, default=48, help="tokens per head of each insert (default 48)")
    ap.add_argument("--gap", type=float, default=20.0, help="ms between inserts during the build")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((args.heads, args.tokens, args.dim)).astype(np.float32)
    units(args, keys, rng)
    inserts(args, keys, rng)
    return 0


def _build(args, keys: np.ndarray, background: bool, seed: int, room: int = 0) -> Tuple[Any, np.ndarray, np.ndarray]:
    """A forest of ``keys`` with its 8-bit pages written (the index worker's job for a layer),
    and its stores, with room for ``room`` more pages."""
    import icecache

    forest = icecache.HeadForest(keys, threads=args.threads, seed=seed, page_format="int8", background=background)
    k_store = np.zeros((args.heads, forest.max_pages() + room, forest.page_size * (args.dim + 4)), np.uint8)
    v_store = np.zeros_like(k_store)
    forest.write_pages(keys, keys, k_store, v_store)
    return forest, k_store, v_store


def _beside_build(
    args, keys: np.ndarray, background: bool, work, gap_s: float = 0.0, limit: int = 1 << 30
) -> Tuple[list, float]:
    """Run ``work()`` on this thread, ``gap_s`` apart (at most ``limit`` times), while another
    thread builds a forest on the pool ``background`` names; the times ``work`` took, and the
    build's."""
    done = threading.Event()

    def build() -> None:
        _build(args, keys, background, seed=2)
        done.set()

    worker = threading.Thread(target=build)
    t = time.perf_counter()
    worker.start()
    during = []
    while not done.is_set() and len(during) < limit:
        during.append(work())
        if gap_s:
            time.sleep(gap_s)
    worker.join()
    return during, time.perf_counter() - t


def units(args, keys: np.ndarray, rng: np.random.Generator) -> None:
    """The first table (see the module docs)."""
    a = rng.standard_normal((256, 256)).astype(np.float32)

    def unit() -> float:
        t = time.perf_counter()
        for _ in range(args.unit):
            a @ a
        return time.perf_counter() - t

    print("| round | build threads | unit alone ms | unit during the build: mean ms | p90 ms | units | build s |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for background in (False, True):
            alone = statistics.median(unit() for _ in range(30))
            during, built = _beside_build(args, keys, background, unit)
            p90 = float(np.percentile(during, 90))
            mode = "background" if background else "normal"
            print(
                f"| {r} | {mode} | {alone * 1e3:.2f} | {statistics.fmean(during) * 1e3:.2f} | {p90 * 1e3:.2f} "
                f"| {len(during)} | {built:.2f} |",
                flush=True,
            )


def inserts(args, keys: np.ndarray, rng: np.random.Generator) -> None:
    """The second table (see the module docs)."""
    new = rng.standard_normal((args.heads, args.insert, args.dim)).astype(np.float32)
    print(f"\n{args.insert} tokens x {args.heads} heads per insert, every {args.gap:g} ms during a background build\n")
    print("| round | insert's pool | alone ms | during the build: median ms | p90 ms | max ms | inserts | build s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for background in (True, False):
            # The forest a decode step inserts into, built as the runtime builds its indexes;
            # room for a page per inserted token of every insert.
            forest, k_store, v_store = _build(args, keys, True, seed=1, room=INSERTS * args.insert)

            def insert(background=background, forest=forest, stores=(k_store, v_store)) -> float:
                t = time.perf_counter()
                forest.insert(new, new, *stores, background=background)
                return time.perf_counter() - t

            alone = statistics.median(insert() for _ in range(5))
            during, built = _beside_build(args, keys, True, insert, args.gap / 1e3, limit=INSERTS - 5)
            pool = "background (the build's)" if background else "normal"
            print(
                f"| {r} | {pool} | {alone * 1e3:.2f} | {statistics.median(during) * 1e3:.2f} "
                f"| {float(np.percentile(during, 90)) * 1e3:.2f} | {max(during) * 1e3:.1f} | {len(during)} "
                f"| {built:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    raise SystemExit(main())
