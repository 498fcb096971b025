#!/usr/bin/env python
"""Where IceCache loses a RULER answer: attention recall by layer along the full cache's answer.

For each chosen sample: one exact prefill, the full cache's greedy answer, then IceCache
(``IceCache.from_prefilled``, ``track_recall=True``) fed that same answer token by token
(teacher-forced), at each budget, with the look-ahead on and off, and for each ``--variant`` of
IceCache's options. Per run it reports the answer tokens where IceCache's own choice would
differ from the full cache's (the first of them shown, with the full cache's and IceCache's
margin for the answer's token there: a full cache that barely prefers it marks a coin-flip
answer), and each IceCache layer's attention recall (the share of the full attention mass on
the tokens the step attended) at that first token and averaged over the answer. Low recall
where it diverges points at selection (and at the layers that lose it); recall that a larger
budget restores points at the budget; a difference between look-ahead on and off points at the
look-ahead's stale query. With ``--oracle``, the exact top-k oracle's rows at the same budgets
give the recall no selection of that many tokens can beat.

    python benches/ruler_breakdown.py --task niah_multivalue --length 8192 --indices 2 5 6 \\
        [--budgets 256 1024] [--model smollm2] [--samples 8] [--full-layers 2] [--dtype float32] \\
        [--variant page_format=native --variant effort=2.0] [--lookahead on off] [--oracle]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
from typing import List, Tuple

import numpy as np


def recalls_by_layer(stats, layers: int, steps: int) -> np.ndarray:
    """``RuntimeStats.recalls`` (one per layer and step, batch 1) as ``[steps, layers]``."""
    got = np.asarray(stats.recalls, dtype=np.float64)
    if got.size != layers * steps:
        raise RuntimeError(f"expected {layers} x {steps} recalls, got {got.size}")
    return got.reshape(steps, layers)


def teacher_forced(model, cache, answer: List[int]) -> Tuple[List[int], List[float]]:
    """Feeds ``answer[:-1]`` to ``cache`` one token at a time; returns the argmax after each
    (what the cache would have chosen for ``answer[1:]``) and the margin of the answer's token
    there: its logit minus the best other token's (negative where the cache would choose
    another)."""
    import torch
    from icecache._util import cache_keyword

    kw, chosen, margins = cache_keyword(model), [], []
    with torch.inference_mode():
        for token, want in zip(answer[:-1], answer[1:]):
            logits = model(torch.tensor([[token]], device=model.device), logits_to_keep=1, **{kw: cache}).logits
            row = logits[0, -1].float()
            chosen.append(int(row.argmax()))
            other = row.clone()
            other[want] = float("-inf")
            margins.append(float(row[want] - other.max()))
    return chosen, margins


def oracle_recalls(model, prefix, answer: List[int], settings, budget: int):
    """The exact top-``budget`` oracle teacher-forced along ``answer`` (as :func:`teacher_forced`),
    with each of its layers' recall at each step (the share of the full attention mass on the
    tokens it attends, averaged over query heads, as IceCache's ``track_recall`` counts it):
    the recall that no selection of ``budget`` tokens can beat. Returns the argmaxes, the margins,
    the recalls ``[steps, layers]`` and the layers' indices."""
    import torch
    from icecache.eval.ruler.evaluate import _method_cache
    from icecache.eval.ruler.methods import BudgetLayer

    cache = _method_cache("oracle", budget, model, prefix, None, settings)
    layers = [x for x in cache.layers if isinstance(x, BudgetLayer)]
    got: List[float] = []

    def measured(layer):
        attend = layer.attend

        def run(query, scale):
            q, k = query[0, :, 0].float(), layer.keys[0].float()
            H, _, D = k.shape
            p = torch.softmax(torch.einsum("hgd,htd->hgt", q.reshape(H, -1, D), k) * scale, dim=-1)
            got.append(float((p * layer.keep_mask(q, scale)[:, None]).sum(-1).mean()))
            return attend(query, scale)

        return run

    for layer in layers:
        layer.attend = measured(layer)
    chosen, margins = teacher_forced(model, cache, answer)
    rec = np.asarray(got, dtype=np.float64).reshape(len(chosen), len(layers))
    return chosen, margins, rec, [x.layer_idx for x in layers]


