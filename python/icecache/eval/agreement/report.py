"""The results of the agreement evaluation: per-prompt runs, summaries, a markdown table, JSON and
a plot (:class:`AgreementResult`)."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from icecache.eval.agreement.methods import METHOD_LABELS
from icecache.eval.recall.report import layer_ranges, plotting_missing

__all__ = ["AgreementResult", "PromptRun", "plotting_missing"]


@dataclass(frozen=True)
class PromptRun:
    """One method at one budget on one prompt."""

    prompt: str
    kind: str
    tokens: int
    method: str
    budget: int
    #: Share of the decode steps whose argmax equals the full cache's.
    agreement: float
    #: First step (0-based) whose argmax differs; ``None``: none does.
    first_divergence: Optional[int]


@dataclass
class AgreementResult:
    """Every :class:`PromptRun` of an evaluation, with its settings."""

    methods: List[str]
    budgets: List[int]
    new_tokens: int
    sink: int
    window: int
    page_size: int
    full_layers: int
    served_layers: List[int]
    runs: List[PromptRun] = field(default_factory=list)
    timings: Dict[str, float] = field(default_factory=dict)
    info: Dict[str, Any] = field(default_factory=dict)

    def select(self, method: str, budget: int, kind: Optional[str] = None) -> List[PromptRun]:
        """The runs of ``method`` at ``budget`` (on prompts of ``kind``; ``None``: all)."""
        return [r for r in self.runs if r.method == method and r.budget == budget and kind in (None, r.kind)]

    def prompts(self) -> List[str]:
        """Prompt names in the order they ran."""
        return list(dict.fromkeys(r.prompt for r in self.runs))

    def mean(self, method: str, budget: int, kind: Optional[str] = None) -> float:
        """Mean agreement over the prompts (NaN when there are none)."""
        rs = self.select(method, budget, kind)
        return statistics.fmean(r.agreement for r in rs) if rs else float("nan")

    def summary(self) -> List[Dict[str, Any]]:
        """One row per (budget, method): mean, min and max agreement per kind and overall."""
        rows = []
        for b in self.budgets:
            for m in self.methods:
                row: Dict[str, Any] = dict(budget=b, method=m)
                for kind in ("prose", "code", None):
                    rs = self.select(m, b, kind)
                    key = kind or "all"
                    row[f"{key}_prompts"] = len(rs)
                    row[f"{key}_mean"] = self.mean(m, b, kind)
                    row[f"{key}_min"] = min((r.agreement for r in rs), default=float("nan"))
                    row[f"{key}_max"] = max((r.agreement for r in rs), default=float("nan"))
                row["first_divergence"] = [r.first_divergence for r in self.select(m, b)]
                rows.append(row)
        return rows

    def protocol(self) -> str:
        """How the numbers were made, in words (the table's header)."""
        model = self.info.get("model", "the model")
        return (
            f"Teacher-forced greedy agreement with the full cache ({model}): per prompt, one exact prefill; the "
            f"full cache decodes {self.new_tokens} greedy tokens; each method decodes the same {self.new_tokens} "
            f"steps fed the full cache's tokens; agreement = share of steps whose argmax equals the full cache's; "
            f"first divergence = the first step whose argmax differs (0-based, '-' if none). Budget B = tokens in the "
            f"softmax per (layer, KV head, step): {self.sink} sink + {self.window} window + "
            f"{self.page_size}-token pages (IceCache: semantic pages retrieved by the runtime with its default "
            f"look-ahead; Quest: positional pages ranked by the key min/max bound, max over the group's query "
            f"heads, emulated); StreamingLLM: {self.sink} sink + the B - {self.sink} most recent tokens "
            f"(emulated). Every method serves the same layers ({layer_ranges(self.served_layers) or 'none'}; the first "
            f"{self.full_layers} full-attention layers keep the full cache)."
        )

    def to_markdown(self) -> str:
        """Summary table (mean and spread over prompts per kind) and per-prompt table."""
        out = ["### Teacher-forced greedy agreement with the full cache", "", self.protocol(), ""]
        out += [
            "| B | method | prose mean (min-max) | code mean (min-max) | all | first divergence per prompt |",
            "|---:|---|---|---|---:|---|",
        ]

        def cell(row: Dict[str, Any], kind: str) -> str:
            if not row[f"{kind}_prompts"]:
                return "-"
            return f"{row[f'{kind}_mean']:.3f} ({row[f'{kind}_min']:.3f}-{row[f'{kind}_max']:.3f})"

        for row in self.summary():
            firsts = ", ".join("-" if f is None else str(f) for f in row["first_divergence"])
            out.append(
                f"| {row['budget']} | {METHOD_LABELS.get(row['method'], row['method'])} | {cell(row, 'prose')} "
                f"| {cell(row, 'code')} | {row['all_mean']:.3f} | {firsts} |"
            )
        cols = [(m, b) for m in self.methods for b in self.budgets]
        out += [
            "",
            "Per prompt (agreement / first divergence):",
            "",
            "| prompt | tokens | " + " | ".join(f"{METHOD_LABELS.get(m, m)} {b}" for m, b in cols) + " |",
            "|---|---:|" + "---:|" * len(cols),
        ]
        for name in self.prompts():
            mine = {(r.method, r.budget): r for r in self.runs if r.prompt == name}
            first = next(iter(mine.values()))
            cells = []
            for c in cols:
                r = mine.get(c)
                cells.append(
                    ""
                    if r is None
                    else f"{r.agreement:.3f} / {'-' if r.first_divergence is None else r.first_divergence}"
                )
            out.append(f"| {name} | {first.tokens} | " + " | ".join(cells) + " |")
        return "\n".join(out) + "\n"

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready: settings, summary rows, every run, timings, info."""
        return dict(
            methods=self.methods,
            budgets=self.budgets,
            new_tokens=self.new_tokens,
            sink=self.sink,
            window=self.window,
            page_size=self.page_size,
            full_layers=self.full_layers,
            served_layers=self.served_layers,
            protocol=self.protocol(),
            rows=self.summary(),
            runs=[asdict(r) for r in self.runs],
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
        """Write :meth:`to_dict` as JSON to ``path`` (NaN as null)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=1, allow_nan=True).replace("NaN", "null")
        path.write_text(text)
        return path

    def save_plot(self, path: Union[str, os.PathLike]) -> Path:
        """PNG of mean agreement vs budget per method, one panel per kind of prompt, with the
        spread over prompts (min-max) as a band. matplotlib is imported here (Agg canvas, no
        pyplot: the caller's backend is untouched)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        kinds = [k for k in ("prose", "code") if any(r.kind == k for r in self.runs)]
        fig = Figure(figsize=(5.5 * max(1, len(kinds)), 4.5))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, max(1, len(kinds)), squeeze=False)[0]
        for ax, kind in zip(axes, kinds):
            for m in self.methods:
                per = [[r.agreement for r in self.select(m, b, kind)] for b in self.budgets]
                line = ax.plot(
                    self.budgets, [statistics.fmean(p) for p in per], marker="o", label=METHOD_LABELS.get(m, m)
                )
                ax.fill_between(
                    self.budgets, [min(p) for p in per], [max(p) for p in per], color=line[0].get_color(), alpha=0.15
                )
            n = len({r.prompt for r in self.runs if r.kind == kind})
            ax.set_title(f"{kind}: {n} prompt(s), {self.new_tokens} steps", fontsize=10)
            ax.set_xscale("log", base=2)
            ax.set_xticks(self.budgets)
            ax.set_xticklabels([str(b) for b in self.budgets])
            ax.set_xlabel("budget B (tokens per layer, KV head and step)")
            ax.set_ylabel("greedy agreement with the full cache")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Teacher-forced agreement, {self.info.get('model', '')}", fontsize=11)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(path), dpi=110)
        return path
