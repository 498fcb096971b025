#!/usr/bin/env python
"""Decode on a GPU: full cache (transformers DynamicCache + SDPA) vs IceCache and IceCache-reuse.

A Llama-3.1-8B-shaped model (config written here, random bf16 weights made on the GPU; no
download). Per context length, one prompt of random tokens:

- time to second token (TTST): prefill + one decode step, from an empty cache, for each
  variant (IceCache's includes offloading and building every index; not pipelined yet);
- time per output token (TPOT): each variant keeps decoding from its own cache; after a
  warm-up, ``--repeats`` rounds of ``--steps`` one-token steps, variants interleaved (order
  rotated per round), every step timed to a device sync; median over all steps;
- IceCache breakdown: one more pass per IceCache variant with a device sync at every stage
  boundary (``Runtime.sync_timing``), per token: selection (q to host + index query + load
  plan), gather (metadata upload + gather of missing pages into pinned staging),
  copy (host-to-device + scatter), attention, rest (all else: projections, MLPs, the full
  layers); the synced pass is slower than the TPOT pass, its total is shown too;
- device KV bytes and host bytes (page stores + staging) after decoding.

    python benches/bench_gpu.py [--contexts 32768 131072] [--steps 32] [--repeats 3]
        [--variants full ice ice3] [--attention auto|torch|flashinfer] [--out DIR]

Runs of 2026-11-30 on the lent H200 (icecache wheel + FlashInfer 0.3.1 sdist installed into
/tmp/site, then ``cp -r python/icecache/runtime python/icecache/attend /tmp/site/icecache/``,
``PYTHONPATH=/tmp/site``):

    python3 benches/bench_gpu.py --contexts 32768 131072 --time-limit 120 --out $OUT  # 128k cut off
    python3 benches/bench_gpu.py --contexts 131072 --variants full ice --repeats 2 --out $OUT
    python3 benches/bench_gpu.py --contexts 32768 --variants full ice --repeats 2 --attention torch --out $OUT

Host memory: at 128k, IceCache (reuse 1) holds ~42 GB of pinned page stores and the machine
(128 GB) came within a few GB of running out; do not run all three variants at 128k at once.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time


def llama8b_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )


def flashinfer_smoke() -> str:
    """'' if FlashInfer's path matches the torch reference on a small case, else the error."""
    import numpy as np
    import torch

    from icecache.attend import flashinfer as fi
    from icecache.attend import sparse_decode_attention

    if not fi.available():
        return "flashinfer not importable"
    try:
        B, H, G, D, S, C, M, sk, w = 1, 8, 4, 128, 16, 26, 13, 16, 32
        T = C * S + sk + w
        kv_k = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        kv_v = torch.randn_like(kv_k)
        q = torch.randn(B, H * G, D, device="cuda", dtype=torch.bfloat16)
        rng = np.random.default_rng(0)
        table = np.stack([rng.permutation(C)[:M] for _ in range(H)])[None].astype(np.int32)
        plen = rng.integers(1, S + 1, (B, H, M)).astype(np.int32)
        sl, wl = np.array([sk], np.int32), np.array([17], np.int32)
        indptr, idx = fi.token_lists(table, plen, sl, wl, C, S, sk, w)
        dec = fi.FlashInferDecode(torch.device("cuda"))
        got = dec.run(q, kv_k, kv_v, torch.from_numpy(indptr).cuda(), torch.from_numpy(idx).cuda(), D ** -0.5)
        P = C * S
        t = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
        ref = sparse_decode_attention(q.float(), kv_k[:, :, P:P + sk].float(), kv_v[:, :, P:P + sk].float(), t(sl),
                                      kv_k[:, :, :P].view(B, H, C, S, D).float(), kv_v[:, :, :P].view(B, H, C, S, D).float(),
                                      t(table), t(plen), kv_k[:, :, P + sk:].float(), kv_v[:, :, P + sk:].float(), t(wl), D ** -0.5)
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        return "" if rel < 1e-2 else f"relative error {rel:.3g}"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "flashinfer"])
    ap.add_argument("--time-limit", type=float, default=1e9, help="skip contexts started after this many s")
    ap.add_argument("--variants", nargs="+", default=["full", "ice", "ice3"],
                    help="full: DynamicCache+SDPA; ice: IceCache; ice3: IceCache reuse=3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()

    import torch
    import transformers
    from transformers import DynamicCache, LlamaForCausalLM

    import icecache
    from icecache.runtime import IceCache, IceCacheConfig, RuntimeStats, enable

    log_lines = []

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
        log_lines.append(msg)

    attention = args.attention
    if attention != "torch":
        err = flashinfer_smoke()
        if err:
            log(f"FlashInfer unusable ({err}): torch attention path")
            if attention == "flashinfer":
                return 1
            attention = "torch"
        else:
            attention = "flashinfer"
    log(f"attention backend: {attention}")

    torch.manual_seed(0)
    cfg = llama8b_config(args.layers)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    enable(model)  # "icecache" attention = plain SDPA for the full cache
    log(f"model built in {time.perf_counter() - t0:.1f} s")
    kw = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

    def step(cache, tok):
        out = model(tok, logits_to_keep=1, **{kw: cache})
        return out.logits[:, -1:].argmax(-1)

    def ttst(cache, ids):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model(ids, logits_to_keep=1, **{kw: cache})
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t_first = time.perf_counter() - t
            tok = step(cache, tok)
        torch.cuda.synchronize()
        return time.perf_counter() - t, t_first, tok

    def ice_config(reuse):
        return IceCacheConfig(budget=args.budget, reuse=reuse, attention=attention)

    results = []
    for n in args.contexts:
        if time.perf_counter() - start > args.time_limit:
            log(f"skipping {n}: time limit")
            continue
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
        variants = {}
        makers = {"full": ("full (SDPA)", lambda: DynamicCache(config=model.config)),
                  "ice": ("IceCache", lambda: IceCache(ice_config(1), model)),
                  "ice3": ("IceCache reuse=3", lambda: IceCache(ice_config(3), model))}
        for name, make in (makers[k] for k in args.variants):
            cache = make()
            total, first, tok = ttst(cache, ids)
            variants[name] = dict(cache=cache, tok=tok, ttst=total, ttft=first, steps=[])
            log(f"{n}: {name}: TTFT {first:.2f} s, TTST {total:.2f} s")
        with torch.inference_mode():
            for v in variants.values():
                for _ in range(args.warmup):
                    v["tok"] = step(v["cache"], v["tok"])
            torch.cuda.synchronize()
            names = list(variants)
            for rep in range(args.repeats):
                order = names[rep % len(names):] + names[: rep % len(names)]
                for name in order:
                    v = variants[name]
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        v["tok"] = step(v["cache"], v["tok"])
                        torch.cuda.synchronize()
                        v["steps"].append(time.perf_counter() - t)
                log(f"{n}: round {rep + 1}: " + ", ".join(
                    f"{k} {statistics.median(variants[k]['steps'][-args.steps:]) * 1e3:.1f} ms" for k in names))
            # Breakdown pass (device-synced stage boundaries).
            for name, v in variants.items():
                cache = v["cache"]
                if not isinstance(cache, IceCache):
                    continue
                cache.runtime.stats = RuntimeStats()
                cache.runtime.sync_timing = True
                t = time.perf_counter()
                for _ in range(args.profile_steps):
                    v["tok"] = step(cache, v["tok"])
                torch.cuda.synchronize()
                v["profile_total"] = (time.perf_counter() - t) / args.profile_steps
                cache.runtime.sync_timing = False
                s = cache.stats
                v["breakdown"] = {k: getattr(s, k) / args.profile_steps for k in ("select_s", "gather_s", "copy_s", "attend_s")}
                v["pages_loaded"] = s.pages_loaded / args.profile_steps
                v["pages_selected"] = s.pages_selected / args.profile_steps
        for name, v in variants.items():
            cache = v["cache"]
            if isinstance(cache, IceCache):
                nb = cache.nbytes()
            else:
                nb = {"device": sum(2 * l.keys.numel() * l.keys.element_size() for l in cache.layers), "host": 0}
            row = dict(context=n, variant=name, ttft_s=v["ttft"], ttst_s=v["ttst"],
                       tpot_ms=statistics.median(v["steps"]) * 1e3,
                       tpot_ms_per_round=[statistics.median(v["steps"][i * args.steps:(i + 1) * args.steps]) * 1e3
                                          for i in range(args.repeats)],
                       device_kv_bytes=nb["device"], host_bytes=nb["host"])
            for k in ("breakdown", "profile_total", "pages_loaded", "pages_selected"):
                if k in v:
                    row[k] = v[k]
            results.append(row)
            log(json.dumps(row))
        del variants
        torch.cuda.empty_cache()

    head = (f"H200 ({torch.cuda.get_device_name()}), torch {torch.__version__}, transformers "
            f"{transformers.__version__}, icecache {icecache.__version__}; Llama-3.1-8B shape "
            f"({args.layers} layers), random bf16 weights, batch 1; budget {args.budget} (page 16, "
            f"sink 16, window 32, 2 full layers); IceCache attention: {attention}; TPOT median of "
            f"{args.repeats}x{args.steps} interleaved steps after {args.warmup} warm-up steps")
    lines = [head, "",
             "| context | variant | TTST s | TPOT ms | x full | synced pass ms | select | gather | copy | attention | rest | pages loaded/tok | device KV MB | host MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        full = next(x for x in results if x["context"] == r["context"] and x["variant"].startswith("full"))
        ratio = r["tpot_ms"] / full["tpot_ms"]
        if "breakdown" in r:
            b = {k: v * 1e3 for k, v in r["breakdown"].items()}
            p = r["profile_total"] * 1e3
            parts = (f"{p:.1f} | {b['select_s']:.2f} | {b['gather_s']:.2f} | {b['copy_s']:.2f} | "
                     f"{b['attend_s']:.2f} | {p - sum(b.values()):.1f} | {r['pages_loaded']:.0f}")
        else:
            parts = "- | - | - | - | - | - | -"
        lines.append(f"| {r['context']} | {r['variant']} | {r['ttst_s']:.2f} | {r['tpot_ms']:.1f} | {ratio:.2f} | "
                     f"{parts} | {r['device_kv_bytes'] / 2**20:.0f} | {r['host_bytes'] / 2**20:.0f} |")
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump(dict(args=vars(args), attention=attention, results=results), f, indent=1)
        with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(args.out, "bench_gpu.log"), "w") as f:
            f.write("\n".join(log_lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