def row(named: str, budget: int, lookahead: str, answer, chosen, margins, full_margins, rec, layer_ids, tok) -> str:
    """One table row: where ``chosen`` leaves ``answer`` first, the margins and recalls there,
    and the recall over the answer by layer."""
    differ = [i for i, (c, a) in enumerate(zip(chosen, answer[1:])) if c != a]
    mean = rec.mean(0)
    low = ", ".join(f"{layer_ids[j]}: {mean[j]:.3f}" for j in np.argsort(mean)[:3])
    if not differ:
        at, there, margin = "none", "-", "-"
    else:
        i, r = differ[0], rec[differ[0]]
        full, other = tok.decode([answer[i + 1]]), tok.decode([chosen[i]])
        at = f"{len(differ)}; first: token {i + 1}, {full!r} -> {other!r}"
        there = f"{r.mean():.3f} ({layer_ids[int(r.argmin())]}: {r.min():.3f})"
        margin = f"{full_margins[i]:.3f} / {margins[i]:.3f}"
    return f"| {named} | {budget} | {lookahead} | {at} | {margin} | {there} | {rec.mean():.3f} | {low} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", required=True)
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--indices", type=int, nargs="+", required=True, help="sample indices")
    ap.add_argument("--samples", type=int, default=8, help="the run's samples per task (names its cache)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--full-layers", type=int, default=2, help="as `icecache eval ruler --full-layers`")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (the H200's runs: bfloat16)")
    ap.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="KEY=VALUE,...",
        help="IceCache options to compare, as `icecache eval ruler --ice` takes them, comma-separated; "
        "repeatable (default: one run with the defaults); page_size is shared by every method and named here too",
    )
    ap.add_argument("--lookahead", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument(
        "--oracle", action="store_true", help="also the exact top-k oracle at each budget: its recall is the ceiling"
    )
    args = ap.parse_args(argv)
    import torch
    from icecache import models
    from icecache._util import cache_keyword
    from icecache.cli import _option_arg
    from icecache.eval.ruler import RulerSettings, data
    from icecache.eval.ruler.evaluate import _eos_ids, _greedy
    from icecache.runtime import IceCache, enable
    from icecache.runtime.layer import IceLayer
    from transformers import DynamicCache

    torch.set_num_threads(args.threads)
    variants = [dict(_option_arg(o) for o in v.split(",") if o) for v in args.variant or [""]]
    model, tok = models.load_model(args.model, dtype=getattr(torch, args.dtype))
    enable(model)
    samples = data.generate_samples(args.task, args.length, tok, args.samples, seed=args.seed, cache_dir=args.cache_dir)
    allowance = data.task_spec(args.task).tokens_to_generate
    eos = _eos_ids(model, tok)
    for sample in (samples[i] for i in args.indices):
        ids = tok(sample.input, add_special_tokens=not sample.chat, return_tensors="pt").input_ids
        prefix = DynamicCache(config=model.config)
        with torch.inference_mode():
            first = int(model(ids, logits_to_keep=1, **{cache_keyword(model): prefix}).logits[0, -1].argmax())
        answer = _greedy(model, copy.deepcopy(prefix), first, allowance, eos)
        _, full_margins = teacher_forced(model, copy.deepcopy(prefix), answer)
        text = tok.decode(answer, skip_special_tokens=True)
        (score,) = data.score_task(args.task, [text], [sample.outputs])
        print(f"\n### {args.task} {args.length} #{sample.index}: full cache scores {score:.0f} ({text[:80]!r})")
        print(
            "| options | budget | look-ahead | tokens it would choose otherwise | margin there, full / this cache "
            "| recall there, mean (lowest layer) | recall over the answer, mean | lowest layers over the answer |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for variant, budget, lookahead in itertools.product(variants, args.budgets, args.lookahead):
            options = dict(variant, lookahead=lookahead == "on")
            page_size = options.pop("page_size", 16)
            settings = RulerSettings(page_size=page_size, full_layers=args.full_layers, icecache=options)
            config = settings.ice_config(budget)
            cache = IceCache.from_prefilled(config, model, prefix, track_recall=True)
            chosen, margins = teacher_forced(model, cache, answer)
            layers = [x for x in cache.layers if isinstance(x, IceLayer)]
            rec = recalls_by_layer(cache.stats, len(layers), len(chosen))
            named = ", ".join(f"{k}={v}" for k, v in variant.items()) or "defaults"
            layer_ids = [x.layer_idx for x in layers]
            print(row(named, budget, lookahead, answer, chosen, margins, full_margins, rec, layer_ids, tok))
            del cache
        if args.oracle:
            for budget in args.budgets:
                settings = RulerSettings(full_layers=args.full_layers)
                chosen, margins, rec, layer_ids = oracle_recalls(model, prefix, answer, settings, budget)
                print(
                    row("oracle (exact top-k)", budget, "-", answer, chosen, margins, full_margins, rec, layer_ids, tok)
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
