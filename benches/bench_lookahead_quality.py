#!/usr/bin/env python
"""Look-ahead selection against fresh selection on real attention: SmolLM2 Q/K/V, prose and code.

For each document (``--prose`` Jane Austen documents, ``--code`` CPython standard-library
modules, both shipped with the package: ``icecache.texts.documents(seed=1)``), SmolLM2-135M's
post-RoPE queries, keys and values are captured once (cached in ``~/.cache/icecache/lookahead``).
Then for every layer from 2 on and four runs of 16 consecutive decode positions near the end,
the runtime's protocol is replayed:

- one forest (``HeadForest``, default configuration) over the middle tokens ``[16, M)``; the
  window ``[M, t]`` grows from 16 to 31 tokens over the run (as the runtime's window does
  between flushes); budget 256 = sink 16 + window + 13 pages of 16;
- ``fresh``: ``HeadForest.select`` with the query of step ``t`` (13 pages);
- ``pagemass``: all pages ranked by their true group attention mass (the best any ranking of
  this page layout can do);
- look-ahead ``(superset, refresh, pool, successors)``: every ``refresh`` steps the superset is
  selected with the query of step ``t - 1`` (``successors`` as in ``HeadForest.select``) into a
  pool of ``pool`` pages per KV head (least recently selected evicted); the device's ranking is
  replayed exactly: each query head's softmax over the resident, sink and window tokens, summed
  over the group and the page, and the 13 heaviest pages are attended;
- ``adaptive`` (after ``pagemass`` and each look-ahead): ``budget_mode="adaptive"``, the
  ``3 x 13`` pages of all KV heads with the largest shares of their head's mass.

Metrics per (layer, KV head, step), averaged over the group's query heads: recall (the share of
the full softmax mass on sink + window + attended pages) and middle-only recall (the share of the
middle's mass on the attended pages). Reported: the mean over everything, per document, and the
spread over layers.

    python benches/bench_lookahead_quality.py [--prose 3] [--code 3] [--tokens 6000]
        [--configs 52,1,65,32,1.5,1 52,1,65,32 52,1,65,0 52,2,65,32,1.5,1]

A config is ``superset,refresh,pool,successors[,effort[,group_view]]``: ``effort`` scales the
field of view (``HeadForest.select``'s ``effort``, default 1) and a last field of 1 makes the
query heads of each GQA group share one field of view (``group_view``). The runtime's defaults
are ``52,1,65,32,1.5,1`` (the first default config).

``--grown F``: every forest is built over the first ``F`` of its middle only and the rest is
inserted 16 tokens at a time (``HeadForest.insert``, as the runtime's window flushes them), so
that a run with ``--grown`` against one without measures what the decode-time inserts cost.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

SINK, PAGE, PAGES, STEPS = 16, 16, 13, 16


def capture(name: str, ids, model, cache_dir: Path) -> dict:
    """Q (last 400 positions), K, V of every layer for one document, cached (by name and
    length: ``--tokens`` changes the documents)."""
    path = cache_dir / f"{name}-{len(ids)}.npz"
    if not path.exists():
        from icecache.capture import capture_qkv

        data = capture_qkv(model, list(ids))
        layers = sorted(data)
        T = len(ids)
        q = np.stack([data[ly][0][:, T - 400 :] for ly in layers]).astype(np.float32)
        k = np.stack([data[ly][1] for ly in layers]).astype(np.float16)
        v = np.stack([data[ly][2] for ly in layers]).astype(np.float16)
        tmp = path.with_suffix(".part.npz")
        np.savez(tmp, q=q, k=k, v=v, qstart=T - 400)
        os.replace(tmp, path)
    z = np.load(path)
    return {"q": z["q"], "k": z["k"].astype(np.float32), "qstart": int(z["qstart"])}


def softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


class Step:
    """One decode position of one (document, layer): the full attention of its queries."""

    def __init__(self, q, keys, tokens, M, t, scale):
        Hkv, G, D = keys.shape[0], q.shape[0] // keys.shape[0], q.shape[1]
        self.logits = (q.reshape(Hkv, G, D) @ keys[:, : t + 1].transpose(0, 2, 1)) * scale
        self.p = softmax(self.logits)
        dense = np.zeros(t + 1, bool)
        dense[:SINK] = True
        dense[M:] = True
        self.dense_mass, self.dense_idx = self.p[..., dense].sum(-1), np.flatnonzero(dense)
        self.tokens = tokens

    def score(self, chosen):
        """(recall, middle-only recall) of attending sink + window + ``chosen[h]`` pages."""
        rec, mid = [], []
        for h, pages in enumerate(chosen):
            idx = np.concatenate([self.tokens[h][pg] for pg in pages]) if len(pages) else []
            m = self.p[h][:, idx].sum(-1)
            rec.append((self.dense_mass[h] + m).mean())
            mid.append(m.sum() / (1 - self.dense_mass[h]).sum())
        return np.mean(rec), np.mean(mid)

    def device_rank(self, resident, adaptive=False):
        """The device's choice among ``resident[h]`` pages, by exact group mass: each head's
        ``PAGES`` heaviest, or (``adaptive``) the ``H * PAGES`` pages of all heads with the
        largest shares of their head's resident mass (``budget_mode="adaptive"``)."""
        ranked, shares = [], []
        for h, pages in enumerate(sorted(r) for r in resident):
            if not pages:
                ranked.append([])
                shares.append(np.zeros(0))
                continue
            idx = np.concatenate([self.tokens[h][pg] for pg in pages] + [self.dense_idx])
            owner = np.concatenate([np.full(len(self.tokens[h][pg]), i) for i, pg in enumerate(pages)])
            w = softmax(self.logits[h][:, idx]).sum(0)[: len(owner)]
            mass = np.bincount(owner, weights=w, minlength=len(pages))
            order = np.argsort(-mass, kind="stable")
            ranked.append([pages[i] for i in order])
            shares.append(mass[order] / max(mass.sum(), 1e-300))
        if not adaptive:
            return [r[:PAGES] for r in ranked]
        heads = np.concatenate([np.full(len(x), h) for h, x in enumerate(shares)])
        best = np.argsort(-np.concatenate(shares), kind="stable")[: len(ranked) * PAGES]
        take = np.bincount(heads[best], minlength=len(ranked))
        return [r[:n] for r, n in zip(ranked, take)]


