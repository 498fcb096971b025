"""The KV selection methods that the recall evaluation compares (see :mod:`icecache.eval.recall`).

Every method selects once per KV head for the group's query heads, at every budget at once:
token-granular ones (``oracle``, ``streamingllm``) get middle tokens, page-based ones pages.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "DIAGNOSTIC_METHODS",
    "METHODS",
    "METHOD_LABELS",
    "REFERENCE_FOREST_KWARGS",
    "Forest",
    "Query",
    "Selection",
    "Selector",
    "resolve_methods",
    "make_selectors",
    "quest_page_bounds",
]

#: Methods evaluated by default (see :mod:`icecache.eval.recall`).
METHODS: Tuple[str, ...] = (
    "oracle",
    "quest",
    "streamingllm",
    "icecache",
    "icecache_ranked",
    "icecache_adaptive",
    "reference",
)
#: Extra methods for investigating IceCache's losses.
DIAGNOSTIC_METHODS: Tuple[str, ...] = (
    "icecache_pagemass",
    "icecache_maxkey",
    "reference_pagemass",
    "quest_pagemass",
)
#: Human-readable names for tables and plots.
METHOD_LABELS: Dict[str, str] = {
    "oracle": "oracle (tokens)",
    "quest": "Quest",
    "streamingllm": "StreamingLLM",
    "icecache": "IceCache",
    "icecache_ranked": "IceCache, superset ranked on device",
    "icecache_adaptive": "IceCache, adaptive budgets",
    "reference": "IceCache ref. config",
    "icecache_pagemass": "IceCache pages, true-mass ranking",
    "icecache_maxkey": "IceCache pages, max-key round-robin",
    "reference_pagemass": "ref. config pages, true-mass ranking",
    "quest_pagemass": "positional pages, true-mass ranking",
}
# Which HeadForest configuration each forest-based method uses.
_FOREST_OF = {
    "icecache": "default",
    "icecache_ranked": "default",
    "icecache_adaptive": "default",
    "icecache_pagemass": "default",
    "icecache_maxkey": "default",
    "reference": "reference",
    "reference_pagemass": "reference",
}
#: HeadForest keyword arguments of the IceCache reference configuration.
REFERENCE_FOREST_KWARGS: Dict[str, Any] = dict(num_simple=1, num_composite=1, promotion=[0.01, 0.2, 0.2])


def quest_page_bounds(
    k_mid: np.ndarray, page_size: int, full: Optional[Tuple[np.ndarray, np.ndarray]] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Quest's key bounds of the positional pages of a middle ``[H_kv, n_mid, D]``: the
    elementwise min and max of each page's keys, ``(kmin, kmax)`` of ``[H_kv, P, D]`` with
    ``P = ceil(n_mid / page_size)`` (the last page may be partial).

    ``full``: the bounds of the full pages of a middle that starts at the same token and is at
    least as long (pages are positional, so its first pages are this one's); then only the
    partial last page is computed here.
    """
    H, n, D = k_mid.shape
    nf = n // page_size
    if full is None:
        pages = k_mid[:, : nf * page_size].reshape(H, nf, page_size, D)
        kmin, kmax = pages.min(2), pages.max(2)
    else:
        kmin, kmax = full[0][:, :nf], full[1][:, :nf]
    if n % page_size:
        tail = k_mid[:, nf * page_size :]
        kmin = np.concatenate([kmin, tail.min(1, keepdims=True)], axis=1)
        kmax = np.concatenate([kmax, tail.max(1, keepdims=True)], axis=1)
    return kmin, kmax


class Query:
    """Everything the methods need about one (layer, query position): all KV heads at once."""

    def __init__(self, qg, k_mid, raw_mid, p_mid, base_mass, kbounds, page_size, forests):
        self.qg = qg  # [H_kv, G, D] float32 queries of each group
        self.k_mid = k_mid  # [H_kv, n_mid, D] float32 middle keys
        self.raw_mid = raw_mid  # [H_kv, G, n_mid] raw q.k of the middle
        self.p_mid = p_mid  # [H_kv, G, n_mid] full-context softmax weights of the middle
        self.base_mass = base_mass  # [H_kv, G] full-context softmax mass of sink + window
        self.kbounds = kbounds  # (kmin, kmax) [H_kv, P, D] of the positional pages
        self.page = page_size
        self.forests = forests  # callable: config name -> Forest (built lazily)
        self.n_kv, self.n_mid = k_mid.shape[0], k_mid.shape[1]


