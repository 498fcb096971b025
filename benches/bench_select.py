#!/usr/bin/env python
"""Selection throughput at batch size: how long one layer step's selections take when the
look-ahead worker selects for every sequence of a batch at once.

``--batch`` forests (``HeadForest``, one per sequence, ``--heads`` KV heads of ``--tokens``
keys of ``--dim``) are built from Gaussian keys around a few shared centres; each round runs
``HeadForest.select`` for all of them concurrently (one Python thread per sequence; each call
releases the GIL and runs on the core's thread pool, as the worker's job runs its lanes), with
``--group`` query heads per KV head and a new random query per round (random weights: no query
resembles the last, the worst case for reuse). Variants (``--variants``: ``own``, ``group``,
``own-e0.5``, ``group-e0.5``, ...: own or shared field of view per GQA group, and the effort)
are interleaved round by round. Reported: the median wall time of a layer step (all sequences)
and the core time it implies per (sequence, layer) selection. ``--page-format int8`` builds
forests for 8-bit page stores, which they read their keys from (``select(k_store=...)``), as
the runtime's do with ``page_format="int8"``; by default each forest keeps its keys' int8 rows.

    python benches/bench_select.py [--batch 8] [--tokens 32768] [--heads 8] [--group 4]
        [--dim 128] [--pages 52] [--rounds 20] [--variants own group own-e0.5 group-e0.5]
        [--page-format native|int8]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def parse_variant(name: str) -> dict:
    """``own`` or ``group``, optionally ``-eX`` (effort X): ``HeadForest.select`` options."""
    view, _, effort = name.partition("-e")
    if view not in ("own", "group") or (effort and not effort.replace(".", "", 1).isdigit()):
        raise SystemExit(f"--variants: {name!r} is not own|group[-eX]")
    return {"group_view": view == "group", "effort": float(effort) if effort else 1.0}


def select_one(forest_store, queries, pages, **options):
    forest, k_store = forest_store
    if k_store is not None:
        options["k_store"] = k_store
    return forest.select(queries, pages, **options)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=52, help="pages selected per KV head (the superset)")
    ap.add_argument("--successors", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=["own", "group", "own-e0.5", "group-e0.5"])
    ap.add_argument("--page-format", choices=["native", "int8"], default="native")
    args = ap.parse_args(argv)
    variants = {v: parse_variant(v) for v in args.variants}

    import icecache

    rng = np.random.default_rng(0)
    h, n, d, g = args.heads, args.tokens, args.dim, args.group
    forests = []
    t = time.perf_counter()
    for b in range(args.batch):
        centres = rng.standard_normal((h, 16, d)).astype(np.float32)
        keys = centres[:, rng.integers(0, 16, n)] + rng.standard_normal((h, n, d), dtype=np.float32) + 1.0
        keys = keys.astype(np.float32)
        if args.page_format == "native":
            forests.append((icecache.HeadForest(keys, page_size=16, seed=b), None))
            continue
        forest = icecache.HeadForest(keys, page_size=16, seed=b, page_format="int8")
        k_store = np.zeros((h, forest.max_pages(), 16 * (d + 4)), np.uint8)
        forest.write_pages(keys, keys, k_store, np.zeros_like(k_store))
        forests.append((forest, k_store))
    print(f"built {args.batch} forests of {h} x {n} keys in {time.perf_counter() - t:.1f} s", flush=True)

    times: dict = {v: [] for v in variants}
    with ThreadPoolExecutor(args.batch) as pool:
        for r in range(args.rounds + 1):  # the first round warms up
            queries = [rng.standard_normal((h * g, d), dtype=np.float32) for _ in range(args.batch)]
            for name, opts in variants.items():
                select = functools.partial(select_one, pages=args.pages, successors=args.successors, **opts)
                t = time.perf_counter()
                list(pool.map(select, forests, queries))
                if r:
                    times[name].append(time.perf_counter() - t)
    cores = os.cpu_count() or 1
    print(
        f"batch {args.batch}, {h} KV heads x {g} query heads, {n} keys of {d}, {args.pages} pages, "
        f"successors {args.successors}, {cores} cores, {args.rounds} rounds (median), {args.page_format} pages"
    )
    print("| variant | ms per layer step | core-ms per (sequence, layer) | x own |")
    print("|---|---|---|---|")
    base = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m * 1e3:.2f} | {m * 1e3 * cores / args.batch:.2f} | {m / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
