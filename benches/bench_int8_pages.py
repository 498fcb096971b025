#!/usr/bin/env python
"""Quantised host pages (``IceCacheConfig(page_format="int8")``, and ``"k8v4"``: 8-bit K, 4-bit V)
on real SmolLM2 attention.

Two measurements, prose and code documents shipped with the package
(``icecache.texts.documents``):

1. Attention output error. SmolLM2-135M's post-RoPE queries, keys and values of every layer
   are captured once per document (``icecache.capture``). For the last ``--queries`` positions
   ``t``, each query head attends every token ``<= t`` causally, as IceCache does with a budget
   that covers the context: the sink (16 first tokens) and the window (32 last) exact, every
   middle token as the quantised stores hold it, dequantised (int8 codes times a float32 scale
   per (KV head, token) row; with ``k8v4`` V as 4-bit codes with a bfloat16 step and minimum
   per 32 values; by the core's quantisers: ``HeadForest.write_pages`` into uint8 stores, read
   back with ``PageStore.tokens``). Reported per layer: the relative L2 error
   ``||O_q - O||_F / ||O||_F`` over the query heads and positions against the exact
   attention output ``O``; for scale, the same error when the middle tokens are only rounded to
   bfloat16 (what a bf16 KV cache costs against float32).
2. Host bytes: ``IceCache.nbytes()["host"]`` after one ``--tokens`` prompt with each page format
   (the model runs in float32 on the CPU, so native pages are float32 here; bf16 pages would be
   half as large), and the page stores' bytes per offloaded token and layer.

    python benches/bench_int8_pages.py [--prose 2] [--code 2] [--tokens 4096] [--queries 64]
        [--formats int8 k8v4]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_index import run_header  # noqa: E402

SINK, WINDOW, PAGE = 16, 32, 16


def dequantised_middle(k: np.ndarray, v: np.ndarray, page_format: str = "int8"):
    """``k``, ``v`` ``[H, n, D]`` float32 through the runtime's quantised page stores and back."""
    import icecache
    import torch
    from icecache.runtime.pages import PageStore

    H, n, D = k.shape
    forest = icecache.HeadForest(k, page_size=PAGE, seed=0, page_format=page_format)
    store = PageStore(H, PAGE, D, torch.float32, page_format)
    store.reserve(forest.max_pages(), 0)
    forest.write_pages(k, v, *store.views())
    kd, vd = store.tokens(torch.float32)
    out_k, out_v = np.empty_like(k), np.empty_like(v)
    for h in range(H):
        page, slot = forest.token_map(h)
        out_k[h] = kd[h, page, slot].numpy()
        out_v[h] = vd[h, page, slot].numpy()
    return out_k, out_v


