"""The ``icecache`` command line.

Subcommands:

* ``icecache demo``: long-context retrieval with a real model on the CPU (SmolLM2-135M by default,
  Gemma-3-270M with ``--model gemma3``), full cache vs
  IceCache at several budgets (see :mod:`icecache.demo`); ``icecache demo --tp 2``: the same
  comparison under tensor parallelism, on 2 CPU processes (see :mod:`icecache.demo_tp`).
* ``icecache eval recall``: attention-mass recall of KV selections (IceCache, Quest,
  StreamingLLM, an oracle) on real SmolLM2-135M data; prints a table, saves a markdown table,
  a JSON summary and a PNG plot (see :mod:`icecache.eval.recall`).
* ``icecache eval agreement``: teacher-forced greedy agreement with the full cache (IceCache,
  Quest, StreamingLLM) on real prose and code prompts; prints and saves a markdown table and
  JSON, then a PNG plot (see :mod:`icecache.eval.agreement`).
* ``icecache eval ruler``: RULER's synthetic tasks answered with the full cache, IceCache, Quest,
  StreamingLLM and an exact top-k oracle at the same budgets; prints and saves a markdown table,
  JSON with every prediction, then a PNG plot (see :mod:`icecache.eval.ruler`).

Progress bars go to stderr, the table to stdout. Run as ``icecache ...`` (console script) or
``python -m icecache.cli ...``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, List, Literal, Optional, Sequence, Set, Tuple, Union

__all__ = ["build_parser", "main"]


def _layer_list(tokens: Sequence[str]) -> List[int]:
    """``["2-5", "9"]`` or ``["2", "3"]`` or ``["2,3"]`` -> sorted distinct ints."""
    out: Set[int] = set()
    for tok in tokens:
        for part in str(tok).split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part[1:]:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise argparse.ArgumentTypeError(f"bad layer range {part!r}")
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
    return sorted(out)


def _plot_wanted(args: argparse.Namespace, plotting_missing: Callable[[], Optional[str]], png: str) -> bool:
    """Whether an evaluation draws its plot ``png``, its one optional part: not with
    ``--no-plot``, nor when the plot's dependency is missing, which is checked before the work
    (and said); the plot is drawn after the results are printed and saved."""
    if args.no_plot:
        return False
    missing = plotting_missing()
    if missing is not None:
        print(f"note: {missing}, so {png} is skipped (--no-plot hides this note)", file=sys.stderr)
        return False
    return True


def _cmd_eval_recall(args: argparse.Namespace) -> int:
    from icecache.eval import recall

    layers = _layer_list(args.layers) if args.layers else None
    methods = args.methods or None
    plot = _plot_wanted(args, recall.plotting_missing, "recall_vs_budget.png")
    res = recall.evaluate_recall(
        n_docs=args.docs,
        n_tokens=args.tokens,
        budgets=args.budgets,
        layers=layers,
        n_queries=args.queries,
        methods=methods,
        diagnostics=args.diagnostics,
        sink=args.sink,
        window=args.window,
        page_size=args.page_size,
        seed=args.seed,
        kind=args.kind,
        effort=args.effort,
        cache_dir=args.cache_dir,
        out_dir=args.out,
        plot=False,
        progress=not args.quiet,
    )
    print(res.to_markdown())
    t = res.timings
    print(
        f"time: {t.get('total_s', 0):.1f} s in all (capture/load {t.get('capture_or_load_s', 0):.1f} s, "
        f"evaluate {t.get('evaluate_s', 0):.1f} s, of which HeadForest build "
        f"{t.get('forest_build_s', 0):.1f} s and select {t.get('select_s', 0):.1f} s)"
    )
    out = Path(args.out)
    print(f"saved: {out / 'recall_table.md'}, {out / 'recall.json'}", flush=True)
    if plot:
        print(f"saved: {res.save_plot(out / 'recall_vs_budget.png')}")
    return 0


def _cmd_eval_agreement(args: argparse.Namespace) -> int:
    from icecache.eval import agreement

    plot = _plot_wanted(args, agreement.plotting_missing, "agreement_vs_budget.png")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    res = agreement.evaluate_agreement(
        n_prose=args.prose,
        n_code=args.code,
        n_tokens=args.tokens,
        budgets=args.budgets,
        methods=args.methods or agreement.METHODS,
        new_tokens=args.new_tokens,
        model=args.model,
        seed=args.seed,
        out_dir=out,
        plot=False,
        progress=not args.quiet,
        sink=args.sink,
        window=args.window,
        page_size=args.page_size,
        full_layers=args.full_layers,
        threads=args.threads,
        effort=args.effort,
        page_format=args.page_format,
        refresh=args.refresh,
        group_view=args.group_view,
    )
    print(res.to_markdown())
    for run, cal in res.info.get("calibration", {}).items():
        e = sorted(cal["efforts"])
        print(
            f"calibration {run}: {cal['seconds']:.2f} s over {cal['layers']} layers (k = {cal['k']}); "
            f"efforts min {e[0]:.3g}, median {e[len(e) // 2]:.3g}, max {e[-1]:.3g}; "
            f"{cal['reached']} of {cal['heads']} (layer, KV head)s reached the target"
        )
    print(f"time: {sum(res.timings.values()):.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in res.timings.items())})")
    print(f"saved: {out / 'agreement_table.md'}, {out / 'agreement.json'}", flush=True)
    if plot:
        print(f"saved: {res.save_plot(out / 'agreement_vs_budget.png')}")
    return 0


def _effort_arg(text: str) -> Union[float, Literal["auto"]]:
    """``--effort``: ``"auto"`` or a number (``IceCacheConfig`` checks its range)."""
    if text == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'must be a number or "auto", got {text!r}') from None


def _add_full_layers(parser: argparse.ArgumentParser) -> None:
    """``--full-layers``, shared by the evaluations that compare methods on the same layers."""
    parser.add_argument(
        "--full-layers",
        type=int,
        default=2,
        help="leading full-attention layers that keep the full cache, for every method (default 2; a model with "
        "few full-attention layers, such as Gemma-3-270M with 3, wants 0 as well)",
    )


def _add_agreement_parser(evals: Any) -> None:
    from icecache.eval.agreement import DEFAULT_BUDGETS, METHODS

    ag = evals.add_parser(
        "agreement",
        help="teacher-forced greedy agreement with the full cache on real prose and code prompts",
        description=(
            "Teacher-forced greedy agreement with the full cache: the full cache decodes N greedy "
            "tokens after a real prompt shipped with the package (Jane Austen prose, CPython "
            "standard-library code); IceCache (the runtime), Quest and StreamingLLM (emulated) "
            "decode the same steps fed those tokens; reported: the share of steps whose argmax "
            "matches, and the first step that does not. Budget B = 16 sink + 32 window + pages of 16."
        ),
    )
    ag.add_argument("--prose", type=int, default=2, help="prose prompts (default 2)")
    ag.add_argument("--code", type=int, default=2, help="code prompts (default 2)")
    ag.add_argument("--tokens", type=int, default=4096, help="tokens per prompt (default 4096)")
    ag.add_argument("--new-tokens", type=int, default=64, help="decode steps per run (default 64)")
    ag.add_argument(
        "--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS), help="token budgets (default 128 256 512)"
    )
    ag.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=list(METHODS),
        help="methods (default: all of " + ", ".join(METHODS) + ")",
    )
    ag.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"], help="model (default smollm2)")
    ag.add_argument("--sink", type=int, default=16, help="sink tokens (default 16)")
    ag.add_argument("--window", type=int, default=32, help="window tokens (default 32, IceCache's default)")
    ag.add_argument("--page-size", type=int, default=16, help="page size (default 16)")
    _add_full_layers(ag)
    ag.add_argument("--threads", type=int, default=None, help="torch and index threads (default: all cores)")
    ag.add_argument(
        "--effort",
        type=_effort_arg,
        default=None,
        help='IceCache\'s search effort: a number, or "auto" to calibrate each layer on the prompt (default: '
        "IceCacheConfig's, 1.5)",
    )
    ag.add_argument(
        "--group-view",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="IceCache's query heads of a GQA group search one shared field of view (IceCacheConfig.group_view; "
        "default: on)",
    )
    ag.add_argument(
        "--page-format",
        default="int8",
        choices=["native", "int8", "k8v4"],
        help="IceCache's host page stores: the model's dtype, int8 with a scale per row, or int8 K and "
        "4-bit V with a step and minimum per 32 values (default int8)",
    )
    ag.add_argument(
        "--refresh",
        type=int,
        default=1,
        help="IceCache selects a new superset every this many steps (IceCacheConfig.refresh; default 1)",
    )
    ag.add_argument("--seed", type=int, default=0, help="prompt choice (default 0)")
    ag.add_argument(
        "--out",
        default=".",
        help="directory for agreement_table.md, agreement.json, agreement_vs_budget.png (default: current directory)",
    )
    ag.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    ag.add_argument("--quiet", action="store_true", help="no progress bar")
    ag.set_defaults(func=_cmd_eval_agreement)


def _option_arg(text: str) -> Tuple[str, Any]:
    """``--ice KEY=VALUE``: an IceCacheConfig field and a Python literal (a bare word stays a string)."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {text!r}")
    try:
        return key.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return key.strip(), value.strip()