def make_forest(keys: np.ndarray, grown: float):
    """A ``HeadForest`` over ``keys`` ``[H_kv, n, D]``: built at once, or (``grown`` < 1) over
    the first ``grown`` of them with the rest inserted a page of tokens at a time."""
    import icecache

    if grown >= 1:
        return icecache.HeadForest(np.ascontiguousarray(keys), page_size=PAGE, seed=0)
    H, n, D = keys.shape
    n0 = max(PAGE, int(n * grown))
    forest = icecache.HeadForest(np.ascontiguousarray(keys[:, :n0]), page_size=PAGE, seed=0)
    # Room for a new page per inserted token, the most inserts can open.
    k_store = np.zeros((H, forest.max_pages() + n - n0, PAGE, D), np.float32)
    v_store = np.zeros_like(k_store)
    forest.write_pages(np.ascontiguousarray(keys[:, :n0]), np.ascontiguousarray(keys[:, :n0]), k_store, v_store)
    for a in range(n0, n, PAGE):
        part = np.ascontiguousarray(keys[:, a : a + PAGE])
        forest.insert(part, part, k_store, v_store)
    return forest


def run_doc(doc: dict, configs, scores: dict, name: str, grown: float = 1.0) -> None:
    Q, K, qstart = doc["q"], doc["k"], doc["qstart"]
    n_layers, Hq, _, D = Q.shape
    Hkv, T = K.shape[1], K.shape[2]
    scale = D**-0.5
    for layer in range(2, n_layers):
        out = scores.setdefault(name, {}).setdefault(layer, {})
        for start in (T - 380, T - 290, T - 200, T - 110):
            M = start - 15
            forest = make_forest(K[layer][:, SINK:M], grown)
            tokens = [[forest.page_tokens(h, p) + SINK for p in range(forest.num_pages(h))] for h in range(Hkv)]
            pools = {c: [dict() for _ in range(Hkv)] for c in configs}
            for step, t in enumerate(range(start, start + STEPS)):
                q = Q[layer][:, t - qstart]
                s = Step(q, K[layer], tokens, M, t, scale)
                fresh, counts = forest.select(np.ascontiguousarray(q), PAGES, scale=scale)
                out.setdefault("fresh", []).append(s.score([fresh[h, : counts[h]] for h in range(Hkv)]))
                everything = [set(range(forest.num_pages(h))) for h in range(Hkv)]
                out.setdefault("pagemass", []).append(s.score(s.device_rank(everything)))
                out.setdefault("pagemass adaptive", []).append(s.score(s.device_rank(everything, True)))
                for c in configs:
                    superset, refresh, pool, successors, effort, group_view = c
                    if step % refresh == 0:
                        prev = np.ascontiguousarray(Q[layer][:, t - 1 - qstart])
                        sel, cnt = forest.select(
                            prev, superset, scale=scale, successors=successors, effort=effort, group_view=group_view
                        )
                        for h in range(Hkv):
                            resident = pools[c][h]
                            for pg in sel[h, : cnt[h]]:
                                resident[int(pg)] = step
                            while len(resident) > pool:
                                del resident[min(resident, key=resident.get)]
                    key = f"look-ahead superset {c[0]} refresh {c[1]} pool {c[2]} successors {c[3]}"
                    key += f" effort {effort:g}" if effort != 1 else ""
                    key += " group view" if group_view else ""
                    out.setdefault(key, []).append(s.score(s.device_rank(pools[c])))
                    out.setdefault(f"{key} adaptive", []).append(s.score(s.device_rank(pools[c], True)))


