"""The second token's step, and the bridge after it: where time to the second token goes.

Per variant and round (interleaved), from an empty cache: the prompt in one forward (or in
``--prefill-chunk`` tokens at a time), then the second token's step timed alone, with a device
sync on each side; how many IceCache layers had left the bridge by its end; the steps until
no layer bridges (their count, time and median); and the median time per token of ``--steps``
steps after. Random weights of ``bench_gpu.py``'s shapes and a random prompt.

Before the ``--rounds`` rounds, at the first context, ``--cold`` rounds (default 1 on a GPU, 0
on the CPU) are each variant's cold start in the process: its first decode steps load the
kernels they launch (CUDA loads a kernel's module at its first launch) and make the host memory
they pin, which later prompts reuse. They are shown in
parentheses and left out of the median ratio, as ``bench_gpu.py`` reports its cold rounds.

Variants: ``full`` (the full cache, SDPA), ``ice`` (IceCache, defaults), ``ice-once`` (IceCache
with every reuse group leaving the bridge only once every index job is done, as before groups
left on their own), ``ice-normal`` (IceCache with its index builds on threads of normal
priority, as before they ran in the background; they then share the normal pool with the
inserts of the step that leaves the bridge, which wait behind them as before those moved off
the builds' pool). The last two are comparisons patched in here,
not options of the library.

    python benches/bench_leave.py --contexts 32768 --rounds 2            # on a GPU
    python benches/bench_leave.py --shape smollm2 --contexts 4096        # the dev machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--shape", default="llama8b", choices=["llama8b", "smollm2", "tiny"])
    ap.add_argument(
        "--variants", nargs="+", default=["full", "ice", "ice-once"], choices=["full", "ice", "ice-once", "ice-normal"]
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds per variant after the cold ones")
    ap.add_argument(
        "--cold", type=int, default=None, help="cold rounds first, at the first context (default: 1 on a GPU, else 0)"
    )
    ap.add_argument("--steps", type=int, default=16, help="steps timed after the bridge")
    ap.add_argument("--max-bridged", type=int, default=2000, help="give up on the bridge's end after this many steps")
    ap.add_argument("--prefill-chunk", type=int, default=None)
    args = ap.parse_args(argv)

    import bench_gpu
    import torch
    from icecache.runtime import IceCache, IceCacheConfig, enable
    from icecache.runtime.bridge import Bridges
    from icecache.runtime.layer import IceLayer
    from transformers import DynamicCache

    make_config, layers = bench_gpu.SHAPES[args.shape]
    cfg = make_config(layers)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = bench_gpu.build_model(cfg, device, 1)
    enable(model)
    if cuda:
        print(torch.cuda.get_device_name(), torch.__version__, flush=True)

    cold_rounds = args.cold if args.cold is not None else int(cuda)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(cache, tok):
        return model(tok, logits_to_keep=1, past_key_values=cache).logits[:, -1:].argmax(-1)

    decide = Bridges.decide
    index_kwargs = IceCacheConfig.index_kwargs

    def normal(self):
        """The index builds on threads of normal priority."""
        return {**index_kwargs(self), "background": False}

    def once(self, position, pending):
        """Every group bridges on while any index job runs."""
        if any(not f.done() for _, f in pending):
            self._decided_at, self._leaving = position, []
            return []
        return decide(self, position, pending)

    for n in args.contexts:
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
        chunk = args.prefill_chunk or n
        with torch.inference_mode():  # kernels and allocator warm
            step(DynamicCache(config=model.config), ids[:, : min(n, 1024)])
        rows = []
        cold = cold_rounds if n == args.contexts[0] else 0  # a process's first prompts
        for rnd in range(cold + args.rounds):
            for name in args.variants[rnd % len(args.variants) :] + args.variants[: rnd % len(args.variants)]:
                Bridges.decide = once if name == "ice-once" else decide
                IceCacheConfig.index_kwargs = normal if name == "ice-normal" else index_kwargs
                cache = DynamicCache(config=model.config) if name == "full" else IceCache(IceCacheConfig(), model)
                with torch.inference_mode():
                    sync()
                    t = time.perf_counter()
                    for i in range(0, n, chunk):
                        out = model(ids[:, i : i + chunk], logits_to_keep=1, past_key_values=cache)
                    tok = out.logits[:, -1:].argmax(-1)
                    sync()
                    prefill = time.perf_counter() - t
                    t = time.perf_counter()
                    tok = step(cache, tok)
                    sync()
                    second = time.perf_counter() - t
                    ice = [layer for layer in cache.layers if isinstance(layer, IceLayer)]
                    left = sum(not layer.bridging for layer in ice)
                    bridged = []
                    while isinstance(cache, IceCache) and cache.runtime.bridges.active:
                        if len(bridged) >= args.max_bridged:
                            break
                        t = time.perf_counter()
                        tok = step(cache, tok)
                        sync()
                        bridged.append(time.perf_counter() - t)
                    after = []
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        tok = step(cache, tok)
                        sync()
                        after.append(time.perf_counter() - t)
                row = dict(
                    variant=name,
                    cold=rnd < cold,
                    prefill_s=prefill,
                    second_ms=second * 1e3,
                    ttst_s=prefill + second,
                    left=f"{left} of {len(ice)}" if ice else "-",
                    bridged=len(bridged),
                    bridged_s=sum(bridged),
                    bridged_ms=statistics.median(bridged) * 1e3 if bridged else float("nan"),
                    tpot_ms=statistics.median(after[len(after) // 4 :]) * 1e3,
                )
                rows.append(row)
                label = f"round {rnd} (cold)" if row["cold"] else f"round {rnd}"
                print(
                    f"{n}: {label}: {name}: prefill {prefill:.2f} s, second token's step {row['second_ms']:.0f} ms "
                    f"(TTST {row['ttst_s']:.2f} s; layers that had left the bridge: {row['left']}), then "
                    f"{len(bridged)} bridged steps in {row['bridged_s']:.2f} s (median {row['bridged_ms']:.1f} ms), "
                    f"then {row['tpot_ms']:.1f} ms per token",
                    flush=True,
                )
                if isinstance(cache, IceCache):
                    cache.runtime.wait_indexed(errors=False)
                    with torch.inference_mode():
                        cache.reset()
                del cache
                if cuda:
                    torch.cuda.empty_cache()
        Bridges.decide, IceCacheConfig.index_kwargs = decide, index_kwargs
        full = [r["ttst_s"] for r in rows if r["variant"] == "full" and not r["cold"]]
        head = (
            "| context | variant | TTST s per round | x full (median, warm rounds) | second token's step ms | left "
            "| bridged steps (s; median ms) | then ms per token |"
        )
        print("\n" + head)
        print("|---|---|---|---|---|---|---|---|")
        for name in args.variants:
            mine = [r for r in rows if r["variant"] == name]
            ttst = statistics.median(r["ttst_s"] for r in mine if not r["cold"])
            ratio = f"{ttst / statistics.median(full):.2f}" if full else "-"
            ttsts = " / ".join(("({:.2f})" if r["cold"] else "{:.2f}").format(r["ttst_s"]) for r in mine)
            seconds = " / ".join("{:.0f}".format(r["second_ms"]) for r in mine)
            bridges = " / ".join(
                "{} ({:.1f}; {:.0f})".format(r["bridged"], r["bridged_s"], r["bridged_ms"]) for r in mine
            )
            lefts = ", ".join(r["left"] for r in mine)
            tpots = " / ".join("{:.1f}".format(r["tpot_ms"]) for r in mine)
            print(f"| {n} | {name} | {ttsts} | {ratio} | {seconds} | {lefts} | {bridges} | {tpots} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