class Forest:
    """A HeadForest over one query's middle, with each head's page -> tokens map."""

    def __init__(self, hf: Any, n_mid: int):
        self.hf = hf
        self.page_of: List[np.ndarray] = []
        self.order: List[np.ndarray] = []
        self.starts: List[np.ndarray] = []
        self.page_ids: List[np.ndarray] = []
        self.sizes: List[np.ndarray] = []
        for h in range(hf.num_heads):
            page, _slot = hf.token_map(h)
            page = np.asarray(page, dtype=np.int64)
            if page.shape != (n_mid,) or (n_mid and page.min() < 0):
                raise RuntimeError(f"HeadForest.token_map({h}) does not map all {n_mid} tokens to pages")
            order = np.argsort(page, kind="stable")
            sp = page[order]
            starts = np.flatnonzero(np.r_[True, sp[1:] != sp[:-1]]) if n_mid else np.zeros(0, np.int64)
            sizes = np.diff(np.r_[starts, n_mid])
            if sizes.size and sizes.max() > hf.page_size:
                raise RuntimeError(f"HeadForest head {h} has a page of {sizes.max()} > page_size tokens")
            self.page_of.append(page)
            self.order.append(order)
            self.starts.append(starts)
            self.page_ids.append(sp[starts])
            self.sizes.append(sizes)

    def tokens(self, h: int, pages: np.ndarray) -> np.ndarray:
        """Middle indices of the tokens in ``pages`` of head ``h``."""
        if len(pages) == 0:
            return np.zeros(0, np.int64)
        return np.flatnonzero(np.isin(self.page_of[h], pages))

    def page_reduce(self, h: int, per_token: np.ndarray, ufunc) -> np.ndarray:
        """``ufunc.reduceat`` of ``per_token [..., n_mid]`` over each non-empty page of head ``h``."""
        return ufunc.reduceat(per_token[..., self.order[h]], self.starts[h], axis=-1)


#: One method's choice at one budget: per KV head the middle indices attended, then the pages
#: per KV head (NaN for token methods) and the budget charged per KV head (the adaptive method
#: charges some heads more than the budget and others less; never more in all).
Selection = Tuple[List[np.ndarray], np.ndarray, np.ndarray]
#: A method: ``(query, middle tokens per budget, pages per budget) -> one Selection per budget``.
Selector = Callable[[Query, Sequence[int], Sequence[int]], List[Selection]]


def _round_robin(rankings: np.ndarray, n: int) -> np.ndarray:
    """Merge ranked lists ``[G, P]`` round-robin (skipping duplicates) into at most ``n`` items."""
    out: List[int] = []
    seen = set()
    if n <= 0:
        return np.zeros(0, np.int64)
    for col in rankings.T:
        for x in col:
            x = int(x)
            if x not in seen:
                seen.add(x)
                out.append(x)
                if len(out) == n:
                    return np.asarray(out, np.int64)
    return np.asarray(out, np.int64)


def _positional_tokens(pages: np.ndarray, page: int, n_mid: int) -> np.ndarray:
    if len(pages) == 0:
        return np.zeros(0, np.int64)
    t = (np.sort(pages)[:, None] * page + np.arange(page)[None]).ravel()
    return t[t < n_mid]


def _page_sel(
    ctx: Query, budgets_pages: Sequence[int], pick: Callable[[int, int], Tuple[np.ndarray, np.ndarray]]
) -> List[Selection]:
    """Selections for each page allowance; ``pick(h, n) -> (pages, tokens)``."""
    out = []
    for n in budgets_pages:
        toks, pages = [], np.zeros(ctx.n_kv)
        for h in range(ctx.n_kv):
            pg, tk = pick(h, n)
            if len(pg) > n:
                raise RuntimeError(f"selected {len(pg)} pages, allowed {n}")
            toks.append(tk)
            pages[h] = len(pg)
        out.append((toks, pages, pages * ctx.page))
    return out


def _sel_oracle(ctx: Query, extras: Sequence[int], pages: Sequence[int]) -> List[Selection]:
    mass = ctx.p_mid.sum(axis=1)  # [H_kv, n_mid]: the group's summed softmax weight
    order = np.argsort(-mass, axis=-1, kind="stable")
    out = []
    for e in extras:
        n = min(e, ctx.n_mid)
        toks = [order[h, :n] for h in range(ctx.n_kv)]
        out.append((toks, np.full(ctx.n_kv, np.nan), np.full(ctx.n_kv, float(n))))
    return out


def _sel_streaming(ctx: Query, extras: Sequence[int], pages: Sequence[int]) -> List[Selection]:
    out = []
    for e in extras:
        n = min(e, ctx.n_mid)
        t = np.arange(ctx.n_mid - n, ctx.n_mid)
        out.append(([t] * ctx.n_kv, np.full(ctx.n_kv, np.nan), np.full(ctx.n_kv, float(n))))
    return out


