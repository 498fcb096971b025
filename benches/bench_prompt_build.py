#!/usr/bin/env python
"""The index worker's work for a chunked prompt's build, per layer: gather the middle from the
host prompt's blocks, then build the layer's index and pages (``PageIndex.add``), with the
gather into fresh tensors (``HostPrefix.gather``) or into the worker's reused transit buffer
(``gather(out=...)``, what the runtime does), alternated round by round.

Llama-3.1-8B's KV shape (8 heads x 128), ``bench_pages.py``'s clustered keys, blocks of 8192
as the default chunk gives, batch 1, 8-bit pages.

    python benches/bench_prompt_build.py [--tokens 32768] [--layers 4] [--rounds 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_pages import clustered


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from icecache.runtime.config import IceCacheConfig
    from icecache.runtime.pages import PageIndex, PageStore
    from icecache.runtime.prefix import HostPrefix
    from icecache.runtime.transfer import Transit

    torch.set_num_threads(args.threads)
    H, n, D, chunk = 8, args.tokens, 128, 8192
    cfg = IceCacheConfig(threads=args.threads)
    prefixes = []
    for layer in range(args.layers):
        keys = torch.from_numpy(clustered(H, n, D, layer)).to(torch.bfloat16)
        values = torch.randn(H, n, D).to(torch.bfloat16)
        prefix = HostPrefix(torch.device("cpu"))
        for at in range(0, n, chunk):
            prefix.offload(keys[None, :, at : at + chunk], values[None, :, at : at + chunk], None)
        prefixes.append(prefix)
    positions = torch.arange(cfg.sink, n - cfg.window)  # the middle
    transit = Transit(torch.device("cpu"))

    def build(reuse: bool):
        total = gathering = 0.0
        for prefix in prefixes:
            t = time.perf_counter()
            if reuse:
                shape = (H, positions.numel(), D)
                k, v = prefix.gather(0, positions, out=transit.views(torch.bfloat16, shape, shape))
            else:
                k, v = prefix.gather(0, positions)
            gathering += time.perf_counter() - t
            PageIndex(H, cfg).add(k, v, PageStore(H, cfg.page_size, D, torch.bfloat16, cfg.page_format))
            total += time.perf_counter() - t
        return total, gathering

    times: dict = {False: [], True: []}
    for _ in range(args.rounds):
        for reuse in (False, True):
            times[reuse].append(build(reuse))
    print(f"{args.layers} layers of {n} tokens, {args.threads} thread(s), {args.rounds} rounds")
    print("| gather | total s per round | median | of it gathering s |")
    print("|---|---|---|---|")
    for reuse, name in ((False, "fresh tensors"), (True, "into the reused buffer")):
        total = ", ".join(f"{t:.2f}" for t, _ in times[reuse])
        gathering = ", ".join(f"{g:.2f}" for _, g in times[reuse])
        print(f"| {name} | {total} | {statistics.median(t for t, _ in times[reuse]):.2f} | {gathering} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
