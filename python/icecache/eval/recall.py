"""Attention-mass recall of KV-cache selections on real data (issue 3).

How much of the attention a decode query would pay to the full KV cache lands on the tokens a
retrieval method keeps, at a fixed token budget. Data: real post-RoPE queries, keys and values of
SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 KV heads, head dim 64) on real text (Jane
Austen, shipped with the package), captured once per document and cached in
``~/.cache/icecache/eval/`` (``$ICECACHE_EVAL_CACHE`` overrides): queries float32 at the query
positions, keys and values float16 at all positions. All methods and the reference attention
use the same (float16-rounded) keys and values.

Protocol, for one document of ``T`` tokens, one layer (default: every layer >= 2; layers 0 and 1
keep their full cache in IceCache), one KV head ``h`` and one query position ``t``:

* Query positions: ``n_queries`` (default 16) positions spread evenly over the last 5% of the
  document (:func:`query_positions`). The query at ``t`` is the prefill query of token ``t``,
  which equals the decode query of step ``t`` (causal attention).
* Context: tokens ``[0, t]``. **Sink**: tokens ``[0, sink)`` (16). **Window**: the ``window``
  (16) most recent tokens ``[M, t]`` with ``M = t - window + 1``. **Middle**: ``[sink, M)``,
  the part every method selects from (and what IceCache offloads and indexes). The boundary
  ``M`` moves with ``t`` so that every query sees the same 16-token window: with one ``M``
  shared by queries spread over the last 5% (400 tokens at T = 8000) the window would reach
  400+ tokens and exceed the 64-256 token budgets. Indexes are therefore built per query over
  exactly that query's middle (a fresh ``HeadForest`` per (document, layer, query)).
* **Budget** ``B`` counts every token that enters the softmax of one (layer, KV head, step):
  ``sink + window + page_size * pages``, where every selected page is charged all
  ``page_size`` slots even when it holds fewer tokens. Page-based methods get
  ``pages = floor((B - sink - window) / page_size)`` pages (``page_size`` = 16: 2 / 6 / 14 / 30
  pages at B = 64 / 128 / 256 / 512). Token-granular methods get ``B - sink - window`` middle
  tokens. The charge is checked to never exceed ``B`` (:attr:`RecallResult.charged`).
* **GQA-honest**: every method selects once per KV head; the selection is shared by the
  group's ``G = H_q / H_kv`` query heads (3 for SmolLM2).

Metrics, per (layer, KV head, query), each averaged over the group's query heads ``j``:

* **Attention-mass recall**: ``sum_{i in A} p_j(i)`` where ``p_j`` is the softmax of query head
  ``j`` over the whole context (scale ``1/sqrt(d)``) and ``A`` = sink + window + selected
  tokens. Reported as the mean over all (layer, KV head, query) samples, and as the
  **worst 5%**: the (layer, KV head) pairs are ranked by their mean recall over all documents
  and queries, and the mean of the lowest ``ceil(5%)`` of pairs is reported.
* **Middle-only recall**: the share of the middle's softmax mass that the selection captures,
  ``sum_j sum_{i in sel} p_j(i) / sum_j sum_{i in middle} p_j(i)`` (over the group's heads;
  a monotone function of the recall for each sample, so the oracle also maximises it).
* **Output error**: ``||o_sel - o_full|| / ||o_full||`` with ``o_full = sum_i p_j(i) v(i)`` and
  ``o_sel`` the softmax restricted to ``A`` (renormalised) times ``V``.

Methods, all at the same budget ``B``:

* ``oracle``: the ``B - sink - window`` middle tokens with the largest summed softmax weight of
  the group's query heads (token granularity). It maximises the recall: an upper bound on
  every method here.
* ``quest``: Quest-style positional pages of ``page_size`` consecutive middle tokens (the last
  one partial), ranked by the per-page key bound ``sum_d max(q_d kmin_d, q_d kmax_d)``, max over
  the group's query heads.
* ``streamingllm``: sink + the ``B - sink`` most recent tokens (the window grows to fill the
  budget).
* ``icecache``: ``icecache.HeadForest`` (default configuration) over the middle keys,
  ``select(queries of the group, pages, scale=1/sqrt(d))``.
* ``reference``: the IceCache reference configuration built with our index,
  ``HeadForest(..., num_simple=1, num_composite=1, promotion=[0.01, 0.2, 0.2])``, with the
  reference code's page ranking, which ``HeadForest.select`` has no switch for and which is
  therefore emulated in Python from ``token_map``: each query head scores every page by the
  largest ``q . k`` among its tokens (computed exactly, so this is an *optimistic* version of
  the reference, whose top keys come from an approximate tree search); the heads' ranked pages
  are taken round-robin (head 0's best, head 1's best, ..., then the second best of each, ...,
  skipping duplicates) until the page budget is full.

Diagnostic methods (``diagnostics=True``; used to find where IceCache loses mass):

* ``icecache_pagemass``: IceCache's semantic pages (default forest) ranked by their *true*
  summed group attention mass: the best any ranking can do on that page layout.
* ``icecache_maxkey``: IceCache's default pages with the reference's round-robin max-key
  ranking (separates page layout from page ranking).
* ``reference_pagemass``: the reference configuration's pages ranked by true mass.
* ``quest_pagemass``: positional pages ranked by true mass: the best positional paging can do.

Entry points: :func:`evaluate_recall` (capture + evaluate + save), :func:`evaluate_qkv` (evaluate
arrays you already have, e.g. synthetic ones in tests), and the CLI ``icecache eval recall``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from icecache._util import atomic_file

__all__ = [
    "DEFAULT_BUDGETS",
    "METHODS",
    "DIAGNOSTIC_METHODS",
    "METHOD_LABELS",
    "DocQKV",
    "RecallResult",
    "default_eval_cache_dir",
    "evaluate_qkv",
    "evaluate_recall",
    "load_or_capture",
    "query_positions",
]

#: Token budgets evaluated by default.
DEFAULT_BUDGETS: Tuple[int, ...] = (64, 128, 256, 512)
#: Methods evaluated by default (see the module docstring).
METHODS: Tuple[str, ...] = ("oracle", "quest", "streamingllm", "icecache", "reference")
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
    "reference": "IceCache ref. config",
    "icecache_pagemass": "IceCache pages, true-mass ranking",
    "icecache_maxkey": "IceCache pages, max-key round-robin",
    "reference_pagemass": "ref. config pages, true-mass ranking",
    "quest_pagemass": "positional pages, true-mass ranking",
}
# Methods whose selection is made of pages (the rest are token-granular).
_PAGE_METHODS = {"quest", "icecache", "reference", *DIAGNOSTIC_METHODS}
# Which HeadForest configuration each forest-based method uses.
_FOREST_OF = {
    "icecache": "default",
    "icecache_pagemass": "default",
    "icecache_maxkey": "default",
    "reference": "reference",
    "reference_pagemass": "reference",
}
#: HeadForest keyword arguments of the IceCache reference configuration.
REFERENCE_FOREST_KWARGS: Dict[str, Any] = dict(num_simple=1, num_composite=1, promotion=[0.01, 0.2, 0.2])

_CACHE_FORMAT = 1
# Sample arrays of a RecallResult, each [method, budget, layer, kv_head, sample].
_SAMPLE_FIELDS = ("recall", "middle_recall", "output_error", "pages", "tokens", "charged")


# ----------------------------------------------------------------------------------- data


@dataclass
class DocQKV:
    """Queries, keys and values of one document, as the attention saw them (post-RoPE).

    Attributes:
        positions: the query positions ``t`` (increasing), shape ``[nq]``.
        layers: ``{layer: (q [H_q, nq, D], k [H_kv, T, D], v [H_kv, T, D])}``; ``q[:, i]`` is the
            query of position ``positions[i]``; keys and values cover every position (float16
            or float32).
        name: a label (e.g. the cache file).
    """

    positions: np.ndarray
    layers: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]]
    name: str = ""


def query_positions(n_tokens: int, n_queries: int = 16, frac: float = 0.05) -> np.ndarray:
    """``n_queries`` positions spread evenly over the last ``frac`` of ``n_tokens`` tokens.

    The span is at least ``n_queries`` tokens; the last position is always ``n_tokens - 1``.
    """
    if n_tokens < 1 or n_queries < 1:
        raise ValueError("n_tokens and n_queries must be >= 1")
    span = min(n_tokens, max(n_queries, int(math.ceil(frac * n_tokens))))
    pos = np.round(np.linspace(n_tokens - span, n_tokens - 1, n_queries)).astype(np.int64)
    return np.unique(pos)


def default_eval_cache_dir() -> Path:
    """``$ICECACHE_EVAL_CACHE`` when set, otherwise ``~/.cache/icecache/eval``."""
    env = os.environ.get("ICECACHE_EVAL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "icecache" / "eval"


def _progress(iterable: Any = None, *, total: Optional[int] = None, desc: str = "", enable: bool = True):
    """A tqdm progress bar on stderr (or the bare iterable when disabled or tqdm is missing)."""
    if enable:
        try:
            from tqdm.auto import tqdm

            return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
        except ImportError:  # pragma: no cover - tqdm is in the model extra
            pass
    return _NoBar(iterable)


class _NoBar:
    def __init__(self, iterable):
        self._it = iterable

    def __iter__(self):
        return iter(self._it)

    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _cache_path(
    cache_dir: Path, model: str, n_docs: int, i: int, n_tokens: int, seed: int, positions: np.ndarray
) -> Path:
    tag = hashlib.sha256(np.asarray(positions, np.int64).tobytes()).hexdigest()[:10]
    return cache_dir / f"{model}_v{_CACHE_FORMAT}_T{n_tokens}_s{seed}_doc{i}of{n_docs}_q{tag}.npz"


def _load_tokenizer(model: str):
    from icecache import models

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = models.fetch_gguf(model)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def load_or_capture(
    n_docs: int = 2,
    n_tokens: int = 8000,
    *,
    positions: Optional[Sequence[int]] = None,
    n_queries: int = 16,
    query_frac: float = 0.05,
    layers: Optional[Sequence[int]] = None,
    model: str = "smollm2",
    seed: int = 0,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    progress: bool = True,
) -> List[DocQKV]:
    """Real post-RoPE Q/K/V of ``model`` on ``n_docs`` documents of ``n_tokens`` tokens.

    Documents come from :func:`icecache.texts.documents` (``seed``). Each document is captured
    once with :func:`icecache.capture.capture_qkv` (all layers; about 50 s for 8000 tokens of
    SmolLM2 on 2 cores) and cached as one ``.npz`` per document in ``cache_dir`` (default
    :func:`default_eval_cache_dir`): queries float32 at ``positions`` only, keys and values
    float16 (about 185 MB per 8000-token document). Later calls load the cache, without loading
    the model or the tokenizer.

    Args:
        positions: query positions; default :func:`query_positions` (``n_queries``, ``query_frac``).
        layers: layers to return (default all of the model's layers); the cache holds all.

    Returns:
        One :class:`DocQKV` per document.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_eval_cache_dir()
    pos = query_positions(n_tokens, n_queries, query_frac) if positions is None else np.asarray(positions, np.int64)
    if pos.ndim != 1 or pos.size == 0 or pos.min() < 0 or pos.max() >= n_tokens:
        raise ValueError(f"query positions must lie in [0, {n_tokens})")
    paths = [_cache_path(cache, model, n_docs, i, n_tokens, seed, pos) for i in range(n_docs)]
    state: Dict[str, Any] = {}

    def model_and_docs():
        if "docs" not in state:
            from icecache import models, texts

            m, tok = models.load_model(model)
            state["model"] = m
            state["docs"] = texts.documents(tok, n_docs, n_tokens, seed=seed)
        return state["model"], state["docs"]

    out: List[DocQKV] = []
    bar = _progress(total=n_docs, desc="capture Q/K/V", enable=progress)
    try:
        for i, path in enumerate(paths):
            if not path.is_file():
                bar.set_postfix_str(f"doc {i}: running {model} on {n_tokens} tokens")
                m, docs = model_and_docs()
                _capture_to(path, m, docs[i], pos)
            with np.load(path) as z:
                q, k, v, layer_ids = z["q"], z["k"], z["v"], z["layers"]
            want = [int(x) for x in layer_ids] if layers is None else [int(x) for x in layers]
            index = {int(layer): j for j, layer in enumerate(layer_ids)}
            bad = [layer for layer in want if layer not in index]
            if bad:
                raise ValueError(f"{model} has no layer(s) {bad} (it has {len(layer_ids)})")
            out.append(
                DocQKV(
                    positions=pos.copy(),
                    layers={layer: (q[index[layer]], k[index[layer]], v[index[layer]]) for layer in want},
                    name=path.name,
                )
            )
            bar.update(1)
    finally:
        bar.close()
    return out


def _capture_to(path: Path, model: Any, ids: Sequence[int], pos: np.ndarray) -> None:
    from icecache.capture import capture_qkv

    data = capture_qkv(model, list(ids))
    layer_ids = np.array(sorted(data), dtype=np.int64)
    q = np.stack([data[layer][0][:, pos] for layer in layer_ids]).astype(np.float32)
    k = np.stack([data[layer][1] for layer in layer_ids]).astype(np.float16)
    v = np.stack([data[layer][2] for layer in layer_ids]).astype(np.float16)
    del data
    # A concurrent or interrupted capture leaves no half file.
    with atomic_file(path) as part, open(part, "wb") as f:
        np.savez(f, q=q, k=k, v=v, layers=layer_ids, positions=pos, tokens=np.asarray(ids, dtype=np.int32))


# ----------------------------------------------------------------------------------- result


@dataclass
class RecallResult:
    """Per-sample metrics of every method and budget, with summaries, a table and a plot.

    Sample arrays (``recall``, ``middle_recall``, ``output_error``, ``pages``, ``tokens``,
    ``charged``) have shape ``[method, budget, layer, kv_head, sample]``; a sample is one
    (document, query position). ``pages`` is the number of selected pages (NaN for
    token-granular methods), ``tokens`` the middle tokens attended, ``charged`` the budget
    charged (sink + window + ``page_size`` per page, or per token), never above the budget.
    """

    methods: List[str]
    budgets: List[int]
    layers: List[int]
    n_kv_heads: int
    group: int
    sink: int
    window: int
    page_size: int
    recall: np.ndarray
    middle_recall: np.ndarray
    output_error: np.ndarray
    pages: np.ndarray
    tokens: np.ndarray
    charged: np.ndarray
    n_docs: int = 0
    positions: List[List[int]] = field(default_factory=list)
    timings: Dict[str, float] = field(default_factory=dict)
    info: Dict[str, Any] = field(default_factory=dict)

    # -- numbers ---------------------------------------------------------------------------

    def _mi(self, method: str) -> int:
        return self.methods.index(method)

    def _bi(self, budget: int) -> int:
        return self.budgets.index(int(budget))

    def page_allowance(self, budget: int) -> int:
        """Pages a page-based method may select at ``budget``."""
        return max(0, (int(budget) - self.sink - self.window) // self.page_size)

    def mean(self, method: str, budget: int, metric: str = "recall") -> float:
        """Mean of ``metric`` over all (layer, KV head, sample)."""
        return float(np.nanmean(getattr(self, metric)[self._mi(method), self._bi(budget)]))

    def worst(self, method: str, budget: int, metric: str = "recall", frac: float = 0.05) -> float:
        """Mean over the worst ``frac`` of (layer, KV head) pairs, each pair averaged over samples
        (worst = lowest for recalls, highest for ``output_error``)."""
        per_pair = getattr(self, metric)[self._mi(method), self._bi(budget)].mean(-1).ravel()
        n = max(1, int(math.ceil(frac * per_pair.size)))
        s = np.sort(per_pair)
        return float((s[-n:] if metric == "output_error" else s[:n]).mean())

    def per_layer(self, method: str, budget: int, metric: str = "recall") -> np.ndarray:
        """Mean of ``metric`` per layer (``[len(layers)]``)."""
        return getattr(self, metric)[self._mi(method), self._bi(budget)].mean(axis=(1, 2))

    def fill(self, method: str, budget: int) -> float:
        """Mean share of the selected pages' slots that hold a token (NaN for token methods)."""
        m, b = self._mi(method), self._bi(budget)
        pages = self.pages[m, b]
        if np.all(np.isnan(pages)):
            return float("nan")
        ok = pages > 0
        if not ok.any():
            return float("nan")
        return float((self.tokens[m, b][ok] / (pages[ok] * self.page_size)).mean())

    def summary(self) -> List[Dict[str, Any]]:
        """One row per (budget, method): the table's numbers as a list of dicts."""
        rows = []
        for b in self.budgets:
            for m in self.methods:
                rows.append(
                    dict(
                        budget=b,
                        method=m,
                        selection=self._selection_text(m, b),
                        recall_mean=self.mean(m, b),
                        recall_worst5=self.worst(m, b),
                        middle_recall=self.mean(m, b, "middle_recall"),
                        output_error=self.mean(m, b, "output_error"),
                        page_fill=self.fill(m, b),
                        max_charged=int(np.max(self.charged[self._mi(m), self._bi(b)])),
                    )
                )
        return rows

    def _selection_text(self, method: str, budget: int) -> str:
        extra = max(0, budget - self.sink - self.window)
        if method == "oracle":
            return f"{extra} tokens"
        if method == "streamingllm":
            return f"window {budget - self.sink}"
        return f"{self.page_allowance(budget)} pages"

    def budget_rule(self) -> str:
        """The budget accounting, in words (the table's header)."""
        s, w, p = self.sink, self.window, self.page_size
        return (
            f"Budget B = tokens in the softmax per (layer, KV head, step) = {s} sink + {w} window "
            f"+ {p} x pages (a page is charged {p} slots even if partly empty); page methods get "
            f"pages = floor((B - {s} - {w}) / {p}); the oracle gets B - {s + w} middle tokens; "
            f"StreamingLLM gets {s} sink + the B - {s} most recent tokens."
        )

    def to_markdown(self) -> str:
        """The results as a markdown table, with the protocol in a header paragraph."""
        n_samples = self.recall.shape[-1]
        head = [
            "### Attention-mass recall, SmolLM2-135M"
            if self.info.get("model") == "smollm2"
            else "### Attention-mass recall",
            "",
            self.budget_rule(),
            "",
            f"Data: {self.n_docs} document(s), {n_samples} query position(s) in all, layers "
            f"{_ranges(self.layers)}, {self.n_kv_heads} KV heads x {self.group} query heads each "
            f"(one selection per KV head, shared by its query heads). Recall = share of the full "
            f"softmax mass on sink + window + selected tokens (mean over query heads); worst 5% = "
            f"mean over the worst 5% of (layer, KV head) pairs; middle-only = share of the middle's "
            f"mass captured by the selection; output error = ||o_sel - o_full|| / ||o_full||.",
            "",
            "| B | method | selection | recall mean | recall worst 5% | middle-only recall "
            "| output rel. error | page fill |",
            "|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in self.summary():
            fill = "-" if math.isnan(r["page_fill"]) else f"{r['page_fill']:.2f}"
            head.append(
                f"| {r['budget']} | {METHOD_LABELS.get(r['method'], r['method'])} | {r['selection']} "
                f"| {r['recall_mean']:.3f} | {r['recall_worst5']:.3f} | {r['middle_recall']:.3f} "
                f"| {r['output_error']:.3f} | {fill} |"
            )
        return "\n".join(head) + "\n"

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready summary: settings, table rows, per-layer recall, timings."""
        return dict(
            methods=self.methods,
            budgets=self.budgets,
            layers=self.layers,
            n_kv_heads=self.n_kv_heads,
            group=self.group,
            sink=self.sink,
            window=self.window,
            page_size=self.page_size,
            n_docs=self.n_docs,
            positions=self.positions,
            budget_rule=self.budget_rule(),
            rows=self.summary(),
            per_layer_recall={
                m: {str(b): [round(float(x), 5) for x in self.per_layer(m, b)] for b in self.budgets}
                for m in self.methods
            },
            timings=self.timings,
            info=self.info,
        )

    def save_table(self, path: Union[str, os.PathLike]) -> Path:
        """Write :meth:`to_markdown` to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_markdown())
        return path

    def save_json(self, path: Union[str, os.PathLike]) -> Path:
        """Write :meth:`to_dict` as JSON to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=_json_default))
        return path

    def save_plot(self, path: Union[str, os.PathLike]) -> Path:
        """PNG of mean / worst-5% / middle-only recall and output error vs budget, per method.

        matplotlib is imported here (Agg canvas, no pyplot: the caller's backend is untouched).
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        panels = [
            ("recall", "mean", "attention-mass recall (mean)"),
            ("recall", "worst", "recall, worst 5% of (layer, KV head)"),
            ("middle_recall", "mean", "middle-only recall (mean)"),
            ("output_error", "mean", "attention output relative error (mean)"),
        ]
        fig = Figure(figsize=(11, 9))
        FigureCanvasAgg(fig)
        axes = fig.subplots(2, 2)
        for ax, (metric, kind, title) in zip(axes.ravel(), panels):
            for m in self.methods:
                fn = self.mean if kind == "mean" else self.worst
                ys = [fn(m, b, metric) for b in self.budgets]
                style = "--" if m in DIAGNOSTIC_METHODS else "-"
                ax.plot(self.budgets, ys, style, marker="o", label=METHOD_LABELS.get(m, m))
            ax.set_xscale("log", base=2)
            ax.set_xticks(self.budgets)
            ax.set_xticklabels([str(b) for b in self.budgets])
            ax.set_xlabel("budget B (tokens per layer, KV head and step)")
            ax.set_title(title, fontsize=10)
            ax.grid(True, alpha=0.3)
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8, frameon=False)
        fig.suptitle(
            f"KV selection quality on real data ({self.n_docs} doc(s), layers {_ranges(self.layers)}; "
            f"sink {self.sink}, window {self.window}, page size {self.page_size})",
            fontsize=11,
        )
        n_rows = -(-len(self.methods) // 3)
        fig.tight_layout(rect=(0, 0.025 * n_rows + 0.01, 1, 1))
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(path), dpi=110)
        return path


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return None if np.isnan(x) else float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))


