#!/usr/bin/env python
"""What an index build costs the threads beside it: a forest built on a normal pool against one
built in the background (``HeadForest(background=True)``, threads of lower priority, as the
runtime builds its indexes).

The main thread runs a fixed unit of work (``--unit`` products of two 256 x 256 float32
matrices, one thread) over and over while another thread builds a forest of ``--heads`` x
``--tokens`` Gaussian keys of ``--dim`` on ``--threads`` threads (every core by default) and
writes its 8-bit pages, as the runtime's index worker does while decode steps run. Reported per
round and mode (interleaved): the unit alone, the unit's mean and 90th percentile during the
build, and the build's time. The main thread stands for a decode step's host work (launches,
waits, the look-ahead worker's jobs); where it slows down, so does the step.

    python benches/bench_background.py [--rounds 2] [--tokens 32768] [--heads 8] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="build threads (default: every core)")
    ap.add_argument("--unit", type=int, default=20, help="matrix products per unit of main-thread work")
    args = ap.parse_args(argv)

    import icecache

    rng = np.random.default_rng(0)
    keys = rng.standard_normal((args.heads, args.tokens, args.dim)).astype(np.float32)
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
            done = threading.Event()

            def build(background=background, done=done):
                forest = icecache.HeadForest(
                    keys, threads=args.threads, seed=0, page_format="int8", background=background
                )
                store = np.zeros((args.heads, forest.max_pages(), forest.page_size * (args.dim + 4)), np.uint8)
                forest.write_pages(keys, keys, store, np.zeros_like(store))
                done.set()

            worker = threading.Thread(target=build)
            t = time.perf_counter()
            worker.start()
            during = []
            while not done.is_set():
                during.append(unit())
            worker.join()
            built = time.perf_counter() - t
            p90 = float(np.percentile(during, 90))
            mode = "background" if background else "normal"
            print(
                f"| {r} | {mode} | {alone * 1e3:.2f} | {statistics.fmean(during) * 1e3:.2f} | {p90 * 1e3:.2f} "
                f"| {len(during)} | {built:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
