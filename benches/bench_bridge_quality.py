#!/usr/bin/env python
r"""Does leaving the bridge cost retrieval quality? (``IceCacheConfig.exact_until_indexed``)

With the bridge, the tokens decoded while the index is built are inserted into it at the hand
-over instead of being part of the build, and retrieval starts from a fresh device pool at
that step. This measures what that changes after the hand-over: on real SmolLM2-135M prompts
(shipped prose and Python code, ``icecache.texts.documents``), an exact prefill of all but the
last token, then ``--steps`` teacher-forced steps fed the full cache's greedy tokens; IceCache
(budget ``--budget``) runs once without a bridge and once per ``--holds H``: the index worker
held for the first H steps (bridged, exact), then released. Reported per prompt and hold: the
mean attention recall of the last ``--tail`` steps (every hold has retrieved by then) and the
greedy agreement with the full cache over all steps.

    python benches/bench_bridge_quality.py --kinds prose code --docs 2 --tokens 4096 \
        --steps 64 --holds 3 8 16 24 --tail 32

Results in benches/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import threading
import time

import numpy as np
import torch
from icecache import IceCache, IceCacheConfig, texts
from icecache.models import load_model
from transformers import DynamicCache


def run(model, prefix, last, full, budget: int, hold: int):
    """Teacher-forced decode with IceCache; ``hold`` < 0: no bridge. Returns (recall of every
    (layer, step) flattened per step, greedy matches)."""
    cfg = IceCacheConfig(budget=budget, exact_until_indexed=hold >= 0)
    cache = IceCache.from_prefilled(cfg, model, prefix, track_recall=True)
    released = threading.Event()
    if hold > 0:
        cache.runtime.submit(released.wait, 600)
    predicted, per_step = [], []
    try:
        with torch.inference_mode():
            token = last
            for i, expected in enumerate(full):
                if i >= hold:  # from here on the worker's jobs finish before each step
                    released.set()
                    cache.wait_indexed()
                before = len(cache.stats.recalls)
                predicted.append(int(model(token, cache=cache).logits[0, -1].argmax()))
                per_step.append(cache.stats.recalls[before:])
                token = expected.view(1, 1)
    finally:
        released.set()
    return per_step, np.array(predicted) == full.numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=["prose", "code"])
    ap.add_argument("--docs", type=int, default=2, help="prompts per kind")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--holds", type=int, nargs="+", default=[3, 8, 16, 24])
    ap.add_argument("--tail", type=int, default=32, help="recall over the last TAIL steps")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if max(args.holds) + args.tail > args.steps:
        ap.error("every hold must leave --tail steps after it: max(--holds) + --tail <= --steps")
    model, tokenizer = load_model("smollm2")
    holds = [-1] + args.holds
    print(
        f"SmolLM2-135M, budget {args.budget}, {args.tokens}-token prompts, {args.steps} teacher-forced steps; "
        f"recall: mean of the last {args.tail} steps; agreement: all steps; torch {torch.__version__}"
    )
    print("\n| prompt | " + " | ".join("no bridge" if h < 0 else f"held {h}" for h in holds) + " |")
    print("|---|" + "---|" * len(holds))
    rows = {h: [] for h in holds}
    for kind in args.kinds:
        docs = texts.documents(tokenizer, args.docs, args.tokens, seed=args.seed, kind=kind)
        for d, doc in enumerate(docs):
            ids = torch.tensor([doc])
            t = time.perf_counter()
            prefix = DynamicCache()
            with torch.inference_mode():
                model(ids[:, :-1], cache=prefix, logits_to_keep=1)
                full = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.steps,
                    min_new_tokens=args.steps,
                    do_sample=False,
                    cache=copy.deepcopy(prefix),
                    pad_token_id=tokenizer.eos_token_id,
                )[0, ids.shape[1] :]
            cells = []
            for h in holds:
                per_step, agree = run(model, prefix, ids[:, -1:], full, args.budget, h)
                recall = float(np.mean([r for step in per_step[-args.tail :] for r in step]))
                rows[h].append((recall, agree.mean()))
                cells.append(f"{recall:.4f} / {agree.mean():.3f}")
            print(f"| {kind} {d} | " + " | ".join(cells) + " |", flush=True)
            print(f"  ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    means = [
        f"{statistics.mean(r for r, _ in rows[h]):.4f} / {statistics.mean(a for _, a in rows[h]):.3f}" for h in holds
    ]
    print("| mean | " + " | ".join(means) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
