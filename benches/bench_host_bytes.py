#!/usr/bin/env python
"""Host bytes per offloaded token of each page format, at a model shape, against bf16 K+V.

One layer of one sequence: ``--heads`` KV heads of ``--tokens`` Gaussian keys (as random weights
give; a real model's keys cluster more, which fills pages about as well) of head size ``--dim``,
indexed by ``icecache.HeadForest`` and written into the runtime's page stores
(``icecache.runtime.pages.PageStore``) in each format. Reported per token and KV head, and as
a share of bf16 K+V (``4 * dim`` bytes):

- rows: the K and V bytes of a token in a full page (codes and scales, or bf16 elements);
- pages in use: the pages the index made (``HeadForest.num_pages``) times their size, per token:
  rows plus the empty slots of part-filled pages;
- index: ``HeadForest.nbytes()`` (trees, cells, page maps; with native pages also the keys'
  int8 rows, which quantised K pages hold instead);
- own: pages in use plus index, what the sequence holds beyond the runtime's buffers;
- headroom: the room ``pages.headroom`` reserves for decode inserts (allocated, untouched until
  inserts use it: address space, not resident memory, where the allocator maps large blocks
  lazily).

Then the runtime's own host buffers, per sequence and against its bf16 K+V, at ``--layers``
IceCache layers and the default configuration: the decode steps' staging (one pinned buffer
per layer, sized for the selected pages of every sequence of the batch) and the prefill's
transit buffer (one per cache: one sequence's middle keys and values of one layer). And, with
``--rss-layers N``, what the process's resident memory grows by while N layers of the default
format are built and written as the runtime does, against what they hold (whether the
allocator keeps much of the builds' scratch).

Resident memory of the whole runtime (staging, transit, the allocator, CUDA's) is measured on a
GPU by ``benches/bench_gpu.py`` (its "RSS growth" column).

    python benches/bench_host_bytes.py [--heads 8] [--tokens 32720] [--dim 128] [--formats native int8 k8v4]
        [--layers 30] [--rss-layers 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_index import run_header  # noqa: E402


def measure(page_format: str, keys: np.ndarray, values: np.ndarray, page_size: int) -> dict:
    """Bytes per token and KV head of one format (see the module docs)."""
    import icecache
    import torch
    from icecache.runtime.pages import PageStore, headroom

    H, n, D = keys.shape
    # bfloat16 as the model's cache holds them (uint16 views).
    k, v = (torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16) for x in (keys, values))
    forest = icecache.HeadForest(k, page_size=page_size, seed=0, page_format=page_format)
    store = PageStore(H, page_size, D, torch.bfloat16, page_format)
    store.reserve(forest.max_pages(), 0)
    forest.write_pages(k, v, *store.views())
    page_bytes = store.nbytes() / (H * store.pages)
    used = sum(forest.num_pages(h) for h in range(H))
    rows = page_bytes / page_size
    pages = used * page_bytes / (H * n)
    index = forest.nbytes() / (H * n)
    room = (headroom(forest.max_pages()) - forest.max_pages()) * page_bytes / n
    return {
        "rows": rows,
        "pages": pages,
        "fill": H * n / (used * page_size),
        "index": index,
        "own": pages + index,
        "headroom": room,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=8, help="KV heads (default 8: Llama-3.1-8B)")
    ap.add_argument("--tokens", type=int, default=32720, help="offloaded tokens per head (default 32720)")
    ap.add_argument("--dim", type=int, default=128, help="head size (default 128)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--formats", nargs="+", default=["native", "int8", "k8v4"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=30, help="IceCache layers (default 30: Llama-3.1-8B's 32 less 2)")
    ap.add_argument("--rss-layers", type=int, default=0, help="layers to build for the resident-memory check")
    args = ap.parse_args(argv)
    print(run_header("Host bytes per offloaded token", None)[0])
    rng = np.random.default_rng(args.seed)
    shape = (args.heads, args.tokens, args.dim)
    keys = rng.standard_normal(shape, dtype=np.float32)
    values = rng.standard_normal(shape, dtype=np.float32)
    bf16 = 4 * args.dim
    print(
        f"\n{args.heads} KV heads x {args.tokens} tokens, d = {args.dim}, pages of {args.page_size}; "
        f"bf16 K+V {bf16} B\n"
    )
    print("| page format | rows B (x bf16) | pages in use B (x) | fill | index B (x) | own B (x) | + headroom B (x) |")
    print("|---|---|---|---|---|---|---|")
    for fmt in args.formats:
        m = measure(fmt, keys, values, args.page_size)

        def cell(x: float) -> str:
            return f"{x:.1f} ({x / bf16:.3f}x)"

        print(
            f"| {fmt} | {cell(m['rows'])} | {cell(m['pages'])} | {m['fill']:.1%} | {cell(m['index'])} | "
            f"{cell(m['own'])} | {cell(m['own'] + m['headroom'])} |",
            flush=True,
        )
    runtime_buffers(args)
    if args.rss_layers:
        rss_check(args, keys, values)
    return 0


def runtime_buffers(args) -> None:
    """The staging and transit buffers per sequence (see the module docs)."""
    import torch
    from icecache.runtime import IceCacheConfig
    from icecache.runtime.staging import Staging

    cfg = IceCacheConfig()
    layer_bf16 = args.heads * args.tokens * 4 * args.dim  # one sequence, one layer
    print(
        f"\nRuntime buffers, default configuration (page format {cfg.page_format}, {cfg.selected_pages} "
        f"selected pages), {args.layers} IceCache layers, per sequence (x its bf16 K+V)\n"
    )
    print("| batch | staging B per layer and sequence (x) | transit B per sequence (x) |")
    print("|---|---|---|")
    for batch in (1, 8):
        staging = Staging.for_layer(cfg, batch=batch, kv_heads=args.heads, dim=args.dim, dtype=torch.bfloat16).bytes
        transit = layer_bf16 / batch  # one buffer: a sequence-layer's middle, shared by the batch
        print(
            f"| {batch} | {staging / batch:,.0f} ({staging / batch / layer_bf16:.4f}x) "
            f"| {transit:,.0f} ({transit / (args.layers * layer_bf16):.4f}x) |"
        )


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_check(args, keys: np.ndarray, values: np.ndarray) -> None:
    """Resident memory of ``--rss-layers`` layers, each indexed and written by the runtime's
    ``PageIndex.add``, against their own bytes."""
    import torch
    from icecache.runtime import IceCacheConfig
    from icecache.runtime.pages import PageIndex, PageStore

    cfg = IceCacheConfig()
    H, n, D = keys.shape
    k, v = (torch.from_numpy(x).bfloat16() for x in (keys, values))
    held, own = [], 0
    base = _rss()
    for layer in range(args.rss_layers):
        index = PageIndex(H, IceCacheConfig(seed=layer))
        store = PageStore(H, cfg.page_size, D, torch.bfloat16, cfg.page_format)
        index.add(k, v, store)
        forest = index.forest
        used = sum(forest.num_pages(h) for h in range(H))
        own += used * store.nbytes() // (H * store.pages) + forest.nbytes()
        held.append((index, store))
    grown = _rss() - base
    bf16 = args.rss_layers * H * n * 4 * D
    print(
        f"\n{args.rss_layers} layers built and written ({cfg.page_format}): own {own / 2**20:,.0f} MiB "
        f"({own / bf16:.3f}x bf16 K+V), resident memory grew {grown / 2**20:,.0f} MiB ({grown / bf16:.3f}x)"
    )


if __name__ == "__main__":
    sys.exit(main())
