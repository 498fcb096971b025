#!/usr/bin/env python
"""Benchmark of the page layer: forest build, page selection, bulk gather.

Measures, on this machine:

* build one layer's ``HeadForest`` at the SmolLM2 shape (3 KV heads x 8k x 64; real keys from
  ``benches/data/make_keys.py`` when present, replicated per head) and the Llama-3.1-8B shape
  (8 KV heads x 32k x 128, clustered synthetic keys), on 1 and 2 threads, reported per tree;
* page selection for one Llama-shape layer: 32 query heads, 8 KV heads, 32k keys, 12 pages of
  16 per KV head, on 2 threads; once the same call back to back (warm caches), once cycling
  over ``--layers`` such layers as a decode step does (each layer's index cold in cache);
* bulk gather of the selected pages (K and V) into a staging buffer, against a single-core
  ``memcpy`` of the same bytes (NumPy ``copyto`` of one contiguous block).

    python benches/bench_pages.py [--repeats 20] [--threads 1,2] [--layers 12] [--out benches/out]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

import icecache
import numpy as np


def clustered(heads: int, n: int, d: int, seed: int) -> np.ndarray:
    """Keys like attention keys: a shared offset plus cluster structure, per head."""
    rng = np.random.default_rng(seed)
    out = np.empty((heads, n, d), np.float32)
    for h in range(heads):
        offset = rng.normal(0, 2.0, d)
        centres = rng.normal(0, 1.5, (max(n // 100, 8), d))
        which = rng.integers(0, len(centres), n)
        out[h] = offset + centres[which] + rng.normal(0, 0.6, (n, d))
    return out


def timeit(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def smollm2_keys() -> np.ndarray:
    path = Path.home() / ".cache" / "icecache" / "bench" / "smollm2_keys.npz"
    if path.exists():
        k = np.load(path)["keys"][:8192]
        if len(k) == 8192:
            return np.stack([k, np.roll(k, 2731, axis=0), np.roll(k, 5462, axis=0)])
    return clustered(3, 8192, 64, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts for build and select")
    ap.add_argument("--layers", type=int, default=12, help="layers the cold-cache selection cycles over")
    ap.add_argument("--out", type=Path, default=Path("benches/out"))
    args = ap.parse_args(argv)
    thread_counts = [int(t) for t in args.threads.split(",")]
    rows = []

    shapes = {"smollm2 3x8k x64": smollm2_keys(), "llama8b 8x32k x128": clustered(8, 32768, 128, 2)}
    for name, keys in shapes.items():
        for threads in thread_counts:
            build = functools.partial(icecache.HeadForest, keys, seed=0, threads=threads)
            secs = timeit(build, max(3, args.repeats // 5))
            rows.append(("build", name, threads, secs * 1e3, secs * 1e3 / keys.shape[0], "ms / layer; ms / tree"))
            print(
                f"build {name:<20} threads={threads}: {secs * 1e3:8.1f} ms per layer, "
                f"{secs * 1e3 / keys.shape[0]:6.1f} ms per tree",
                file=sys.stderr,
            )

    keys = shapes["llama8b 8x32k x128"]
    rng = np.random.default_rng(3)
    # Decode-like queries: near keys of the same head (attention queries align with keys).
    queries = np.stack([keys[h // 4, rng.integers(0, keys.shape[1])] for h in range(32)]).astype(np.float32)
    queries += rng.normal(0, 0.5, queries.shape).astype(np.float32)
    for threads in thread_counts:
        forest = icecache.HeadForest(keys, seed=0, threads=threads)
        sel = timeit(functools.partial(forest.select, queries, 12), args.repeats * 5)
        rows.append(("select", "llama8b 32q/8kv 32k, 12 pages", threads, sel * 1e3, None, "ms"))
        print(f"select llama8b layer ({threads} threads): {sel * 1e3:.3f} ms", file=sys.stderr)

    # A decode step selects for every layer in turn, so each layer's index is cold in cache.
    layers = [forest]
    layer_queries = [queries]
    for i in range(1, args.layers):
        lk = clustered(8, 32768, 128, 100 + i)
        layers.append(icecache.HeadForest(lk, seed=0, threads=thread_counts[-1]))
        q = np.stack([lk[h // 4, rng.integers(0, lk.shape[1])] for h in range(32)]).astype(np.float32)
        layer_queries.append(q + rng.normal(0, 0.5, q.shape).astype(np.float32))
        del lk
    times = []
    for _ in range(args.repeats + 1):
        for f, q in zip(layers, layer_queries):
            t = time.perf_counter()
            f.select(q, 12)
            times.append(time.perf_counter() - t)
    cold = float(np.median(times[len(layers) :]))
    rows.append(
        ("select, cold", f"llama8b layer, cycling {len(layers)} layers", thread_counts[-1], cold * 1e3, None, "ms")
    )
    print(f"select llama8b layer cycling {len(layers)} layers: {cold * 1e3:.3f} ms", file=sys.stderr)
    del layers[1:]

    # Gather: the pages a step selects (12 per head), K and V, bf16 like a real cache.
    p = forest.max_pages()
    k_store = rng.integers(0, 2**16, (8, p, 16, 128), dtype=np.uint16)
    v_store = rng.integers(0, 2**16, (8, p, 16, 128), dtype=np.uint16)
    pages, counts = forest.select(queries, 12)
    heads = np.repeat(np.arange(8, dtype=np.int32), 12)
    flat = pages.reshape(-1)
    # Many steps' worth of distinct pages so the copy streams from memory, not cache.
    reps = 64
    heads_r = np.tile(heads, reps)
    pages_r = (flat[None, :] + np.arange(reps)[:, None] * 7).reshape(-1) % p
    stage_k = np.empty((len(pages_r), 16, 128), np.uint16)
    stage_v = np.empty_like(stage_k)
    g = timeit(
        lambda: icecache.gather_pages(k_store, v_store, heads_r, pages_r.astype(np.int32), stage_k, stage_v),
        args.repeats,
    )
    nbytes = 2 * stage_k.nbytes
    src = np.ascontiguousarray(k_store.reshape(-1)[: nbytes // 2])
    dst = np.empty(nbytes, np.uint8)
    src2 = np.concatenate([src.view(np.uint8), v_store.reshape(-1)[: nbytes // 4].view(np.uint8)])[:nbytes]
    m = timeit(lambda: np.copyto(dst, src2), args.repeats)
    rows.append(
        (
            "gather",
            f"{len(pages_r)} pages x2 (bf16, 16x128)",
            "rayon",
            nbytes / g / 1e9,
            nbytes / m / 1e9,
            "GB/s gather; GB/s memcpy",
        )
    )
    print(
        f"gather: {nbytes / g / 1e9:.2f} GB/s vs single-core memcpy {nbytes / m / 1e9:.2f} GB/s "
        f"({g / m:.2f}x the memcpy time)",
        file=sys.stderr,
    )

    header = (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"python {platform.python_version()}, numpy {np.__version__}, icecache {icecache.__version__}; "
        f"command: python benches/bench_pages.py --repeats {args.repeats} --threads {args.threads} "
        f"--layers {args.layers}"
    )
    print(header)
    print("| what | shape | threads | value | per tree / memcpy | unit |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            "| " + " | ".join("" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x)) for x in r) + " |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_pages.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
