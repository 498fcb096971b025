#!/usr/bin/env python
"""Per-token decode time on the CPU: full cache vs IceCache, with IceCache's breakdown.

SmolLM2-135M-Instruct (the GGUF from PyPI, offline once cached) on one ~8k-token document of
real text (shipped Austen). The prompt is prefilled once (exact attention either way); then
``--steps`` one-token greedy decode steps run with a copy of the full cache and with IceCache
(``from_prefilled``) at each budget, interleaved ``--repeats`` times; medians are reported.

IceCache's per-token time is split into page selection (+ load planning), gather into staging,
host-to-device copy + scatter (a plain copy on the CPU), attention over sink + pages + window,
and the rest of the model (everything else: projections, MLPs, full-cache layers).

    python benches/bench_decode.py [--tokens 8000] [--steps 32] [--budgets 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time


def decode(model, cache, first_token, steps):
    """``steps`` greedy one-token steps from ``cache``; returns seconds per token."""
    import torch

    tok = first_token
    pos = cache.get_seq_length()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(steps):
            out = model(tok, cache=cache, cache_position=torch.tensor([pos + i]), logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)

    import icecache
    import torch
    import transformers
    from icecache import models, texts
    from icecache.runtime import IceCache, IceCacheConfig, enable
    from transformers import DynamicCache

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = models.load_model("smollm2")
    enable(model)
    ids = torch.tensor([texts.documents(tok, 1, args.tokens, seed=0)[0]])
    print(f"prefill of {ids.shape[1] - 1} tokens ...", file=sys.stderr)
    prefix = DynamicCache()
    with torch.inference_mode():
        model(ids[:, :-1], cache=prefix, logits_to_keep=1)
    last = ids[:, -1:]

    runs = {"full cache": []}
    for b in args.budgets:
        runs[f"IceCache {b}"] = []
    for rep in range(args.repeats):
        full = copy.deepcopy(prefix)
        runs["full cache"].append((decode(model, full, last, args.steps), None))
        del full
        for b in args.budgets:
            cache = IceCache.from_prefilled(IceCacheConfig(budget=b), model, prefix)
            cache.wait_indexed()  # time decoding only, not the prompt's indexing
            t = decode(model, cache, last, args.steps)
            runs[f"IceCache {b}"].append((t, copy.deepcopy(cache.stats)))
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)

    print(
        f"machine: {platform.machine()}, torch threads {torch.get_num_threads()}; python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"icecache {icecache.__version__}"
    )
    print(
        f"command: python benches/bench_decode.py --tokens {args.tokens} --steps {args.steps} "
        f"--budgets {' '.join(map(str, args.budgets))} --repeats {args.repeats}"
    )
    print(
        f"SmolLM2-135M, {ids.shape[1] - 1}-token context, {args.steps} decode steps, median of "
        f"{args.repeats} interleaved repeats; ms per token"
    )
    print("| cache | total | selection | gather | copy | attention | rest of model |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        total = statistics.median(t for t, _ in rs) * 1e3
        if rs[0][1] is None:
            print(f"| {name} | {total:.1f} | - | - | - | - | - |")
            continue
        per = lambda f, rs=rs: statistics.median(f(s) / args.steps for _, s in rs) * 1e3  # noqa: E731
        sel, gat, cp, att = (per(lambda s, k=k: getattr(s, k)) for k in ("select_s", "gather_s", "copy_s", "attend_s"))
        print(
            f"| {name} | {total:.1f} | {sel:.2f} | {gat:.2f} | {cp:.2f} | {att:.2f} | "
            f"{total - sel - gat - cp - att:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