def _cmd_eval_ruler(args: argparse.Namespace) -> int:
    from icecache.eval import ruler

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        settings = ruler.RulerSettings(args.sink, args.window, args.page_size, args.full_layers, dict(args.ice or []))
        # Arguments are checked before the model loads; the length against its context after.
        ruler.check_arguments(args.tasks, args.lengths, args.methods, args.budgets, settings, n_samples=args.samples)
        ruler.resolve_device(args.device, args.dtype)
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
    except (ValueError, TypeError) as exc:
        print(f"icecache eval ruler: error: {exc}", file=sys.stderr)
        return 2
    missing = ruler.ruler_missing()
    if missing is not None:
        print(f"icecache eval ruler: error: {missing}", file=sys.stderr)
        return 2
    plot = _plot_wanted(args, ruler.evaluate.plotting_missing, "ruler_vs_length.png")
    out = Path(args.out)
    try:
        res = ruler.evaluate_ruler(
            args.tasks,
            args.lengths,
            args.samples,
            args.methods,
            args.budgets,
            settings,
            model=args.model,
            seed=args.seed,
            cache_dir=args.cache_dir,
            out_dir=out,
            plot=False,
            progress=not args.quiet,
            device=args.device,
            dtype=args.dtype,
            workers=args.workers,
            threads=args.threads,
            resume=args.resume,
        )
    except ValueError as exc:  # the length against the model's context, known once it is loaded
        print(f"icecache eval ruler: error: {exc}", file=sys.stderr)
        return 2
    print(res.to_markdown())
    print(f"time: {sum(res.timings.values()):.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in res.timings.items())})")
    print(f"saved: {out / 'ruler_table.md'}, {out / 'ruler.json'}, {out / 'ruler_predictions.jsonl'}", flush=True)
    if plot:
        print(f"saved: {res.save_plot(out / 'ruler_vs_length.png')}")
    return 0


