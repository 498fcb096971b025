#!/usr/bin/env python
"""What ``IceCacheConfig(effort="auto")`` costs at prefill on the CPU, against a fixed effort.

SmolLM2-135M-Instruct on real documents shipped with the package (``--prose`` Austen and
``--code`` CPython documents of ``--tokens`` tokens, :func:`icecache.texts.documents`, seed 0).
Per document and effort (interleaved, ``--repeats`` times): one IceCache prefill of the whole
document at ``--budget``; reported are the forward's wall time (the index worker builds, and
with ``"auto"`` calibrates, each layer's index meanwhile, on the other cores), the time from
the forward's return until every index is ready (``IceCache.wait_indexed``), and with
``"auto"`` what the worker spent calibrating (``RuntimeStats.calibrate_s``: total, and per
calibrated layer) with the efforts it chose. Then ``--steps`` greedy decode steps (0: none):
seconds per token, and the look-ahead worker's selection time per (layer, step)
(``RuntimeStats.worker_select_s``), which grows with the effort.

    python benches/bench_calibrate_prefill.py [--tokens 4096] [--prose 1] [--code 1] [--budget 256] [--steps 0]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prose", type=int, default=1)
    ap.add_argument("--code", type=int, default=1)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="greedy decode steps after the prefill")
    ap.add_argument("--threads", type=int, default=None, help="torch and index threads (default: torch's, all)")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from icecache import __version__, models, texts
    from icecache.runtime import IceCache, IceCacheConfig
    from icecache.runtime.layer import IceLayer

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = models.load_model("smollm2")
    docs = []
    for kind, n in (("prose", args.prose), ("code", args.code)):
        if n:
            names = texts.document_sources(n, seed=0, kind=kind)
            docs += [
                (f"{kind} {name}", ids)
                for name, ids in zip(names, texts.documents(tokenizer, n, args.tokens, kind=kind))
            ]
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"icecache {__version__}, {platform.machine()}, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    print(
        "| document | effort | forward s | index ready after s | calibration s (per layer) | efforts min / med / max "
        "| decode s/token | select ms per (layer, step) |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for name, ids in docs:
        rows: dict = {}
        for _repeat in range(args.repeats):
            for effort in (1.0, "auto"):
                cache = IceCache(IceCacheConfig(budget=args.budget, effort=effort, threads=args.threads), model)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = model(torch.tensor([ids]), cache=cache, logits_to_keep=1)
                t1 = time.perf_counter()
                token = out.logits[:, -1:].argmax(-1)
                cache.wait_indexed()
                t2 = time.perf_counter()
                with torch.inference_mode():
                    for _ in range(args.steps):
                        token = model(token, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
                t3 = time.perf_counter()
                stats = cache.stats
                per_token = (t3 - t2) / args.steps if args.steps else float("nan")
                select_ms = 1e3 * stats.worker_select_s / stats.layer_steps if stats.layer_steps else float("nan")
                leaders = [la for la in cache.layers if isinstance(la, IceLayer) and la.leader is None]
                efforts = sorted(e for la in leaders for ix in la.indexes for e in ix.forest.efforts)
                calibrated = sum(1 for la in leaders if all(ix.calibrations for ix in la.indexes))
                rows.setdefault(effort, []).append(
                    (t1 - t0, t2 - t1, stats.calibrate_s, calibrated, efforts, per_token, select_ms)
                )
        for effort, runs in rows.items():
            fwd = statistics.median(r[0] for r in runs)
            ready = statistics.median(r[1] for r in runs)
            cal = statistics.median(r[2] for r in runs)
            per_token = statistics.median(r[5] for r in runs)
            select_ms = statistics.median(r[6] for r in runs)
            layers, efforts = runs[0][3], runs[0][4]
            cal_text = f"{cal:.2f} ({cal / layers:.3f} x {layers})" if layers else "-"
            spread = f"{efforts[0]:.3g} / {statistics.median(efforts):.3g} / {efforts[-1]:.3g}"
            print(
                f"| {name} | {effort} | {fwd:.2f} | {ready:.2f} | {cal_text} | {spread} "
                f"| {per_token:.3f} | {select_ms:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