def parse_config(text: str) -> tuple:
    """``superset,refresh,pool,successors[,effort[,group_view]]`` (effort 1 and no group view
    unless given)."""
    parts = text.split(",")
    if not 4 <= len(parts) <= 6:
        raise SystemExit(f"--configs: {text!r} is not superset,refresh,pool,successors[,effort[,group_view]]")
    superset, refresh, pool, successors = (int(x) for x in parts[:4])
    effort = float(parts[4]) if len(parts) > 4 else 1.0
    group_view = len(parts) > 5 and parts[5] not in ("0", "")
    return superset, refresh, pool, successors, effort, group_view


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prose", type=int, default=3)
    ap.add_argument("--code", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--configs", nargs="+", default=["52,1,65,32,1.5,1", "52,1,65,32", "52,1,65,0", "52,2,65,32,1.5,1"])
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "icecache" / "lookahead"))
    ap.add_argument("--grown", type=float, default=1.0, help="build over this share of each middle, insert the rest")
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs]
    cache_dir = Path(args.cache)
    cache_dir.mkdir(parents=True, exist_ok=True)

    from icecache import models, texts

    model, tok = models.load_model("smollm2")
    prose = texts.documents(tok, args.prose, args.tokens, seed=1)
    docs = [(f"prose{i}of{args.prose}", ids) for i, ids in enumerate(prose)]
    if args.code:
        code = texts.documents(tok, args.code, args.tokens, seed=1, kind="code")
        docs += [(f"code{i}of{args.code}", ids) for i, ids in enumerate(code)]
    scores: dict = {}  # document -> layer -> selection -> [(recall, middle-only)]
    for name, ids in docs:
        print(f"{name}: capture and replay ...", file=sys.stderr, flush=True)
        run_doc(capture(f"{name}-{args.tokens}", ids, model, cache_dir), configs, scores, name, args.grown)

    print(f"SmolLM2-135M, {len(docs)} documents of {args.tokens} tokens ({', '.join(n for n, _ in docs)}),")
    print(f"layers 2+, 4 runs of {STEPS} steps; budget 256 (sink 16 + window 16..31 + {PAGES} pages of {PAGE})")
    if args.grown < 1:
        print(f"forests built over the first {args.grown:g} of each middle, the rest inserted")
    print("| selection | recall | middle-only | vs fresh | middle vs fresh | per document (recall / middle) | worst |")
    print("|---|---|---|---|---|---|---|")
    keys = list(next(iter(next(iter(scores.values())).values())))

    def values(key, doc=None, layer=None):
        return np.array(
            [
                v
                for n, d in scores.items()
                if doc in (None, n)
                for ly, r in d.items()
                if layer in (None, ly)
                for v in r[key]
            ]
        )

    base = values("fresh").mean(0)
    for key in keys:
        m = values(key).mean(0)
        per_doc = "; ".join("{} {:.3f} / {:.3f}".format(n, *values(key, doc=n).mean(0)) for n in scores)
        layers = sorted({ly for d in scores.values() for ly in d})
        worst = min((values(key, layer=ly).mean(0)[1], ly) for ly in layers)
        print(
            f"| {key} | {m[0]:.4f} | {m[1]:.4f} | {m[0] - base[0]:+.4f} | {m[1] - base[1]:+.4f} | {per_doc} | "
            f"layer {worst[1]} (middle {worst[0]:.3f}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
