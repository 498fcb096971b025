#!/usr/bin/env python
"""Soak test of the IceCache runtime: thousands of decode steps of SmolLM2 on the CPU.

Two runs from the same real-text prompt (shipped Austen), greedy decoding, through the public
API only (``IceCache``, ``cache.nbytes()``, ``cache.stats``):

1. **Memory** (``--budget``, default 256): ``--steps`` decode steps with IceCache. Every
   ``--every`` steps it records the process RSS, the cache's device and host bytes, the pages
   selected and loaded per layer step, and the time per step. Device bytes must stay flat;
   RSS must grow like the host stores (the CPU pages of every new token) plus the index, at a
   constant rate: the slope over the second half of the run is compared with the first half's.
2. **Exactness** (``--exact-steps``): IceCache with a budget of twice the final context (every
   page selected; the look-ahead superset is the retrieved pages) against the full cache, fed
   the same tokens (the full cache's greedy choices): the largest logit difference and the
   agreement of the argmax at every step, with IceCache's memory records.

    python benches/bench_soak.py --prompt 2000 --steps 10000 --exact-steps 2000 --out benches/out/

Prints markdown tables and writes them with a JSON of every record to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def slope(xs, ys) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def record(step: int, context: int, cache, t_interval: float, steps_interval: int, pages: tuple) -> dict:
    """One checkpoint: memory of the process and the cache, and the cache's page counters since
    ``pages`` (layer steps, selected, loaded at the previous checkpoint)."""
    nb = cache.nbytes()
    st = cache.stats
    rec = dict(
        step=step,
        context=context,
        rss=rss_bytes(),
        device=nb["device"],
        host=nb["host"],
        ms_per_step=1e3 * t_interval / max(steps_interval, 1),
    )
    d_steps = st.layer_steps - pages[0]
    rec["pages_selected_per_layer_step"] = (st.pages_selected - pages[1]) / max(d_steps, 1)
    rec["pages_loaded_per_layer_step"] = (st.pages_loaded - pages[2]) / max(d_steps, 1)
    return rec


def memory_run(model, ids, args) -> list:
    """``args.steps`` greedy steps with IceCache at ``args.budget``; records every ``args.every``."""
    import torch
    from icecache.runtime import IceCache, IceCacheConfig

    cache = IceCache(IceCacheConfig(budget=args.budget), model)
    with torch.inference_mode():
        out = model(ids, cache=cache, logits_to_keep=1)
    tok = out.logits[:, -1:].argmax(-1)
    cache.wait_indexed()
    pos = ids.shape[1]
    recs = [record(0, pos, cache, 0.0, 0, (0, 0, 0))]
    st = cache.stats
    mark = (st.layer_steps, st.pages_selected, st.pages_loaded)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(1, args.steps + 1):
            out = model(tok, cache=cache, cache_position=torch.tensor([pos]), logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
            pos += 1
            if i % args.every == 0 or i == args.steps:
                t = time.perf_counter()
                recs.append(record(i, pos, cache, t - t0, i - recs[-1]["step"], mark))
                st = cache.stats
                mark = (st.layer_steps, st.pages_selected, st.pages_loaded)
                print(f"memory run: step {i}, RSS {recs[-1]['rss'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
    return recs


def exact_run(model, ids, args) -> dict:
    """IceCache with every page in the budget against the full cache, on the same tokens."""
    import torch
    from icecache.runtime import IceCache, IceCacheConfig
    from transformers import DynamicCache

    final = ids.shape[1] + args.exact_steps
    # Pages are at least half full: twice the tokens covers every page. A look-ahead superset
    # of just the retrieved pages keeps the device pool at twice those (the default is 5x).
    cfg = IceCacheConfig(budget=2 * final)
    cfg = IceCacheConfig(budget=cfg.budget, superset_pages=cfg.retrieved_pages)
    budget = cfg.budget
    caches = {"full": DynamicCache(config=model.config), "icecache": IceCache(cfg, model)}
    with torch.inference_mode():
        outs = {k: model(ids, cache=c, logits_to_keep=1) for k, c in caches.items()}
    caches["icecache"].wait_indexed()
    tok = outs["full"].logits[:, -1:].argmax(-1)
    pos = ids.shape[1]
    worst, agree, steps = 0.0, 0, 0
    recs = [record(0, pos, caches["icecache"], 0.0, 0, (0, 0, 0))]
    with torch.inference_mode():
        for i in range(1, args.exact_steps + 1):
            logits = {}
            for k, c in caches.items():
                out = model(tok, cache=c, cache_position=torch.tensor([pos]), logits_to_keep=1)
                logits[k] = out.logits[0, -1].float()
            worst = max(worst, float((logits["icecache"] - logits["full"]).abs().max()))
            agree += int(logits["icecache"].argmax() == logits["full"].argmax())
            steps += 1
            tok = logits["full"].argmax().view(1, 1)
            pos += 1
            if i % args.every == 0 or i == args.exact_steps:
                recs.append(record(i, pos, caches["icecache"], 0.0, 0, (0, 0, 0)))
                print(f"exact run: step {i}, max |dlogit| {worst:.2e}", file=sys.stderr, flush=True)
    agreement = agree / max(steps, 1)
    return dict(budget=budget, steps=steps, max_abs_logit_diff=worst, argmax_agreement=agreement, records=recs)


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def memory_table(recs: list) -> str:
    out = [
        "| step | context | RSS MiB | device MiB | host MiB | pages selected / loaded per layer step | ms/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        sel, loaded = r["pages_selected_per_layer_step"], r["pages_loaded_per_layer_step"]
        pages = f"{sel:.1f} / {loaded:.2f}" if r["step"] else "-"
        out.append(
            f"| {r['step']} | {r['context']} | {mib(r['rss'])} | {mib(r['device'])} | {mib(r['host'])} | "
            f"{pages} | {r['ms_per_step']:.1f} |"
        )
    return "\n".join(out)


def growth_summary(recs: list) -> dict:
    """Per-token slopes of RSS, host and device bytes over each half of the run."""
    half = len(recs) // 2
    parts = {"first half": recs[: half + 1], "second half": recs[half:]}
    out = {}
    for name, rs in parts.items():
        xs = [r["context"] for r in rs]
        out[name] = {f"{k}_per_token": slope(xs, [r[k] for r in rs]) for k in ("rss", "host", "device")}
    return out


def report(args, command: str, mem, t_mem: float, exact, t_exact: float) -> str:
    import icecache
    import torch
    import transformers

    lines = [
        "## Soak: SmolLM2-135M decode on the CPU",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"icecache {icecache.__version__}",
        f"- command: `{command}`",
        f"- date: {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
    ]
    if mem:
        g = growth_summary(mem)
        lines += [
            "",
            f"### Memory: IceCache budget {args.budget}, {args.prompt}-token prompt, {args.steps} steps "
            f"({t_mem:.0f} s)",
            "",
            memory_table(mem),
            "",
            "Growth per token of context, first half / second half of the run (bytes): RSS "
            f"{g['first half']['rss_per_token']:.0f} / {g['second half']['rss_per_token']:.0f}; host stores "
            f"{g['first half']['host_per_token']:.0f} / {g['second half']['host_per_token']:.0f}; device "
            f"{g['first half']['device_per_token']:.0f} / {g['second half']['device_per_token']:.0f} (the "
            "full-cache layers' K and V; IceCache layers hold a fixed sink, window and page pool).",
        ]
    if exact is not None:
        lines += [
            "",
            f"### Exactness: budget {exact['budget']} (every page) against the full cache, {exact['steps']} steps "
            f"({t_exact:.0f} s)",
            "",
            f"Largest |logit difference| over all steps: {exact['max_abs_logit_diff']:.2e}; argmax agreement "
            f"{exact['argmax_agreement']:.4f}.",
            "",
            memory_table(exact["records"]),
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=2000, help="prompt tokens (default 2000)")
    ap.add_argument("--steps", type=int, default=10000, help="decode steps of the memory run (0: skip)")
    ap.add_argument(
        "--exact-steps",
        type=int,
        default=2000,
        help="decode steps of the exactness run (0: skip); its step costs grow with the budget, "
        "twice the final context (about 1 s per step at 2,500 tokens on 2 cores)",
    )
    ap.add_argument("--budget", type=int, default=256, help="IceCache budget of the memory run")
    ap.add_argument("--every", type=int, default=500, help="steps between records")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=Path("benches/out"))
    args = ap.parse_args(argv)

    import torch
    from icecache import models, texts

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = models.load_model("smollm2")
    ids = torch.tensor([texts.documents(tok, 1, args.prompt, seed=0)[0]])
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    mem, exact, t_mem, t_exact = [], None, 0.0, 0.0

    def save() -> str:
        # After each run, so that a long run's results survive an interrupted later one.
        md = report(args, command, mem, t_mem, exact, t_exact)
        (args.out / f"bench_soak-{stamp}.md").write_text(md)
        data = dict(command=command, memory=mem, growth=growth_summary(mem) if mem else None, exact=exact)
        (args.out / f"bench_soak-{stamp}.json").write_text(json.dumps(data, indent=1) + "\n")
        return md

    if args.steps:
        t0 = time.perf_counter()
        mem = memory_run(model, ids, args)
        t_mem = time.perf_counter() - t0
        save()
    if args.exact_steps:
        t0 = time.perf_counter()
        exact = exact_run(model, ids, args)
        t_exact = time.perf_counter() - t0
    print(save())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