def attention(q, k, v, positions):
    """Causal attention output of the query rows at ``positions``: ``[H_q, len(positions), D]``."""
    import torch

    q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    Hq, T, D = q.shape
    H = k.shape[0]
    qg = q[:, positions].view(H, Hq // H, len(positions), D)
    logits = torch.einsum("hgqd,htd->hgqt", qg, k) * D**-0.5
    causal = torch.arange(T)[None, :] <= torch.as_tensor(positions)[:, None]
    logits = logits.masked_fill(~causal, float("-inf"))
    return torch.einsum("hgqt,htd->hgqd", torch.softmax(logits, -1), v).reshape(Hq, len(positions), D)


def rel_l2(a, b) -> float:
    return float((a - b).norm() / b.norm())


def bf16_middle(k: np.ndarray, v: np.ndarray):
    """``k``, ``v`` rounded to bfloat16 and back: what a bf16 KV cache costs against float32."""
    import torch

    return tuple(torch.from_numpy(a).bfloat16().float().numpy() for a in (k, v))


def output_errors(model, docs, queries: int, middles: dict) -> dict:
    """Per document and per entry of ``middles``: the relative L2 error of every layer's
    attention output at the last ``queries`` positions when the middle tokens' K and V
    ``[H, n, D]`` go through ``middles[name](k, v) -> (k, v)``."""
    from icecache.capture import capture_qkv

    out = {}
    for name, ids in docs:
        qkv = capture_qkv(model, ids)
        T = len(ids)
        positions = list(range(T - queries, T))
        # Middle of the earliest position measured; later positions' extra window tokens
        # (all <= 63 of them) stay exact, as the runtime keeps them in the window.
        lo, hi = SINK, T - queries - WINDOW
        errs: dict = {m: [] for m in middles}
        for layer in sorted(qkv):
            q, k, v = qkv[layer]
            ref = attention(q, k, v, positions)
            km, vm = np.ascontiguousarray(k[:, lo:hi]), np.ascontiguousarray(v[:, lo:hi])
            for m, through in middles.items():
                kx, vx = k.copy(), v.copy()
                kx[:, lo:hi], vx[:, lo:hi] = through(km, vm)
                errs[m].append(rel_l2(attention(q, kx, vx, positions), ref))
        out[name] = errs
        summary = ", ".join(f"{m} mean {np.mean(e):.2e} max {np.max(e):.2e}" for m, e in errs.items())
        print(f"{name}: {summary}", flush=True)
    return out


def host_bytes(model, ids, formats) -> dict:
    """``IceCache.nbytes()`` after the prompt and one decode step, per page format."""
    import torch
    from icecache.runtime import IceCache, IceCacheConfig
    from icecache.runtime.layer import IceLayer

    res = {}
    for fmt in ("native", *formats):
        cache = IceCache(IceCacheConfig(budget=256, page_format=fmt), model)
        with torch.inference_mode():
            out = model(torch.tensor([ids]), cache=cache, logits_to_keep=1)
            model(out.logits[:, -1:].argmax(-1), cache=cache)
        cache.wait_indexed()
        layers = [x for x in cache.layers if isinstance(x, IceLayer)]
        offloaded = sum(len(x.indexes[0].forest) for x in layers)
        used = sum(
            t[:, : x.indexes[0].forest.max_pages()].numel() * t.element_size()
            for x in layers
            for s in x.stores
            for t in (s.k, s.v)
        )
        res[fmt] = dict(
            host=cache.nbytes()["host"],
            offloaded=offloaded,
            layers=len(layers),
            store_bytes_per_token_layer=used / offloaded,
        )
        del cache
    return res


def prose_and_code(tok, prose: int, code: int, tokens: int, seed: int) -> list:
    """``[(name, ids)]``: ``prose`` novels, then ``code`` modules shipped with the package, of
    ``tokens`` tokens each (``icecache.texts.documents``)."""
    from icecache import texts

    docs = []
    for kind, n in (("prose", prose), ("code", code)):
        if n:
            ids = texts.documents(tok, n, tokens, seed=seed, kind=kind)
            names = texts.document_sources(n, seed=seed, kind=kind)
            docs += [(f"{kind}-{i} {src}", d) for i, (d, src) in enumerate(zip(ids, names))]
    return docs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prose", type=int, default=2)
    ap.add_argument("--code", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=64, help="last positions measured per document")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", nargs="+", default=["int8"], choices=["int8", "k8v4"], help="quantised page formats")
    args = ap.parse_args(argv)
    import torch
    from icecache import models

    torch.set_num_threads(1)
    model, tok = models.load_model("smollm2")
    docs = prose_and_code(tok, args.prose, args.code, args.tokens, args.seed)
    middles = {f: functools.partial(dequantised_middle, page_format=f) for f in args.formats}
    errors = output_errors(model, docs, args.queries, {**middles, "bf16": bf16_middle})
    sizes = host_bytes(model, docs[0][1], args.formats)
    header, _ = run_header("Quantised host pages on SmolLM2-135M", None)
    cols = [*args.formats, "bf16"]
    lines = [
        header,
        "",
        "Attention output error, relative L2, mean over the layers (worst, its layer):",
        "",
        "| document | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]

    def cell(e: list) -> str:
        worst = int(np.argmax(e))
        return f"{np.mean(e):.2e} ({e[worst]:.2e}, {worst})"

    for name, e in errors.items():
        lines.append(f"| {name} | " + " | ".join(cell(e[c]) for c in cols) + " |")
    every = {c: [x for e in errors.values() for x in e[c]] for c in cols}
    n = len(every[cols[0]])
    lines.append(
        f"| all ({n} layer-documents) | "
        + " | ".join(f"{np.mean(every[c]):.2e} ({np.max(every[c]):.2e})" for c in cols)
        + " |"
    )
    lines += [
        "",
        "| page format | IceCache.nbytes() host | store bytes per offloaded token and layer |",
        "|---|---|---|",
    ]
    for fmt, s in sizes.items():
        lines.append(f"| {fmt} | {s['host'] / 2**20:.1f} MiB | {s['store_bytes_per_token_layer']:.1f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
