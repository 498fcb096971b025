#!/usr/bin/env python
"""Per-token decode time on the CPU: full cache vs IceCache, with IceCache's breakdown.

SmolLM2-135M-Instruct (the GGUF from PyPI, offline once cached) on one ~8k-token document of
real text (shipped Austen). The prompt is prefilled once (exact attention either way); then
``--steps`` one-token greedy decode steps run with a copy of the full cache and with IceCache
(``from_prefilled``) at each budget, interleaved ``--repeats`` times; medians are reported.

IceCache runs with look-ahead (the default) and with fresh selection. Its per-token time is
split into the window update, waiting for the layer's host job (with look-ahead: the job the
worker started a step earlier; with fresh selection: the whole job), the copy of the job's pages
to the device pool (a view on the CPU), ranking + attention, and the rest of the model
(everything else: projections, MLPs, full-cache layers); with the pages the host selected and
loaded per token (over layers and KV heads). On the CPU the look-ahead worker shares the cores
with the model.

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
    variants = [(b, la) for b in args.budgets for la in (True, False)]
    for b, la in variants:
        runs[f"IceCache {b}{'' if la else ' fresh'}"] = []
    for rep in range(args.repeats):
        full = copy.deepcopy(prefix)
        runs["full cache"].append((decode(model, full, last, args.steps), None))
        del full
        for b, la in variants:
            cache = IceCache.from_prefilled(IceCacheConfig(budget=b, lookahead=la), model, prefix)
            cache.wait_indexed()  # time decoding only, not the prompt's indexing
            t = decode(model, cache, last, args.steps)
            runs[f"IceCache {b}{'' if la else ' fresh'}"].append((t, copy.deepcopy(cache.stats)))
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
    print("| cache | total | update | wait | copy | attention | rest of model | pages selected/tok | loaded/tok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        total = statistics.median(t for t, _ in rs) * 1e3
        if rs[0][1] is None:
            print(f"| {name} | {total:.1f} | - | - | - | - | - | - | - |")
            continue
        per = lambda f, rs=rs: statistics.median(f(s) / args.steps for _, s in rs)  # noqa: E731
        parts = [per(lambda s, k=k: getattr(s, k)) * 1e3 for k in ("update_s", "wait_s", "copy_s", "attend_s")]
        sel, load = (per(lambda s, k=k: getattr(s, k)) for k in ("pages_selected", "pages_loaded"))
        print(
            f"| {name} | {total:.1f} | " + " | ".join(f"{x:.2f}" for x in parts) + f" | {total - sum(parts):.1f} | "
            f"{sel:.0f} | {load:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
