#!/usr/bin/env python
"""Host time of a decode step's IceCache work, per layer step, on the CPU.

A step graph replays the device's work; what the host still does per IceCache layer and step is
its own Python and native calls around the replay (:mod:`icecache.runtime.stepgraph`):
``IceLayer.step_count`` (the token counted into the window), ``StepGraph._stage`` per graph
segment (its layers' look-ahead jobs waited for, the windows' inserted tokens dropped, the
staging uploaded) and ``StepGraph._after`` (every layer's next job prepared and queued). On
the CPU, ``StepGraph.enabled = True`` runs the same phases eagerly, so their host time can be
timed here without a GPU; the GPU host's Python is slower (gVisor), and there
the uploads are CUDA calls, so this is a lower bound of the same work, for comparing changes.

The model has the Llama-3.1-8B attention shape (32 query heads, 8 KV heads of 128) with small
hidden and MLP sizes (random weights), ``--layers`` layers, the first a full-cache layer. After
a ``--context``-token prompt and ``--warmup`` steps, ``--steps`` steps are timed per round.
Reported per IceCache layer step: each phase's host time, the time the stage waited for
the look-ahead worker (its selection, not host work), and the host work in all (the phases
less that wait).

    python benches/bench_host_step.py [--context 4096] [--layers 8] [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import torch
    from icecache.runtime import IceCache, IceCacheConfig
    from icecache.runtime.layer import IceLayer
    from icecache.runtime.stepgraph import StepGraph
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=1 << 20,
    )
    model = LlamaForCausalLM(config).eval()
    owners = {"step_count": IceLayer, "_stage": StepGraph, "_after": StepGraph}
    phases = tuple(owners)
    spent: dict = collections.defaultdict(float)
    originals = {name: getattr(owner, name) for name, owner in owners.items()}

    def timed(name):
        original = originals[name]

        def wrapper(self, *a, **k):
            t = time.perf_counter()
            try:
                return original(self, *a, **k)
            finally:
                spent[name] += time.perf_counter() - t

        return wrapper

    for name, owner in owners.items():
        setattr(owner, name, timed(name))
    ids = torch.randint(1, config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(1))
    print("| round | layer steps | count us | stage us (of it waiting) | after us | host work us |")
    print("|---|---|---|---|---|---|")
    try:
        for r in range(args.rounds):
            cache = IceCache(IceCacheConfig(full_layers=1), model)
            cache.step_graph.enabled = True  # the step graph's phases, run eagerly
            with torch.inference_mode():
                out = model(ids, cache=cache, logits_to_keep=1)
                cache.wait_indexed()
                token = out.logits[:, -1:].argmax(-1)
                for s in range(args.warmup + args.steps):
                    if s == args.warmup:
                        spent.clear()
                        wait0, steps0 = cache.stats.wait_s, cache.step_graph.steps
                    token = model(token, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            graph_steps = cache.step_graph.steps - steps0
            if graph_steps != args.steps:
                raise RuntimeError(f"{graph_steps} of {args.steps} steps ran in the step graph's phases")
            n = graph_steps * len([layer for layer in cache.layers if isinstance(layer, IceLayer)])
            waited = cache.stats.wait_s - wait0
            per = {name: spent[name] / n * 1e6 for name in phases}
            host = sum(per.values()) - waited / n * 1e6
            print(
                f"| {r} | {n} | {per['step_count']:.1f} | {per['_stage']:.1f} ({waited / n * 1e6:.1f}) "
                f"| {per['_after']:.1f} | **{host:.1f}** |",
                flush=True,
            )
            cache.reset()
    finally:
        for name, original in originals.items():
            setattr(owners[name], name, original)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