def _add_ruler_parser(evals: Any) -> None:
    from icecache.eval.ruler.data import TASKS
    from icecache.eval.ruler.evaluate import DEFAULT_BUDGETS, DEFAULT_LENGTHS, METHODS
    from icecache.models import MODELS

    ru = evals.add_parser(
        "ruler",
        help="RULER's synthetic tasks: full cache, IceCache, Quest, StreamingLLM and an oracle at the same budgets",
        description=(
            "RULER (13 synthetic tasks: NIAH variants, variable tracking, common/frequent words, QA), generated "
            "by nvidia-long-context-eval's generators with its task arguments (cached in ~/.cache/icecache/ruler) "
            "and scored with its metrics. Per sample one exact prefill, then greedy decoding with each method: the "
            "full cache, IceCache, Quest (page min/max bound over all KV), StreamingLLM (sink + recent, the rest "
            "evicted), and an oracle (exact top-B attention). Budget B = tokens in the softmax per (layer, KV "
            "head, step) = sink + window + retrieved. Needs the ruler extra: pip install 'icecache[ruler]'."
        ),
    )
    ru.add_argument("--model", default="smollm2", choices=sorted(MODELS), help="model (default smollm2)")
    ru.add_argument("--tasks", nargs="+", default=list(TASKS), help="tasks (default: all 13): " + ", ".join(TASKS))
    ru.add_argument(
        "--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="lengths in tokens (default 4096)"
    )
    ru.add_argument("--samples", type=int, default=2, help="samples per task and length (default 2)")
    ru.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        help="methods (default: all of " + ", ".join(METHODS) + ")",
    )
    ru.add_argument(
        "--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS), help="token budgets (default 256 1024)"
    )
    ru.add_argument("--sink", type=int, default=16, help="sink tokens, every method (default 16)")
    ru.add_argument("--window", type=int, default=32, help="window tokens, IceCache and Quest (default 32)")
    ru.add_argument("--page-size", type=int, default=16, help="page size, IceCache and Quest (default 16)")
    _add_full_layers(ru)
    ru.add_argument(
        "--ice",
        type=_option_arg,
        action="append",
        metavar="KEY=VALUE",
        help="an IceCacheConfig field for IceCache, e.g. --ice budget_mode=fixed --ice effort=auto (repeatable; "
        "default: its defaults, with exact_until_indexed=False)",
    )
    ru.add_argument("--threads", type=int, default=None, help="torch threads, of each worker (default: all cores)")
    ru.add_argument(
        "--device", default=None, help="where the model runs, e.g. cpu, cuda, cuda:1 (default: cuda if there is a GPU)"
    )
    ru.add_argument(
        "--dtype",
        default=None,
        help="the model's weights, e.g. float32, bfloat16 (default: bfloat16 on CUDA, else float32)",
    )
    ru.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes answering samples in parallel, each with its own model copy; on a GPU decoding a small "
        "model is bound by the host, so several share it well (default 1)",
    )
    ru.add_argument("--seed", type=int, default=42, help="the generators' random seed (default 42, RULER's)")
    ru.add_argument("--cache-dir", default=None, help="sample cache (default ~/.cache/icecache/ruler)")
    ru.add_argument(
        "--out",
        default=".",
        help="directory for ruler_table.md, ruler.json, ruler_predictions.jsonl, ruler_vs_length.png (default: .)",
    )
    ru.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    ru.add_argument("--quiet", action="store_true", help="no progress bar")
    ru.add_argument(
        "--resume",
        action="store_true",
        help="keep the predictions that a run with the same settings and --samples saved in --out (one that stopped, "
        "or asked for fewer tasks or lengths) and answer only the samples it did not finish",
    )
    ru.set_defaults(func=_cmd_eval_ruler)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``icecache`` command (subcommand tree)."""
    parser = argparse.ArgumentParser(prog="icecache", description="IceCache: KV-cache retrieval for long-context LLMs.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    from icecache import demo

    dm = commands.add_parser(
        "demo", help="long-context retrieval on the CPU: full cache vs IceCache", description=demo.DESCRIPTION
    )
    demo.add_arguments(dm)
    dm.set_defaults(func=demo.run)

    ev = commands.add_parser(
        "eval", help="quality evaluations on real data", description="Quality evaluations on real data."
    )
    evals = ev.add_subparsers(dest="eval_command", metavar="EVALUATION")
    evals.required = True

    from icecache.eval.recall import DEFAULT_BUDGETS, DIAGNOSTIC_METHODS, METHODS

    rc = evals.add_parser(
        "recall",
        help="attention-mass recall of KV selections vs token budget (SmolLM2-135M)",
        description=(
            "Attention-mass recall, middle-only recall and attention-output error of KV "
            "selections (oracle, Quest, StreamingLLM, IceCache, IceCache reference config) on "
            "real post-RoPE Q/K/V of SmolLM2-135M, per layer >= 2, KV head and decode query. "
            "Budget B = 16 sink + 16 window + 16 x pages; pages = floor((B - 32) / 16). "
            "Captures are cached in ~/.cache/icecache/eval (first run: ~1 min per document)."
        ),
    )
    rc.add_argument("--docs", type=int, default=2, help="documents (default 2)")
    rc.add_argument(
        "--kind", choices=["prose", "code"], default="prose", help="shipped texts: Austen prose or Python code"
    )
    rc.add_argument("--tokens", type=int, default=8000, help="tokens per document (default 8000)")
    rc.add_argument(
        "--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS), help="token budgets (default 64 128 256 512)"
    )
    rc.add_argument("--layers", nargs="+", default=None, help="layers, e.g. 2-29 or 4 8 12 (default: every layer >= 2)")
    rc.add_argument(
        "--queries", type=int, default=16, help="query positions per document, spread over its last 5%% (default 16)"
    )
    rc.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=list(METHODS) + list(DIAGNOSTIC_METHODS),
        help="methods (default: all of " + ", ".join(METHODS) + ")",
    )
    rc.add_argument(
        "--diagnostics",
        action="store_true",
        help="also run the diagnostic methods (pages ranked by true attention mass, ...)",
    )
    rc.add_argument("--sink", type=int, default=16, help="sink tokens (default 16)")
    rc.add_argument("--window", type=int, default=16, help="window tokens (default 16)")
    rc.add_argument("--page-size", type=int, default=16, help="page size (default 16)")
    rc.add_argument("--effort", type=float, default=None, help="HeadForest.select effort (default: its own)")
    rc.add_argument("--seed", type=int, default=0, help="document choice and index seed (default 0)")
    rc.add_argument(
        "--out",
        default=".",
        help="directory for recall_table.md, recall.json, recall_vs_budget.png (default: current directory)",
    )
    rc.add_argument("--cache-dir", default=None, help="capture cache (default ~/.cache/icecache/eval)")
    rc.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    rc.add_argument("--quiet", action="store_true", help="no progress bars")
    rc.set_defaults(func=_cmd_eval_recall)
    _add_agreement_parser(evals)
    _add_ruler_parser(evals)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``icecache`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
