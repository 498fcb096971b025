r"""Prefill in bounded GPU memory: peak GPU memory, prefill time, time to second token and time
per output token of a long prompt, full cache vs IceCache (chunked prefill), in one run.

Variants (each from an empty cache, in the order given, after one warm-up prefill of 8k):

- ``full``: ``DynamicCache``, the prompt in one forward;
- ``full-cN``: ``DynamicCache``, the prompt in chunks of N (transformers' ``prefill_chunk_size``);
- ``offloaded``: ``DynamicCache(offloading=True)``, one forward;
- ``ice``: IceCache with its defaults (the prompt in ``IceCacheConfig.prefill_chunk`` chunks);
- ``ice-cN``: IceCache with ``prefill_chunk=N``;
- ``ice-again``: the cache of the IceCache variant run last, ``reset()``, prefilled again: it
  keeps its last chunked prompt's pinned host blocks for the next prompt, which pins none.

Per variant: the peak of ``torch.cuda.max_memory_allocated()`` beyond the weights over prefill
and decode; the device memory held while decoding; the prefill's time (every chunk's forward,
synced); the time to the second token (prefill + one decode step, which for IceCache includes
waiting for the last index work); for IceCache the steps bridged until every index was ready,
their median time and the share of IceCache layer steps among them that attended the whole
cache; the median time per token over ``--steps`` decode steps. A
variant that runs out of device memory is reported as such. ``--memory-cap-gib`` caps the
process as a smaller card would (``torch.cuda.set_per_process_memory_fraction``). After
``--max-bridged`` bridged steps the run waits for the indexes (reported as ``waited``);
``--profile`` prints a torch.profiler table of each variant's prefill.

Usage (the lent H200; Llama-3.1-8B shape, random bf16 weights)::

    python3 benches/bench_prefill.py --contexts 131072 --variants full full-c8192 ice ice-c4096 ice-c16384
    python3 benches/bench_prefill.py --contexts 524288 --memory-cap-gib 40 --variants ice --max-bridged 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

from bench_gpu import build_model, llama8b_config, smollm2_config, tiny_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["llama8b", "smollm2", "tiny"], default="llama8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072])
    ap.add_argument("--variants", nargs="+", default=["full", "ice"])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument(
        "--memory-cap-gib", type=float, default=None, help="cap the process's GPU memory, as a smaller card"
    )
    ap.add_argument(
        "--max-bridged",
        type=int,
        default=1000,
        help="most steps decoded before the indexes are ready; then the run waits for them",
    )
    ap.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table of each variant's prefill (CPU and CUDA)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import icecache
    import torch
    from icecache import IceCache, IceCacheConfig
    from icecache._util import cache_keyword
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shapes = {"llama8b": (llama8b_config, 32), "smollm2": (smollm2_config, 30), "tiny": (tiny_config, 4)}
    make_config, layers = shapes[args.shape]
    cfg = make_config(args.layers or layers)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, max(args.contexts) + args.steps + 8)
    torch.manual_seed(0)
    model = build_model(cfg, device, 1)
    model.generation_config.prefill_chunk_size = None
    icecache.enable(model)
    kw = cache_keyword(model)
    if cuda and args.memory_cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / total)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    weights = torch.cuda.memory_allocated() if cuda else 0
    gib = 2**30

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    kept = []  # the last IceCache variant's cache and chunk, for ice-again

    def make(variant):
        if variant == "ice-again":
            if not kept:
                raise SystemExit("ice-again must follow an IceCache variant")
            cache, chunk = kept[-1]
            with torch.inference_mode():
                cache.reset()
            return cache, chunk
        if variant == "full" or variant.startswith("full-c"):
            return DynamicCache(config=model.config), int(variant[6:]) if variant.startswith("full-c") else None
        if variant == "offloaded":
            return DynamicCache(config=model.config, offloading=True), None
        if variant == "ice" or variant.startswith("ice-c"):
            chunk = int(variant[5:]) if variant.startswith("ice-c") else IceCacheConfig().prefill_chunk
            cache = IceCache(IceCacheConfig(budget=args.budget, prefill_chunk=chunk), model)
            model.generation_config.prefill_chunk_size = None  # the loop below chunks
            kept[:] = [(cache, chunk)]
            return cache, chunk
        raise SystemExit(f"unknown variant {variant!r}")

    def peak_gib():
        return (torch.cuda.max_memory_allocated() - weights) / gib if cuda else 0.0

    def run(variant, ids, steps):
        cache, chunk = make(variant)
        T = ids.shape[1]
        chunk = chunk or T
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        sync()
        profiled = args.profile and T > warm.shape[1]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        t0 = time.perf_counter()
        with torch.inference_mode():
            with profile(activities=activities) if profiled else contextlib.nullcontext() as profiler:
                for at in range(0, T, chunk):
                    out = model(ids[:, at : at + chunk], logits_to_keep=1, **{kw: cache})
                tok = out.logits[:, -1:].argmax(-1)
                sync()
                prefill = time.perf_counter() - t0
            if profiled:
                averages = profiler.key_averages()
                log(f"{variant} {T}: prefill profile, by host time:")
                log(averages.table(sort_by="self_cpu_time_total", row_limit=25))
                if cuda:
                    log(averages.table(sort_by="self_device_time_total", row_limit=15))
            out = model(tok, logits_to_keep=1, **{kw: cache})
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            ttst = time.perf_counter() - t0
            log(f"{variant} {T}: prefill {prefill:.2f} s, TTST {ttst:.2f} s, peak so far {peak_gib():.2f} GiB")
            # IceCache: the steps that attend the whole cache until the indexes are ready
            # (streamed from the host after a chunked prefill), then retrieval. After
            # --max-bridged such steps the run waits for the indexes instead of decoding on.
            bridged, waited = [], 0.0
            while isinstance(cache, IceCache) and cache.runtime.bridges.active:
                if len(bridged) == args.max_bridged:
                    t = time.perf_counter()
                    cache.wait_indexed()
                    waited = time.perf_counter() - t
                    log(f"{variant} {T}: waited {waited:.1f} s for the indexes after {len(bridged)} bridged steps")
                t = time.perf_counter()
                out = model(tok, logits_to_keep=1, **{kw: cache})
                tok = out.logits[:, -1:].argmax(-1)
                sync()
                bridged.append(time.perf_counter() - t)
            ready = time.perf_counter() - t0
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                out = model(tok, logits_to_keep=1, **{kw: cache})
                tok = out.logits[:, -1:].argmax(-1)
                sync()
                times.append(time.perf_counter() - t)
        peak = peak_gib()
        held = (torch.cuda.memory_allocated() - weights) / gib if cuda else 0.0
        row = dict(
            variant=variant, context=T, chunk=chunk, prefill_s=prefill, ttst_s=ttst, peak_gib=peak, held_gib=held
        )
        row["tpot_ms"] = 1e3 * statistics.median(times) if times else None
        if isinstance(cache, IceCache):
            row["bridged_steps"] = len(bridged)
            # Of the IceCache layer steps from the first decode step to the last bridged one,
            # the share that attended the whole cache (each reuse group leaves once its own
            # index is ready).
            layer_steps = (1 + len(bridged)) * cache.runtime.served_layers
            row["bridged_layer_share"] = cache.stats.bridged_steps / layer_steps if bridged else None
            row["bridged_ms"] = 1e3 * statistics.median(bridged) if bridged else None
            row["retrieval_from_s"] = ready  # the indexes ready: the first step that retrieves
            row["waited_after_bridged_s"] = waited
            row["index_wait_s"] = cache.stats.index_wait_s
            row["host_gib"] = cache.nbytes()["host"] / gib
        del cache, out
        return row

    results = []
    log(f"weights {weights / gib:.2f} GiB; torch {torch.__version__}, icecache {icecache.__version__}")
    warm = torch.randint(0, cfg.vocab_size, (1, 8192), device=device)
    for v in dict.fromkeys(args.variants):
        try:
            run(v, warm, 2)
        except torch.OutOfMemoryError:
            pass
    for T in args.contexts:
        ids = torch.randint(0, cfg.vocab_size, (1, T), device=device, generator=None)
        for v in args.variants:
            try:
                row = run(v, ids, min(args.steps, 4) if v == "offloaded" else args.steps)  # ~1 s a step
            except (torch.OutOfMemoryError, MemoryError) as exc:  # the device's, or IceCache's host check
                row = dict(variant=v, context=T, oom=str(exc).split("\n")[0][:200])
                if cuda:
                    torch.cuda.empty_cache()
            results.append(row)
            log(json.dumps(row))
    log(
        "| context | variant | chunk | peak GiB | held GiB | prefill s | TTST s | bridged steps (ms; layer share) "
        "| retrieval from s | TPOT ms |"
    )
    for r in results:
        if "oom" in r:
            log(f"| {r['context']} | {r['variant']} | - | {r['oom']} | | | | | | |")
            continue
        bridged = "-"
        if "bridged_steps" in r:
            share = r["bridged_layer_share"]
            bridged = f"{r['bridged_steps']} ({r['bridged_ms'] or 0:.0f}; {'-' if share is None else f'{share:.2f}'})"
        ready = f"{r['retrieval_from_s']:.2f}" if "retrieval_from_s" in r else "-"
        log(
            f"| {r['context']} | {r['variant']} | {r['chunk']} | {r['peak_gib']:.2f} | {r['held_gib']:.2f} | "
            f"{r['prefill_s']:.2f} | {r['ttst_s']:.2f} | {bridged} | {ready} | {r['tpot_ms']:.1f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