def _sel_quest(ctx: Query, extras: Sequence[int], pages: Sequence[int]) -> List[Selection]:
    kmin, kmax = ctx.kbounds  # [H_kv, P, D]
    q = ctx.qg[:, :, None, :]  # [H_kv, G, 1, D]
    bound = np.maximum(q * kmin[:, None], q * kmax[:, None]).sum(-1)  # [H_kv, G, P]
    score = bound.max(axis=1)  # max over the group's query heads
    rank = np.argsort(-score, axis=-1, kind="stable")
    return _page_sel(ctx, pages, lambda h, n: (rank[h, :n], _positional_tokens(rank[h, :n], ctx.page, ctx.n_mid)))


def _sel_quest_mass(ctx: Query, extras: Sequence[int], pages: Sequence[int]) -> List[Selection]:
    P = ctx.kbounds[0].shape[1]  # positional pages of this middle (the last one may be partial)
    mass = ctx.p_mid.sum(axis=1)
    padded = np.zeros((ctx.n_kv, P * ctx.page))
    padded[:, : ctx.n_mid] = mass
    score = padded.reshape(ctx.n_kv, P, ctx.page).sum(-1)
    rank = np.argsort(-score, axis=-1, kind="stable")
    return _page_sel(ctx, pages, lambda h, n: (rank[h, :n], _positional_tokens(rank[h, :n], ctx.page, ctx.n_mid)))


def _sel_forest_select(
    ctx: Query,
    extras: Sequence[int],
    pages: Sequence[int],
    *,
    scale: float,
    effort: Optional[float],
    timings: Dict[str, float],
) -> List[Selection]:
    f = ctx.forests("default")
    H_kv, G, D = ctx.qg.shape
    queries = np.ascontiguousarray(ctx.qg.reshape(H_kv * G, D), dtype=np.float32)
    cache: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    def pick(h: int, n: int):
        if n not in cache:
            if n == 0:
                cache[n] = (np.full((H_kv, 0), -1, np.int32), np.zeros(H_kv, np.int32))
            else:
                t0 = time.perf_counter()
                cache[n] = f.hf.select(queries, n, scale=scale, effort=effort)
                timings["select_s"] = timings.get("select_s", 0.0) + time.perf_counter() - t0
        sel, counts = cache[n]
        sel = np.asarray(sel)
        c = int(counts[h])
        if sel.shape != (H_kv, n) or not 0 <= c <= n:
            raise RuntimeError(f"HeadForest.select returned pages {sel.shape} / count {c} for max_pages={n}")
        pg = sel[h, :c].astype(np.int64)
        if (
            np.any(sel[h, c:] != -1)
            or len(np.unique(pg)) != c
            or (c and (pg.min() < 0 or pg.max() >= f.hf.num_pages(h)))
        ):
            raise RuntimeError(f"HeadForest.select returned invalid pages for head {h}: {sel[h]} (count {c})")
        return pg, f.tokens(h, pg)

    return _page_sel(ctx, pages, pick)


def _sel_device_ranked(
    ctx: Query,
    extras: Sequence[int],
    pages: Sequence[int],
    *,
    adaptive: bool,
    scale: float,
    effort: Optional[float],
    timings: Dict[str, float],
) -> List[Selection]:
    """The runtime's choice with fresh selection: ``HeadForest.select`` picks a superset of
    ``max(4 n, 32)`` pages per KV head (``IceCacheConfig.selected_pages``) with this step's
    queries and the runtime's default ``group_view`` and ``effort`` (``effort`` given: that
    one), which the device ranks by exact group
    mass, each query head's softmax taken over the superset, sink and window tokens as on the
    device; fixed: each head's ``n`` heaviest,
    ``adaptive``: the ``H_kv * n`` pages of all heads with the largest share of their head's
    superset mass (``budget_mode="adaptive"``)."""
    from icecache.runtime.config import SUPERSET_FACTOR, SUPERSET_MIN, IceCacheConfig

    f = ctx.forests("default")
    H_kv, G, D = ctx.qg.shape
    queries = np.ascontiguousarray(ctx.qg.reshape(H_kv * G, D), dtype=np.float32)
    per_page = [f.page_reduce(h, ctx.p_mid[h], np.add) for h in range(H_kv)]  # [G, pages] by page id
    out: List[Selection] = []
    for n in pages:
        if n == 0:
            out.append(([np.zeros(0, np.int64)] * H_kv, np.zeros(H_kv), np.zeros(H_kv)))
            continue
        t0 = time.perf_counter()
        sel, counts = f.hf.select(
            queries,
            max(SUPERSET_FACTOR * n, SUPERSET_MIN),
            scale=scale,
            effort=IceCacheConfig.effort if effort is None else effort,
            group_view=IceCacheConfig.group_view,
        )
        timings["select_s"] = timings.get("select_s", 0.0) + time.perf_counter() - t0
        ranked, masses = [], []
        for h in range(H_kv):
            pg = np.asarray(sel[h, : counts[h]], np.int64)
            pm = per_page[h][:, np.searchsorted(f.page_ids[h], pg)]  # [G, superset]
            # The device's softmax runs over the superset and the dense tokens only.
            mass = (pm / (ctx.base_mass[h] + pm.sum(1))[:, None]).sum(0)
            order = np.argsort(-mass, kind="stable")
            ranked.append(pg[order])
            masses.append(mass[order])
        if adaptive:  # each page's share of its head's superset mass, as on the device
            shares = np.concatenate([m / max(m.sum(), np.finfo(float).tiny) for m in masses])
            heads = np.concatenate([np.full(len(m), h) for h, m in enumerate(masses)])
            best = np.argsort(-shares, kind="stable")[: H_kv * n]
            take = np.bincount(heads[best], minlength=H_kv)
        else:
            take = np.array([min(n, len(r)) for r in ranked])
        toks = [f.tokens(h, ranked[h][: take[h]]) for h in range(H_kv)]
        out.append((toks, take.astype(float), take * float(ctx.page)))
    return out