def _ranges(xs: Sequence[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4, 7"``."""
    xs = sorted(int(x) for x in xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


# ----------------------------------------------------------------------------------- methods


class _Query:
    """Everything the methods need about one (layer, query position): all KV heads at once."""

    def __init__(self, qg, k_mid, raw_mid, p_mid, kbounds, page_size, forests):
        self.qg = qg  # [H_kv, G, D] float32 queries of each group
        self.k_mid = k_mid  # [H_kv, n_mid, D] float32 middle keys
        self.raw_mid = raw_mid  # [H_kv, G, n_mid] raw q.k of the middle
        self.p_mid = p_mid  # [H_kv, G, n_mid] full-context softmax weights of the middle
        self.kbounds = kbounds  # (kmin, kmax) [H_kv, P, D] of the positional pages
        self.page = page_size
        self.forests = forests  # callable: config name -> _Forest (built lazily)
        self.n_kv, self.n_mid = k_mid.shape[0], k_mid.shape[1]


class _Forest:
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


# A selection: per KV head, the middle indices attended, pages (NaN for token methods), charge.
_Sel = Tuple[List[np.ndarray], np.ndarray, np.ndarray]


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
    ctx: _Query, budgets_pages: Sequence[int], pick: Callable[[int, int], Tuple[np.ndarray, np.ndarray]]
) -> List[_Sel]:
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


def _sel_oracle(ctx: _Query, extras: Sequence[int], pages: Sequence[int]) -> List[_Sel]:
    mass = ctx.p_mid.sum(axis=1)  # [H_kv, n_mid]: the group's summed softmax weight
    order = np.argsort(-mass, axis=-1, kind="stable")
    out = []
    for e in extras:
        n = min(e, ctx.n_mid)
        toks = [order[h, :n] for h in range(ctx.n_kv)]
        out.append((toks, np.full(ctx.n_kv, np.nan), np.full(ctx.n_kv, float(n))))
    return out


def _sel_streaming(ctx: _Query, extras: Sequence[int], pages: Sequence[int]) -> List[_Sel]:
    out = []
    for e in extras:
        n = min(e, ctx.n_mid)
        t = np.arange(ctx.n_mid - n, ctx.n_mid)
        out.append(([t] * ctx.n_kv, np.full(ctx.n_kv, np.nan), np.full(ctx.n_kv, float(n))))
    return out


def _sel_quest(ctx: _Query, extras: Sequence[int], pages: Sequence[int]) -> List[_Sel]:
    kmin, kmax = ctx.kbounds  # [H_kv, P, D]
    q = ctx.qg[:, :, None, :]  # [H_kv, G, 1, D]
    bound = np.maximum(q * kmin[:, None], q * kmax[:, None]).sum(-1)  # [H_kv, G, P]
    score = bound.max(axis=1)  # max over the group's query heads
    rank = np.argsort(-score, axis=-1, kind="stable")
    return _page_sel(ctx, pages, lambda h, n: (rank[h, :n], _positional_tokens(rank[h, :n], ctx.page, ctx.n_mid)))


def _sel_quest_mass(ctx: _Query, extras: Sequence[int], pages: Sequence[int]) -> List[_Sel]:
    P = ctx.kbounds[0].shape[1]  # positional pages of this middle (the last one may be partial)
    mass = ctx.p_mid.sum(axis=1)
    padded = np.zeros((ctx.n_kv, P * ctx.page))
    padded[:, : ctx.n_mid] = mass
    score = padded.reshape(ctx.n_kv, P, ctx.page).sum(-1)
    rank = np.argsort(-score, axis=-1, kind="stable")
    return _page_sel(ctx, pages, lambda h, n: (rank[h, :n], _positional_tokens(rank[h, :n], ctx.page, ctx.n_mid)))


def _sel_forest_select(
    ctx: _Query,
    extras: Sequence[int],
    pages: Sequence[int],
    *,
    scale: float,
    effort: Optional[float],
    timings: Dict[str, float],
) -> List[_Sel]:
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


def _maxkey_rr(config: str):
    def sel(ctx: _Query, extras: Sequence[int], pages: Sequence[int]) -> List[_Sel]:
        f = ctx.forests(config)
        merged = []
        for h in range(ctx.n_kv):
            best = f.page_reduce(h, ctx.raw_mid[h], np.maximum)  # [G, pages]: best q.k per page
            rank = f.page_ids[h][np.argsort(-best, axis=-1, kind="stable")]
            merged.append(_round_robin(rank, max(pages) if pages else 0))
        return _page_sel(ctx, pages, lambda h, n: (merged[h][:n], f.tokens(h, merged[h][:n])))

    return sel


def _pagemass(config: str):
    def sel(ctx: _Query, extras: Sequence[int], pages: Sequence[int]) -> List[_Sel]:
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


def _resolve_methods(methods: Optional[Sequence[str]], diagnostics: bool) -> List[str]:
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


# ----------------------------------------------------------------------------------- evaluation


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
    """Evaluate the selection methods on Q/K/V you already have (see the module docstring).

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
    methods = _resolve_methods(methods, diagnostics)
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
    arrays = {f: np.full(shape, np.nan) for f in _SAMPLE_FIELDS}
    extras = [b - sink - window for b in budgets]
    page_allow = [e // page_size for e in extras]
    scale = 1.0 / math.sqrt(D)
    timings: Dict[str, float] = {"forest_build_s": 0.0, "select_s": 0.0}
    fkw = dict(forest_kwargs or {})
    rkw = dict(REFERENCE_FOREST_KWARGS if reference_kwargs is None else reference_kwargs)
    configs = {"default": fkw, "reference": rkw}

    selectors: Dict[str, Callable[..., List[_Sel]]] = {
        "oracle": _sel_oracle,
        "streamingllm": _sel_streaming,
        "quest": _sel_quest,
        "quest_pagemass": _sel_quest_mass,
        "icecache": lambda c, e, p: _sel_forest_select(c, e, p, scale=scale, effort=effort, timings=timings),
        "reference": _maxkey_rr("reference"),
        "icecache_maxkey": _maxkey_rr("default"),
        "icecache_pagemass": _pagemass("default"),
        "reference_pagemass": _pagemass("reference"),
    }

    t_start = time.perf_counter()
    bar = _progress(total=len(docs) * len(layers), desc="evaluate", enable=progress)
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

    over = arrays["charged"] + sink + window > np.asarray(budgets)[None, :, None, None, None] + 1e-9
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
    P_all = (T - sink) // page
    kp = k[:, sink : sink + P_all * page].reshape(H_kv, P_all, page, D)
    kmin_all, kmax_all = kp.min(2), kp.max(2)
    need_quest = any(m in ("quest", "quest_pagemass") for m in methods)

    for qi in range(nq):
        Mq = int(M[qi])
        n_mid = Mq - sink
        p_mid = p[:, :, qi, sink:Mq]  # [H_kv, G, n_mid]
        v_mid = v[:, sink:Mq]
        k_mid = np.ascontiguousarray(k[:, sink:Mq])
        if need_quest:
            nf = n_mid // page
            kmin, kmax = kmin_all[:, :nf], kmax_all[:, :nf]
            if n_mid % page:
                tail = k_mid[:, nf * page :]
                kmin = np.concatenate([kmin, tail.min(1, keepdims=True)], axis=1)
                kmax = np.concatenate([kmax, tail.max(1, keepdims=True)], axis=1)
            kbounds = (kmin, kmax)
        else:
            kbounds = None
        built: Dict[str, _Forest] = {}

        def forests(config: str, k_mid=k_mid, n_mid=n_mid, built=built) -> _Forest:
            if config not in built:
                import icecache

                t0 = time.perf_counter()
                hf = icecache.HeadForest(k_mid, page_size=page, seed=seed, threads=threads, **configs[config])
                built[config] = _Forest(hf, n_mid)
                timings["forest_build_s"] += time.perf_counter() - t0
            return built[config]

        ctx = _Query(qg[:, :, qi], k_mid, raw_all[:, :, qi, sink:Mq], p_mid, kbounds, page, forests)
        bm, bn, of = base_mass[:, :, qi], base_num[:, :, qi], o_full[:, :, qi]
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
    effort: Optional[float] = None,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    out_dir: Optional[Union[str, os.PathLike]] = None,
    plot: bool = True,
    progress: bool = True,
) -> RecallResult:
    """Attention-mass recall of the selection methods on real SmolLM2 Q/K/V (module docstring).

    Captures (or loads from the cache) ``n_docs`` real documents of ``n_tokens`` tokens, then
    runs :func:`evaluate_qkv`. With ``out_dir`` it writes ``recall_table.md``,
    ``recall.json`` and (with ``plot``) ``recall_vs_budget.png`` there.

    Args:
        layers: layers to evaluate; default every layer >= 2.
        n_queries, query_frac: query positions (:func:`query_positions`).
        Others: see :func:`evaluate_qkv` and :func:`load_or_capture`.

    Returns:
        The :class:`RecallResult` (``.to_markdown()`` is the table).
    """
    t0 = time.perf_counter()
    docs = load_or_capture(
        n_docs,
        n_tokens,
        n_queries=n_queries,
        query_frac=query_frac,
        layers=None,
        model=model,
        seed=seed,
        cache_dir=cache_dir,
        progress=progress,
    )
    all_layers = sorted(docs[0].layers)
    if layers is None:
        layers = [layer for layer in all_layers if layer >= 2]
    layers = sorted({int(layer) for layer in layers})
    bad = [layer for layer in layers if layer not in docs[0].layers]
    if bad:
        raise ValueError(f"{model} has no layer(s) {bad}; layers are {_ranges(all_layers)}")
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
    res.info.update(model=model, n_tokens=n_tokens, n_queries=n_queries, query_frac=query_frac)
    if out_dir is not None:
        out = Path(out_dir)
        res.save_table(out / "recall_table.md")
        res.save_json(out / "recall.json")
        if plot:
            res.save_plot(out / "recall_vs_budget.png")
    return res
