"""The recall evaluation itself: every method's selection at every budget, and what it keeps of
full attention (recall, middle-only recall, output error); :func:`evaluate_recall` runs it
end to end on captured documents (capture, evaluate, save)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from icecache._util import progress_bar
from icecache.eval.recall.capture import DocQKV, load_or_capture
from icecache.eval.recall.methods import (
    REFERENCE_FOREST_KWARGS,
    Forest,
    Query,
    make_selectors,
    quest_page_bounds,
    resolve_methods,
)
from icecache.eval.recall.report import SAMPLE_FIELDS, RecallResult, layer_ranges, plotting_missing

__all__ = ["DEFAULT_BUDGETS", "evaluate_qkv", "evaluate_recall"]

#: Token budgets evaluated by default.
DEFAULT_BUDGETS: Tuple[int, ...] = (64, 128, 256, 512)


def evaluate_qkv(
    docs: Sequence[DocQKV],
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    methods: Optional[Sequence[str]] = None,
    *,
    diagnostics: bool = False,
    sink: int = 16,
    window: int = 16,
    page_size: int = 16,
    seed: int = 0,
    effort: Optional[float] = None,
    forest_kwargs: Optional[Mapping[str, Any]] = None,
    reference_kwargs: Optional[Mapping[str, Any]] = None,
    threads: Optional[int] = None,
    progress: bool = False,
) -> RecallResult:
    """Evaluate the selection methods on Q/K/V you already have (see :mod:`icecache.eval.recall`).

    Args:
        docs: documents; all must have the same layers and head shapes.
        budgets: token budgets ``B`` (each ``>= sink + window``).
        methods: names from :data:`METHODS` / :data:`DIAGNOSTIC_METHODS`; default
            :data:`METHODS` (plus the diagnostics with ``diagnostics=True``), without the
            HeadForest methods when this build has no ``HeadForest``.
        sink, window, page_size: the protocol's sizes (16 each by default).
        seed: seed of every HeadForest built.
        effort: ``effort`` passed to ``HeadForest.select`` (``None``: the forest's default).
        forest_kwargs: extra ``HeadForest`` arguments of the ``icecache`` configuration.
        reference_kwargs: ``HeadForest`` arguments of the reference configuration (default
            :data:`REFERENCE_FOREST_KWARGS`).
        threads: ``threads`` of every HeadForest (``None``: all cores).
        progress: tqdm bar over (document, layer) on stderr.
    """
    methods = resolve_methods(methods, diagnostics)
    budgets = [int(b) for b in budgets]
    if not budgets or len(set(budgets)) != len(budgets):
        raise ValueError("budgets must be distinct and non-empty")
    if min(budgets) < sink + window:
        raise ValueError(f"every budget must be >= sink + window = {sink + window}")
    if not docs:
        raise ValueError("no documents")
    layers = sorted(docs[0].layers)
    for d in docs:
        if sorted(d.layers) != layers:
            raise ValueError("all documents must have the same layers")
    q0, k0, _ = docs[0].layers[layers[0]]
    H_q, _, D = q0.shape
    H_kv = k0.shape[0]
    if H_q % H_kv:
        raise ValueError(f"{H_q} query heads are not a multiple of {H_kv} KV heads")
    G = H_q // H_kv
    for d in docs:
        pos = np.asarray(d.positions)
        T = d.layers[layers[0]][1].shape[1]
        if pos.size == 0 or np.any(np.diff(pos) <= 0) or pos.min() + 1 < sink + window or pos.max() >= T:
            raise ValueError(f"query positions must increase and lie in [{sink + window - 1}, {T})")
        for layer in layers:
            q, k, v = d.layers[layer]
            if q.shape != (H_q, pos.size, D) or k.shape != (H_kv, T, D) or v.shape[:2] != (H_kv, T):
                raise ValueError(f"layer {layer}: shapes q {q.shape}, k {k.shape}, v {v.shape} do not match")

    n_samples = sum(len(d.positions) for d in docs)
    shape = (len(methods), len(budgets), len(layers), H_kv, n_samples)
    arrays = {f: np.full(shape, np.nan) for f in SAMPLE_FIELDS}
    extras = [b - sink - window for b in budgets]
    page_allow = [e // page_size for e in extras]
    scale = 1.0 / math.sqrt(D)
    timings: Dict[str, float] = {"forest_build_s": 0.0, "select_s": 0.0}
    fkw = dict(forest_kwargs or {})
    rkw = dict(REFERENCE_FOREST_KWARGS if reference_kwargs is None else reference_kwargs)
    configs = {"default": fkw, "reference": rkw}

    selectors = make_selectors(scale, effort, timings)

    t_start = time.perf_counter()
    bar = progress_bar(total=len(docs) * len(layers), desc="evaluate", enable=progress)
    try:
        s0 = 0
        for d in docs:
            pos = np.asarray(d.positions, np.int64)
            for li, layer in enumerate(layers):
                q, k, v = d.layers[layer]
                _eval_layer(
                    np.asarray(q, np.float32),
                    np.asarray(k, np.float32),
                    np.asarray(v, np.float64),
                    pos,
                    methods,
                    selectors,
                    extras,
                    page_allow,
                    sink,
                    window,
                    page_size,
                    scale,
                    seed,
                    threads,
                    configs,
                    timings,
                    arrays,
                    li,
                    s0,
                )
                bar.update(1)
            s0 += len(pos)
    finally:
        bar.close()
    timings["evaluate_s"] = time.perf_counter() - t_start

    # The budget holds per (layer, step) over the KV heads: adaptive budgets move pages between them.
    over = arrays["charged"].mean(3) + sink + window > np.asarray(budgets)[None, :, None, None] + 1e-9
    if np.any(over):
        raise AssertionError("a selection was charged more than its budget")  # never: checked by tests
    arrays["charged"] = arrays["charged"] + sink + window
    return RecallResult(
        methods=methods,
        budgets=budgets,
        layers=layers,
        n_kv_heads=H_kv,
        group=G,
        sink=sink,
        window=window,
        page_size=page_size,
        n_docs=len(docs),
        positions=[[int(x) for x in d.positions] for d in docs],
        timings=timings,
        info=dict(seed=seed, effort=effort, forest_kwargs=fkw, reference_kwargs=rkw, n_samples=n_samples),
        **arrays,
    )


def _eval_layer(
    q,
    k,
    v,
    pos,
    methods,
    selectors,
    extras,
    page_allow,
    sink,
    window,
    page,
    scale,
    seed,
    threads,
    configs,
    timings,
    arrays,
    li,
    s0,
):
    """All queries of one (document, layer): fills ``arrays[:, :, li, :, s0:s0 + nq]``.

    The big products (logits, full and sink+window attention outputs of all queries) are three
    einsums per layer; per query and method only the selected tokens are touched. Everything
    uses ``einsum``, not ``matmul``: multi-threaded BLAS on these small products was several
    times slower on 2 cores (its spinning threads fight the HeadForest build threads).
    """
    H_q, nq, D = q.shape
    H_kv, T, _ = k.shape
    G = H_q // H_kv
    qg = q.reshape(H_kv, G, nq, D)
    raw_all = np.einsum("hgqd,htd->hgqt", qg, k)  # [H_kv, G, nq, T] raw q.k
    ar = np.arange(T)
    n_ctx = pos + 1
    M = n_ctx - window  # per query: window [M, t], middle [sink, M)
    in_ctx = ar[None, :] < n_ctx[:, None]  # [nq, T]
    in_base = in_ctx & ((ar[None, :] < sink) | (ar[None, :] >= M[:, None]))
    lg = np.where(in_ctx, raw_all.astype(np.float64) * scale, -np.inf)
    lg -= lg.max(-1, keepdims=True)
    p = np.exp(lg)
    p /= p.sum(-1, keepdims=True)  # [H_kv, G, nq, T]: softmax over each query's context
    del lg
    o_full = np.einsum("hgqt,htd->hgqd", p, v)  # [H_kv, G, nq, D]
    p_base = p * in_base
    base_mass = p_base.sum(-1)  # [H_kv, G, nq]
    base_num = np.einsum("hgqt,htd->hgqd", p_base, v)
    mid_tot = (1.0 - base_mass).sum(1)  # [H_kv, nq]: the group's middle mass
    del p_base
    # Quest's positional page bounds: pages [sink + page*j, sink + page*(j+1)) are the same for
    # every query; only the last (partial) page of a query's middle needs its own bound.
    full_bounds = quest_page_bounds(k[:, sink : sink + (T - sink) // page * page], page)
    need_quest = any(m in ("quest", "quest_pagemass") for m in methods)

    for qi in range(nq):
        Mq = int(M[qi])
        n_mid = Mq - sink
        p_mid = p[:, :, qi, sink:Mq]  # [H_kv, G, n_mid]
        v_mid = v[:, sink:Mq]
        k_mid = np.ascontiguousarray(k[:, sink:Mq])
        kbounds = quest_page_bounds(k_mid, page, full_bounds) if need_quest else None
        built: Dict[str, Forest] = {}

        def forests(config: str, k_mid=k_mid, n_mid=n_mid, built=built) -> Forest:
            if config not in built:
                import icecache

                t0 = time.perf_counter()
                hf = icecache.HeadForest(k_mid, page_size=page, seed=seed, threads=threads, **configs[config])
                built[config] = Forest(hf, n_mid)
                timings["forest_build_s"] += time.perf_counter() - t0
            return built[config]

        bm = base_mass[:, :, qi]
        ctx = Query(qg[:, :, qi], k_mid, raw_all[:, :, qi, sink:Mq], p_mid, bm, kbounds, page, forests)
        bn, of = base_num[:, :, qi], o_full[:, :, qi]
        of_norm = np.maximum(np.linalg.norm(of, axis=-1), 1e-30)
        mt = mid_tot[:, qi]
        for mi, m in enumerate(methods):
            if n_mid == 0:
                sels = [([np.zeros(0, np.int64)] * H_kv, np.zeros(H_kv), np.zeros(H_kv))] * len(extras)
            else:
                sels = selectors[m](ctx, extras, page_allow)
            for bi, (toks, npages, charged) in enumerate(sels):
                sel_mass = np.empty((H_kv, G))
                sel_num = np.empty((H_kv, G, D))
                for h in range(H_kv):
                    idx = toks[h]
                    ph = p_mid[h][:, idx]
                    sel_mass[h] = ph.sum(-1)
                    sel_num[h] = np.einsum("gn,nd->gd", ph, v_mid[h][idx])
                mass = bm + sel_mass
                o_sel = (bn + sel_num) / mass[..., None]
                err = np.linalg.norm(o_sel - of, axis=-1) / of_norm
                sl = (mi, bi, li, slice(None), s0 + qi)
                arrays["recall"][sl] = mass.mean(-1)
                arrays["middle_recall"][sl] = np.where(mt > 1e-12, sel_mass.sum(-1) / np.maximum(mt, 1e-300), 1.0)
                arrays["output_error"][sl] = err.mean(-1)
                arrays["pages"][sl] = npages
                arrays["tokens"][sl] = [len(x) for x in toks]
                arrays["charged"][sl] = charged


def evaluate_recall(
    n_docs: int = 2,
    n_tokens: int = 8000,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    layers: Optional[Sequence[int]] = None,
    *,
    n_queries: int = 16,
    query_frac: float = 0.05,
    methods: Optional[Sequence[str]] = None,
    diagnostics: bool = False,
    sink: int = 16,
    window: int = 16,
    page_size: int = 16,
    model: str = "smollm2",
    seed: int = 0,
    kind: str = "prose",
    effort: Optional[float] = None,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    out_dir: Optional[Union[str, os.PathLike]] = None,
    plot: bool = True,
    progress: bool = True,
) -> RecallResult:
    """Attention-mass recall of the selection methods on real SmolLM2 Q/K/V (see :mod:`icecache.eval.recall`).

    Captures (or loads from the cache) ``n_docs`` real documents of ``n_tokens`` tokens, then
    runs :func:`evaluate_qkv`. With ``out_dir`` it writes ``recall_table.md``,
    ``recall.json`` and then (with ``plot``) ``recall_vs_budget.png`` there. A plot that needs
    a missing matplotlib raises ``ImportError`` before any work.

    Args:
        layers: layers to evaluate; default every layer >= 2.
        n_queries, query_frac: query positions (:func:`query_positions`).
        Others: see :func:`evaluate_qkv` and :func:`load_or_capture`.

    Returns:
        The :class:`RecallResult` (``.to_markdown()`` is the table).
    """
    if out_dir is not None and plot:
        missing = plotting_missing()
        if missing is not None:
            raise ImportError(f"the recall plot needs what is missing: {missing}; or pass plot=False")
    t0 = time.perf_counter()
    docs = load_or_capture(
        n_docs,
        n_tokens,
        n_queries=n_queries,
        query_frac=query_frac,
        layers=None,
        model=model,
        seed=seed,
        kind=kind,
        cache_dir=cache_dir,
        progress=progress,
    )
    all_layers = sorted(docs[0].layers)
    if layers is None:
        layers = [layer for layer in all_layers if layer >= 2]
    layers = sorted({int(layer) for layer in layers})
    bad = [layer for layer in layers if layer not in docs[0].layers]
    if bad:
        raise ValueError(f"{model} has no layer(s) {bad}; layers are {layer_ranges(all_layers)}")
    for d in docs:
        d.layers = {layer: d.layers[layer] for layer in layers}
    t_cap = time.perf_counter() - t0
    res = evaluate_qkv(
        docs,
        budgets,
        methods,
        diagnostics=diagnostics,
        sink=sink,
        window=window,
        page_size=page_size,
        seed=seed,
        effort=effort,
        progress=progress,
    )
    res.timings["capture_or_load_s"] = t_cap
    res.timings["total_s"] = time.perf_counter() - t0
    res.info.update(model=model, kind=kind, n_tokens=n_tokens, n_queries=n_queries, query_frac=query_frac)
    if out_dir is not None:
        out = Path(out_dir)
        res.save_table(out / "recall_table.md")
        res.save_json(out / "recall.json")
        if plot:
            res.save_plot(out / "recall_vs_budget.png")
    return res