def _maxkey_rr(config: str):
    def sel(ctx: Query, extras: Sequence[int], pages: Sequence[int]) -> List[Selection]:
        f = ctx.forests(config)
        merged = []
        for h in range(ctx.n_kv):
            best = f.page_reduce(h, ctx.raw_mid[h], np.maximum)  # [G, pages]: best q.k per page
            rank = f.page_ids[h][np.argsort(-best, axis=-1, kind="stable")]
            merged.append(_round_robin(rank, max(pages) if pages else 0))
        return _page_sel(ctx, pages, lambda h, n: (merged[h][:n], f.tokens(h, merged[h][:n])))

    return sel


def _pagemass(config: str):
    def sel(ctx: Query, extras: Sequence[int], pages: Sequence[int]) -> List[Selection]:
        f = ctx.forests(config)
        ranks = []
        for h in range(ctx.n_kv):
            mass = f.page_reduce(h, ctx.p_mid[h].sum(0), np.add)
            ranks.append(f.page_ids[h][np.argsort(-mass, kind="stable")])
        return _page_sel(ctx, pages, lambda h, n: (ranks[h][:n], f.tokens(h, ranks[h][:n])))

    return sel


def _have_headforest() -> bool:
    import icecache

    return hasattr(icecache, "HeadForest")


def resolve_methods(methods: Optional[Sequence[str]], diagnostics: bool) -> List[str]:
    """The methods to run: ``methods`` checked and deduplicated, or the defaults (with the
    diagnostics when ``diagnostics``), without the HeadForest methods when this build has none."""
    known = set(METHODS) | set(DIAGNOSTIC_METHODS)
    if methods is None:
        chosen = list(METHODS) + (list(DIAGNOSTIC_METHODS) if diagnostics else [])
        if not _have_headforest():
            dropped = [m for m in chosen if m in _FOREST_OF]
            chosen = [m for m in chosen if m not in _FOREST_OF]
            warnings.warn(
                f"icecache.HeadForest is not available in this build: skipping {dropped}", RuntimeWarning, stacklevel=3
            )
        return chosen
    chosen = list(dict.fromkeys(methods))
    bad = [m for m in chosen if m not in known]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; known: {sorted(known)}")
    if any(m in _FOREST_OF for m in chosen) and not _have_headforest():
        raise RuntimeError(
            "icecache.HeadForest is not available in this build: "
            f"cannot evaluate {[m for m in chosen if m in _FOREST_OF]}"
        )
    return chosen


def make_selectors(scale: float, effort: Optional[float], timings: Dict[str, float]) -> Dict[str, Selector]:
    """Every method by name. ``icecache`` selects with ``HeadForest.select`` at softmax ``scale``
    and ``effort`` and adds its time to ``timings["select_s"]``."""
    return {
        "oracle": _sel_oracle,
        "streamingllm": _sel_streaming,
        "quest": _sel_quest,
        "quest_pagemass": _sel_quest_mass,
        "icecache": lambda c, e, p: _sel_forest_select(c, e, p, scale=scale, effort=effort, timings=timings),
        "icecache_ranked": lambda c, e, p: _sel_device_ranked(
            c, e, p, adaptive=False, scale=scale, effort=effort, timings=timings
        ),
        "icecache_adaptive": lambda c, e, p: _sel_device_ranked(
            c, e, p, adaptive=True, scale=scale, effort=effort, timings=timings
        ),
        "reference": _maxkey_rr("reference"),
        "icecache_maxkey": _maxkey_rr("default"),
        "icecache_pagemass": _pagemass("default"),
        "reference_pagemass": _pagemass("reference"),
    }
