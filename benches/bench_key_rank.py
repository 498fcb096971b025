#!/usr/bin/env python
"""How much of the keys' ranking lives in their top principal dimensions: a study for selection
scans that read only part of each key row.

At batch 8 the look-ahead worker's selection is bound by the key rows it reads (8-bit rows of
``d`` bytes, every key of a field of view). Keys stored in each (layer, KV head)'s principal
basis (the eigenvectors of their second moment ``K^T K / n``, largest first) would let a scan read
the first ``r`` dimensions of each row only. This measures what that costs in selection quality,
on real SmolLM2 queries and keys (no quantisation, no pages: the ranking alone):

- energy: the share of the keys' second moment in the top ``r`` dimensions;
- recall: for each of the last ``--queries`` positions of a document and each query head, the
  exact attention mass of the ``--budget`` keys chosen, against the best ``--budget`` keys
  (the oracle). Chosen either directly by the estimate from the top ``r`` dimensions, or (with
  ``--superset S``) as the best ``--budget`` by exact score among the ``S`` keys with the best
  estimates, as a device that ranks a loaded superset exactly would.

With ``--int8`` the estimates come from 8-bit rows with one scale per row, as the page stores
hold them: the rotated rows for the top ``r`` dimensions, and (row "all, unrotated") the rows as
stored today, whose estimate the scan computes now; it also reports each one's relative error
of the reconstructed keys (what the device would attend).

Layers 0 and 1 are left out (the runtime's full-cache layers by default), and a model's
sliding-window layers (Gemma's), whose cache is not IceCache's. Prose and code documents of
``--tokens`` tokens (the shipped texts, seed 11).

    python benches/bench_key_rank.py [--model smollm2|gemma3] [--tokens 4096] [--docs 2] \
        [--budget 256] [--superset 768] [--dims 8 16 24 32]
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=2, help="documents of each kind (prose, code)")
    ap.add_argument("--queries", type=int, default=16, help="last positions queried per document")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--superset", type=int, default=None, help="default: the budget (no exact re-rank)")
    ap.add_argument("--dims", type=int, nargs="+", default=[8, 16, 24, 32])
    ap.add_argument("--int8", action="store_true", help="estimate from 8-bit rows (one scale per row)")
    args = ap.parse_args(argv)
    superset = args.superset or args.budget
    if superset < args.budget:
        raise SystemExit("--superset must be at least --budget")

    from icecache.capture import capture_qkv
    from icecache.models import load_model
    from icecache.texts import documents

    model, tokenizer = load_model(args.model)
    cfg = model.config
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    served = [i for i, kind in enumerate(kinds) if i >= 2 and kind == "full_attention"]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scale = dim**-0.5
    dims = list(args.dims) + ([0] if args.int8 else [])  # 0: every dimension, unrotated
    recall: dict = {r: [] for r in dims}  # (kind, layer, recall / oracle)
    energy: dict = {r: [] for r in dims}
    error: dict = {r: [] for r in dims}  # relative error of the reconstructed keys

    def int8_rows(x):
        """Rows rounded to 8 bits with one scale per row, as stored; and back."""
        step = np.abs(x).max(axis=1, keepdims=True) / 127
        step[step == 0] = 1
        return np.round(x / step) * step

    for kind in ("prose", "code"):
        for ids in documents(tokenizer, args.docs, args.tokens, seed=11, kind=kind):
            for layer, (q, k, _) in sorted(capture_qkv(model, ids, served).items()):
                for h in range(k.shape[0]):
                    keys = k[h, 1:]  # the attention sink left out
                    w, basis = np.linalg.eigh(keys.T @ keys / len(keys))
                    w, basis = w[::-1], basis[:, ::-1]
                    for r in args.dims:
                        energy[r].append(w[:r].sum() / w.sum())
                    rotated = keys @ basis
                    plain = keys
                    if args.int8:
                        rotated, plain = int8_rows(rotated), int8_rows(keys)
                        norm = np.linalg.norm(keys)
                        for r in args.dims:
                            error[r].append(np.linalg.norm(rotated @ basis.T - keys) / norm)
                        error[0].append(np.linalg.norm(plain - keys) / norm)
                        energy[0].append(1.0)
                    for g in range(group):
                        for t in range(args.tokens - args.queries, args.tokens):
                            query = q[h * group + g, t]
                            seen = keys[: t - 1]
                            s = seen @ query * scale
                            p = np.exp(s - s.max())
                            p /= p.sum()
                            best = np.sort(p)[-args.budget :].sum()
                            qr = basis.T @ query
                            for r in dims:
                                est = plain[: t - 1] @ query if r == 0 else rotated[: t - 1, :r] @ qr[:r]
                                chosen = np.argpartition(est, -superset)[-superset:]
                                got = np.sort(p[chosen])[-args.budget :].sum()
                                recall[r].append((kind, layer, got / best))
            print(f"{kind} document done", flush=True)
    print(
        f"{args.model}, head dim {dim}, {args.docs} prose and {args.docs} code documents of {args.tokens} tokens, "
        f"budget {args.budget}, superset {superset}"
    )
    print(
        "| dims | energy mean (min) | recall / oracle: mean | prose | code | 10th percentile | worst layer "
        "| key error (int8) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in dims:
        a = np.array([x for _, _, x in recall[r]])
        by_layer: dict = {}
        for _, layer, x in recall[r]:
            by_layer.setdefault(layer, []).append(x)
        worst = min(by_layer, key=lambda i: float(np.mean(by_layer[i])))
        prose = np.mean([x for kind, _, x in recall[r] if kind == "prose"])
        code = np.mean([x for kind, _, x in recall[r] if kind == "code"])
        err = f"{np.mean(error[r]):.4f}" if error[r] else "-"
        name = f"{r} of {dim}" if r else f"all {dim}, unrotated"
        print(
            f"| {name} | {np.mean(energy[r]):.3f} ({np.min(energy[r]):.3f}) | {a.mean():.4f} | {prose:.4f} "
            f"| {code:.4f} | {np.percentile(a, 10):.3f} | {worst}: {np.mean(by_layer[worst]):.4f} | {err} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
