"""``icecache demo --tp N``: IceCache under tensor parallelism, N CPU processes on gloo.

A random-weight Llama (8 query / 4 KV heads of 32 dims, 6 layers; the same seeded weights in
every process, no download) is split with transformers' tensor parallelism
(``DistributedConfig(tp_plan="auto")`` on ``torch.distributed``): each rank holds 4 / N KV
heads and their query heads. Every rank runs one :class:`icecache.IceCache` over its own KV
heads. The prompt (random tokens) is prefilled once; the full cache decodes greedily, and
IceCache at each budget decodes the same tokens (teacher forcing) from the same prefill, so
that its logits compare step by step. Rank 0 prints which heads and index threads each rank
has, then per cache: the share of steps whose top token matches the full cache's, the largest
logit difference, the attention recall (mean over all ranks' heads), decode tokens per second
and the device KV bytes of one rank. A cache that attends every token (recall 1, as at a
budget that covers the context) must give the full cache's logits to float32 rounding: the
demo fails otherwise.

Runs as ``icecache demo --tp 2`` (spawns the processes itself) or under torchrun::

    torchrun --nproc-per-node 2 -m icecache.demo_tp [options]

The processes split the host's cores: each runs torch with ``cores // N`` threads and IceCache
defaults its index threads to the same share (:mod:`icecache.runtime.parallel`).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from icecache._util import cache_keyword

__all__ = ["DEFAULT_BUDGETS", "DEFAULT_TOKENS", "demo_config", "run", "spawn_cpu", "main"]

#: Prompt tokens, IceCache budgets and new tokens of the demo unless given.
DEFAULT_TOKENS = 2048
DEFAULT_BUDGETS = (64, 256, 4096)
DEFAULT_NEW_TOKENS = 16

#: Logits of IceCache attending every token match the full cache's to this (float32; its
#: attention sums sink, pages and window in another order than SDPA).
EXACT_TOLERANCE = 1e-3


def demo_config() -> Any:
    """The demo model's ``LlamaConfig``: 8 query / 4 KV heads, so 1, 2 or 4 ranks split it."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=16384,
    )


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _spawned(rank: int, fn: Callable, nprocs: int, store: str, args: tuple) -> None:
    """Entry of a process started by :func:`spawn_cpu`."""
    import torch
    import torch.distributed as dist

    # What torchrun would set; transformers and IceCache read them.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs))
    torch.set_num_threads(max(1, _cores() // nprocs))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nprocs)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn_cpu(fn: Callable, nprocs: int, args: tuple = (), timeout: Optional[float] = None) -> None:
    """Run ``fn(*args)`` in ``nprocs`` new CPU processes joined in one gloo process group, as
    ``torchrun --nproc-per-node nprocs`` would (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
    ``LOCAL_WORLD_SIZE`` set; the group rendezvous through a file, so no port is needed).
    ``fn`` must be importable by name (a module-level function).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a process raised (its traceback in the
            message); the others are stopped.
        TimeoutError: not done after ``timeout`` seconds; the processes are stopped.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="icecache-tp-") as tmp:
        ctx = mp.start_processes(
            _spawned,
            args=(fn, nprocs, os.path.join(tmp, "store"), args),
            nprocs=nprocs,
            join=False,
            start_method="spawn",
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{nprocs} processes not done after {timeout} s")
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.terminate()
                    process.join()


@dataclass
class _Run:
    name: str
    logits: Any  # [steps, V]
    recalls: List[float]
    decode_tps: float
    device_bytes: int
    shard: Any = None
    threads: Optional[int] = None


def _decode(model, cache, first, forced: Optional[Sequence[int]], steps: int, untimed_s=lambda: 0.0) -> tuple:
    """``steps`` one-token forwards from ``first`` (``[1, 1]``): greedy, or feeding ``forced``.
    Returns ``(tokens fed after first, logits [steps, V], tokens per second)``."""
    import torch

    tokens, logits, token, kw = [], [], first, cache_keyword(model)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(steps):
            out = model(token, logits_to_keep=1, **{kw: cache}).logits[0, -1]
            logits.append(out)
            nxt = int(out.argmax()) if forced is None else forced[i]
            tokens.append(nxt)
            token = torch.tensor([[nxt]])
    return tokens, torch.stack(logits), steps / (time.perf_counter() - start - untimed_s())


def _runs(model, ids, configs: Sequence[Any], steps: int, recall: bool, say: Callable, forced=None) -> tuple:
    """Prefill ``ids[:, :-1]`` once, then decode ``steps`` tokens with the full cache (greedy,
    or ``forced``) and with IceCache at each of ``configs`` (the full cache's tokens).
    Returns ``(tokens, [full run, IceCache runs...])``."""
    import torch
    from transformers import DynamicCache

    from icecache.runtime import IceCache

    prefix = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, :-1], logits_to_keep=1, **{cache_keyword(model): prefix})
    say("  full cache ...")
    tokens, logits, tps = _decode(model, copy.deepcopy(prefix), ids[:, -1:], forced, steps)
    layers: List[Any] = list(prefix.layers)
    full_bytes = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in layers)
    runs = [_Run("full cache", logits, [1.0], tps, full_bytes)]
    for config in configs:
        say(f"  IceCache {config.budget} ...")
        cache = IceCache.from_prefilled(config, model, prefix, track_recall=recall)
        cache.wait_indexed()
        stats = cache.stats
        _, logits, tps = _decode(model, cache, ids[:, -1:], tokens, steps, untimed_s=lambda stats=stats: stats.recall_s)
        device = cache.nbytes()["device"]
        runs.append(
            _Run(
                f"IceCache {config.budget}",
                logits,
                stats.recalls,
                tps,
                device,
                cache.shard,
                cache.runtime.config.threads,
            )
        )
    return tokens, runs


def _rank_main(options: dict) -> None:
    """One rank of the demo (every rank runs the same forwards; rank 0 also runs the model in
    one piece, and prints)."""
    import warnings

    import torch
    import torch.distributed as dist
    import transformers
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    from icecache.runtime import IceCacheConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    quiet = options["quiet"] or rank != 0

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    cfg = demo_config()
    configs = [
        # Reproducible: every rank leaves the bridge at its own step otherwise.
        IceCacheConfig(budget=b, full_layers=options["full_layers"], reuse=options["reuse"], exact_until_indexed=False)
        for b in options["budgets"]
    ]
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()  # the same weights in every rank
    model = LlamaForCausalLM.from_pretrained(
        None, config=cfg, state_dict=state, distributed_config=DistributedConfig(tp_plan="auto", tp_size=world)
    ).eval()
    g = torch.Generator().manual_seed(options["seed"])
    ids = torch.randint(0, cfg.vocab_size, (1, options["tokens"]), generator=g)
    steps, recall = options["new_tokens"], not options["no_recall"]

    say(f"{world} ranks: prefill of {ids.shape[1] - 1} tokens, then decoding ...")
    tokens, runs = _runs(model, ids, configs, steps, recall, say)
    gathered: List[Any] = [None] * world
    # The demo's own traffic, for the table: every rank's recalls, heads and threads.
    dist.all_gather_object(gathered, ([r.recalls for r in runs], runs[-1].shard, runs[-1].threads))
    if rank != 0:
        return

    say("1 process, the same model in one piece ...")
    single = LlamaForCausalLM(cfg)
    single.load_state_dict(state)
    _, alone = _runs(single.eval(), ids, configs, steps, recall, say, forced=tokens)

    full = runs[0].logits
    print(
        f"Tensor parallelism on {world} CPU processes (gloo): a random-weight Llama, "
        f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads, {cfg.num_hidden_layers} layers; "
        f"{ids.shape[1]}-token random prompt, {steps} new tokens (IceCache decodes the full cache's tokens)."
    )
    for _, shard, threads in gathered:
        heads = f"{shard.first}..{shard.first + shard.count - 1}"
        print(f"  rank {shard.rank}: KV heads {heads} of {cfg.num_key_value_heads}, index threads {threads or 'all'}")
    print()
    print(
        f"{'cache':<15} {'top-1 = full':>12} {'|dlogit| vs full':>17} {'vs 1 process':>13} {'recall':>7} "
        f"{'decode':>10} {'device KV/rank':>15}"
    )
    bad = []
    for i, r in enumerate(runs):
        recalls = [x for rank_recalls, _, _ in gathered for x in rank_recalls[i]]
        mean_recall = sum(recalls) / len(recalls) if recalls else float("nan")
        agree = float((r.logits.argmax(-1) == torch.tensor(tokens)).float().mean())
        vs_full = float((r.logits - full).abs().max())
        vs_alone = float((r.logits - alone[i].logits).abs().max())
        print(
            f"{r.name:<15} {agree:>12.1%} {vs_full:>17.2e} {vs_alone:>13.2e} {mean_recall:>7.3f} "
            f"{r.decode_tps:>6.1f} t/s {r.device_bytes / 2**20:>11.2f} MiB"
        )
        if mean_recall >= 1 - 1e-6 and vs_full > EXACT_TOLERANCE:
            bad.append(r.name)
    print()
    print(
        "top-1 = full: decode steps whose top token is the full cache's. |dlogit|: largest logit difference "
        "from the full cache on these ranks, and from the same cache in one process. recall: share of the "
        "full attention mass on the attended tokens, over every rank's IceCache layers and heads (random "
        "weights attend almost uniformly, so small budgets keep little of it; `icecache demo` shows "
        "retrieval with a real model)."
    )
    if bad:
        raise RuntimeError(f"{', '.join(bad)} attends every token but differs from the full cache")


def _options(args: argparse.Namespace) -> dict:
    budgets = args.budgets if args.budgets else list(DEFAULT_BUDGETS)
    return dict(
        tokens=args.tokens or DEFAULT_TOKENS,
        new_tokens=args.new_tokens or DEFAULT_NEW_TOKENS,
        budgets=budgets,
        full_layers=2 if args.full_layers is None else args.full_layers,
        reuse=args.reuse,
        seed=args.seed,
        no_recall=args.no_recall,
        quiet=args.quiet,
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo with ``args.tp`` ranks: under torchrun (``RANK`` set) in this process,
    otherwise in ``args.tp`` spawned CPU processes. Options as for ``icecache demo`` (only
    ``--tokens``, ``--new-tokens``, ``--budgets``, ``--full-layers``, ``--reuse``, ``--seed``,
    ``--no-recall``, ``--quiet`` apply). Returns 0; raises if a cache that attends every
    token does not give the full cache's logits."""
    from icecache.runtime import IceCacheConfig, kv_heads_per_rank

    options = _options(args)
    # Every check before any process starts.
    for b in options["budgets"]:
        IceCacheConfig(budget=b, full_layers=options["full_layers"], reuse=options["reuse"], exact_until_indexed=False)
    if "RANK" in os.environ:  # under torchrun
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        kv_heads_per_rank(demo_config(), dist.get_world_size())
        _rank_main(options)
        return 0
    kv_heads_per_rank(demo_config(), args.tp)
    spawn_cpu(_rank_main, args.tp, (options,))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``torchrun --nproc-per-node N -m icecache.demo_tp [options]``."""
    from icecache.demo_args import add_arguments

    parser = argparse.ArgumentParser(prog="icecache demo --tp", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.tp = int(os.environ.get("WORLD_SIZE", args.tp or 1))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
