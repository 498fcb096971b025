"""The results of the recall evaluation: per-sample metrics, their summaries, a markdown table,
a JSON summary and a plot (:class:`RecallResult`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from icecache.eval.recall.methods import DIAGNOSTIC_METHODS, METHOD_LABELS

__all__ = ["SAMPLE_FIELDS", "RecallResult", "layer_ranges"]

#: The sample arrays of a :class:`RecallResult`, each ``[method, budget, layer, kv_head, sample]``.
SAMPLE_FIELDS = ("recall", "middle_recall", "output_error", "pages", "tokens", "charged")


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
            f"{layer_ranges(self.layers)}, {self.n_kv_heads} KV heads x {self.group} query heads each "
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
            f"KV selection quality on real data ({self.n_docs} doc(s), layers {layer_ranges(self.layers)}; "
            f"sink {self.sink}, window {self.window}, page size {self.page_size})",
            fontsize=11,
        )
        n_rows = -(-len(self.methods) // 3)
        fig.tight_layout(rect=(0, 0.025 * n_rows + 0.01, 1, 1))
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(path), dpi=110)
        return path


def plotting_missing() -> Optional[str]:
    """``None`` if :meth:`RecallResult.save_plot` can run; otherwise what to install for it (its
    one optional dependency, matplotlib: checked before any work, not after it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or icecache[bench])"
    return None


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return None if np.isnan(x) else float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))


def layer_ranges(xs: Sequence[int]) -> str:
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
