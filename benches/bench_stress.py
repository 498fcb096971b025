#!/usr/bin/env python
"""Stress run of the IceCache runtime's lifecycle: hundreds of generations in one process.

What users do that no single test does: a new ``IceCache`` per prompt through
``model.generate``, earlier caches dropped (and collected by Python's cyclic garbage collector)
at random moments, prompts of varying length, batch sizes that change, both
``exact_until_indexed`` settings, native and 8-bit pages, garbage collections forced inside
decode steps, and another cache's prefill keeping the index worker busy while the decode steps
capture their CUDA graphs. Then one cache reused through ``reset()`` for more generations.

Every generation must end without a Python error (and the process without an abort); every
``--check-every``-th generation is repeated eagerly (``cuda_graphs=False``) and must give the
same tokens. Random weights of a real shape (``--shape``); a few layers of it keep a run of
hundreds of generations within minutes.

    python benches/bench_stress.py --shape llama8b --layers 4 --contexts 4096 32768 \\
        --generations 500 --reset-generations 200 --out benches/out/

Prints a markdown summary and writes it with a JSON of every generation to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES, build_model  # noqa: E402
from icecache._util import cache_keyword  # noqa: E402


@dataclass
class Generation:
    """One generation of the run and how it ended."""

    index: int
    phase: str  # "new" (a new cache) or "reset" (the reused cache)
    context: int
    batch: int
    exact_until_indexed: bool
    page_format: str
    busy_worker: bool
    seconds: float
    error: Optional[str] = None
    #: Whether the eager repeat gave the same tokens (``None``: not checked).
    eager_equal: Optional[bool] = None


@dataclass
class Summary:
    """The run's totals."""

    generations: int = 0
    errors: int = 0
    eager_checks: int = 0
    eager_mismatches: int = 0
    decode_steps: int = 0
    seconds: float = 0.0
    contexts: List[int] = field(default_factory=list)


class CollectAtRandom:
    """A logits processor that forces a full garbage collection at random decode steps."""

    def __init__(self, rng, rate: float):
        self.rng, self.rate = rng, rate

    def __call__(self, input_ids, scores):
        if self.rng.random() < self.rate:
            gc.collect()
        return scores


def make_config(base: dict, exact: bool, page_format: str, graphs: bool = True):
    from icecache import IceCacheConfig

    return IceCacheConfig(**base, exact_until_indexed=exact, page_format=page_format, cuda_graphs=graphs)


def generate(model, ids, cache, steps: int, processors):
    import torch
    from transformers import LogitsProcessorList

    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **{cache_keyword(model): cache},
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            logits_processor=LogitsProcessorList(processors),
        )
    return out[:, ids.shape[1] :].cpu()


def run(args, model, device, log) -> List[Generation]:
    import random

    import torch
    from icecache import IceCache

    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    base = dict(budget=args.budget)
    processors = [CollectAtRandom(rng, args.gc_rate)]
    out: List[Generation] = []
    alive: list = []  # earlier caches, dropped at random moments

    def prompt(context: int, batch: int) -> "torch.Tensor":
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        return torch.randint(1, vocab, (batch, context), generator=g).to(device)

    def one(i: int, phase: str, cache_for, exact: bool, fmt: str) -> None:
        context, batch = rng.choice(args.contexts), rng.choice(args.batches)
        busy = phase == "new" and rng.random() < 0.5
        ids = prompt(context, batch)
        t = time.perf_counter()
        rec = Generation(i, phase, context, batch, exact, fmt, busy, 0.0)
        try:
            if busy:  # another cache's prefill: its index jobs run while this one decodes
                side = IceCache(make_config(base, True, fmt), model)
                with torch.inference_mode():
                    model(prompt(min(context, args.busy_context), 1), **{cache_keyword(model): side})
                alive.append(side)
            cache = cache_for(exact, fmt)
            tokens = generate(model, ids, cache, args.steps, processors)
            # With exact_until_indexed the step that leaves the bridge depends on the worker's
            # speed; without it every step waits for its job, so two runs must agree.
            if args.check_every and i % args.check_every == 0 and not exact:
                eager = IceCache(make_config(base, exact, fmt, graphs=False), model)
                rec.eager_equal = bool(torch.equal(tokens, generate(model, ids, eager, args.steps, [])))
            if phase == "new":
                alive.append(cache)
        except Exception as e:  # the run counts them; an abort ends the process
            rec.error = f"{type(e).__name__}: {e}"[:500]
        rec.seconds = time.perf_counter() - t
        # Drop earlier caches at random, often leaving their collection to the collector.
        while alive and (len(alive) > args.keep or rng.random() < 0.3):
            alive.pop(rng.randrange(len(alive)))
        out.append(rec)
        if rec.error or (i + 1) % args.every == 0:
            log(
                f"{phase} {i + 1}: context {context} batch {batch} {fmt} exact={exact} busy={busy} "
                f"{rec.seconds:.2f} s{' ERROR ' + rec.error if rec.error else ''}"
            )

    def fresh(exact, fmt):
        return IceCache(make_config(base, exact, fmt), model)

    deadline = time.monotonic() + args.time_limit if args.time_limit else float("inf")
    for i in range(args.generations):
        if time.monotonic() > deadline:
            log(f"time limit: stopped after {i} new-cache generations")
            break
        one(i, "new", fresh, rng.random() < 0.5, rng.choice(args.page_formats))

    # One cache for the whole phase, of one configuration, emptied by reset() each time.
    reused: list = []

    def reset_one(exact, fmt):
        if not reused:
            reused.append(fresh(exact, fmt))
        else:
            reused[0].reset()
        return reused[0]

    exact, fmt = rng.random() < 0.5, rng.choice(args.page_formats)
    for i in range(args.reset_generations):
        if time.monotonic() > deadline:
            log(f"time limit: stopped after {i} reset generations")
            break
        one(i, "reset", reset_one, exact, fmt)
    return out


def summarise(gens: List[Generation], steps: int) -> Summary:
    s = Summary()
    for g in gens:
        s.generations += 1
        s.errors += g.error is not None
        s.eager_checks += g.eager_equal is not None
        s.eager_mismatches += g.eager_equal is False
        s.decode_steps += steps * g.batch if g.error is None else 0
        s.seconds += g.seconds
    s.contexts = sorted({g.context for g in gens})
    return s


def report(args, command: str, gens: List[Generation], total_s: float, device) -> str:
    import torch
    import transformers

    where = torch.cuda.get_device_name() if device.type == "cuda" else (platform.processor() or "CPU")
    lines = [
        "## IceCache lifecycle stress run",
        "",
        f"- command: `{command}`",
        f"- machine: {platform.node()}, {where}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
        f"- shape {args.shape} x {args.layers} layers, random weights; budget {args.budget}; "
        f"{args.steps} new tokens a generation",
        f"- wall time {total_s:.0f} s",
        "",
        "| phase | generations | Python errors | eager checks (mismatches) | decode steps | contexts | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase in ("new", "reset"):
        part = [g for g in gens if g.phase == phase]
        if not part:
            continue
        s = summarise(part, args.steps)
        lines.append(
            f"| {phase} | {s.generations} | {s.errors} | {s.eager_checks} ({s.eager_mismatches}) | "
            f"{s.decode_steps} | {', '.join(map(str, s.contexts))} | {s.seconds:.0f} |"
        )
    errors = [g for g in gens if g.error]
    if errors:
        lines += ["", "Errors:"] + [f"- {g.phase} {g.index}: {g.error}" for g in errors[:20]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--layers", type=int, default=4, help="layers of the shape (default 4)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--page-formats", nargs="+", default=["native", "int8"])
    ap.add_argument("--generations", type=int, default=100, help="generations with a new cache each")
    ap.add_argument("--reset-generations", type=int, default=40, help="generations of one cache reused by reset()")
    ap.add_argument("--steps", type=int, default=8, help="new tokens a generation")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--gc-rate", type=float, default=0.2, help="chance of a forced gc.collect() at a decode step")
    ap.add_argument("--keep", type=int, default=3, help="earlier caches kept alive at most")
    ap.add_argument("--busy-context", type=int, default=8192, help="longest prompt of the side prefill")
    ap.add_argument(
        "--check-every",
        type=int,
        default=10,
        help="repeat every n-th generation eagerly (0: never; only without exact_until_indexed)",
    )
    ap.add_argument("--every", type=int, default=25, help="generations between progress lines")
    ap.add_argument("--time-limit", type=float, default=0, help="seconds after which no generation starts (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--out", type=Path, default=Path("benches/out"))
    args = ap.parse_args(argv)
    if min(args.contexts) <= args.budget:
        ap.error("every context must exceed the budget")

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    make_shape, _ = SHAPES[args.shape]
    cfg = make_shape(args.layers)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, max(args.contexts) + args.steps)
    torch.manual_seed(args.seed)
    model = build_model(cfg, device, 1)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    command = "python benches/bench_stress.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    t = time.perf_counter()
    gens = run(args, model, device, log)
    text = report(args, command, gens, time.perf_counter() - t, device)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stress.md").write_text(text)
    (args.out / "stress.json").write_text(json.dumps([asdict(g) for g in gens], indent=1))
    bad = summarise(gens, args.steps)
    return 1 if bad.errors or bad.eager_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
