"""Teacher-forced greedy agreement of every method with the full cache (see :mod:`icecache.eval.agreement`)."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any, Callable, List, Literal, NamedTuple, Optional, Sequence, Union

from icecache._util import cache_keyword, progress_bar
from icecache.eval.agreement.methods import BUDGET_MODE, EMULATED, METHODS, Emulation, emulating
from icecache.eval.agreement.report import AgreementResult, PromptRun, plotting_missing

__all__ = [
    "DEFAULT_BUDGETS",
    "Agreement",
    "Prompt",
    "agreement",
    "served_layers",
    "evaluate_prompts",
    "evaluate_agreement",
]

#: Budgets evaluated by default.
DEFAULT_BUDGETS = (128, 256, 512)


class Prompt:
    """One prompt: its name, kind (``"prose"`` or ``"code"``) and token ids (no special tokens)."""

    def __init__(self, name: str, kind: str, ids: Sequence[int]):
        if len(ids) < 2:
            raise ValueError(f"prompt {name!r} needs at least 2 tokens, has {len(ids)}")
        self.name, self.kind, self.ids = name, kind, [int(t) for t in ids]


class Agreement(NamedTuple):
    """How one method's greedy tokens compare with the full cache's over the same steps."""

    #: Share of the steps where the method's argmax equals the full cache's.
    share: float
    #: The first step (0-based) where they differ; ``None`` if they never do.
    first_divergence: Optional[int]


def agreement(reference: Sequence[int], predicted: Sequence[int]) -> Agreement:
    """Compare the full cache's greedy tokens ``reference`` with a method's ``predicted`` ones."""
    if len(reference) != len(predicted) or not reference:
        raise ValueError(f"need two equally long, non-empty token lists; got {len(reference)} and {len(predicted)}")
    same = [int(a) == int(b) for a, b in zip(reference, predicted)]
    return Agreement(sum(same) / len(same), next((i for i, s in enumerate(same) if not s), None))


def served_layers(model: Any, full_layers: int) -> List[int]:
    """The layers an :class:`icecache.IceCache` with ``full_layers`` serves on ``model``: its
    full-attention layers after the first ``full_layers`` (sliding-window layers keep their own
    window). The emulated methods serve the same layers."""
    from icecache.runtime.cache import _layer_types

    full = [
        i for i, kind in enumerate(_layer_types(model.config.get_text_config(decoder=True))) if kind == "full_attention"
    ]
    return full[full_layers:]


def _decode(model: Any, cache: Any, first: int, steps: int, forced: Optional[Sequence[int]]) -> List[int]:
    """Greedy next tokens of ``steps`` one-token steps, starting from token ``first``; each step
    feeds ``forced[i - 1]`` (teacher forcing) or, without ``forced``, the previous prediction."""
    import torch

    out: List[int] = []
    token, kw = first, cache_keyword(model)
    with torch.inference_mode():
        for i in range(steps):
            logits = model(torch.tensor([[token]]), logits_to_keep=1, **{kw: cache}).logits
            out.append(int(logits[0, -1].argmax()))
            token = forced[i] if forced is not None else out[-1]
    return out


def _calibration(cache: Any) -> dict:
    """What ``effort="auto"`` found on a prefilled IceCache: the index worker's calibration
    seconds, the calibrated layers, and every (layer, KV head)'s effort and whether it reached
    the target."""
    from icecache.runtime.layer import IceLayer

    cals = [
        c
        for layer in cache.layers
        if isinstance(layer, IceLayer) and layer.leader is None
        for index in layer.indexes
        for c in index.calibrations or []
    ]
    layers = sum(
        1
        for layer in cache.layers
        if isinstance(layer, IceLayer) and layer.leader is None and any(i.calibrations for i in layer.indexes)
    )
    return dict(
        seconds=cache.stats.calibrate_s,
        layers=layers,
        efforts=[c.effort for c in cals],
        reached=sum(c.reached for c in cals),
        heads=len(cals),
        k=cals[0].k if cals else None,
    )


def evaluate_prompts(
    model: Any,
    prompts: Sequence[Prompt],
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    methods: Sequence[str] = METHODS,
    *,
    new_tokens: int = 64,
    sink: int = 16,
    window: int = 32,
    page_size: int = 16,
    full_layers: int = 2,
    threads: Optional[int] = None,
    effort: Union[float, Literal["auto"], None] = None,
    page_format: str = "native",
    refresh: int = 1,
    group_view: Optional[bool] = None,
    progress: bool = True,
    on_prompt: Optional[Callable[[AgreementResult], None]] = None,
) -> AgreementResult:
    """Agreement of each method and budget with the full cache on each prompt.

    Per prompt: one exact prefill of all tokens but the last (shared by every run); the full
    cache then decodes ``new_tokens`` greedy tokens from the last prompt token; every method
    at every budget decodes the same steps fed the full cache's tokens, and its argmax at each
    step is compared with the full cache's. IceCache runs with
    ``IceCacheConfig(budget, sink, window, page_size, full_layers, threads, effort, page_format,
    refresh, group_view)`` (``effort`` and ``group_view`` ``None``: the config's defaults)
    (and ``budget_mode="adaptive"`` for ``icecache_adaptive``), ``exact_until_indexed=False``
    (every step retrieves) and its defaults otherwise; the
    emulated methods serve the same layers with the same sink and window.
    With ``effort="auto"`` IceCache calibrates on the prompt's queries, which the shared prefill
    does not keep: it runs its own prefill of the same tokens (exact attention either way), and
    ``result.info["calibration"]`` records per (prompt, method, budget) the calibration's seconds and
    efforts.

    Args:
        on_prompt: called with the results so far after each prompt (e.g. to save them).

    Raises:
        ValueError: unknown methods, bad budgets or settings (checked before any work).
    """
    import torch
    from transformers import DynamicCache

    from icecache.runtime import IceCache, IceCacheConfig, enable

    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"unknown or no methods {list(methods)}; known: {list(METHODS)}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    budgets = sorted({int(b) for b in budgets})
    configs = {
        (m, b): IceCacheConfig(
            budget=b,
            sink=sink,
            window=window,
            page_size=page_size,
            full_layers=full_layers,
            threads=threads,
            budget_mode=mode,
            effort=IceCacheConfig.effort if effort is None else effort,
            page_format=page_format,
            refresh=refresh,
            group_view=IceCacheConfig.group_view if group_view is None else group_view,
            exact_until_indexed=False,  # every step retrieves: the method is measured, not the bridge
        )
        for m, mode in BUDGET_MODE.items()
        for b in budgets
    }  # validates budgets and settings before the slow work
    layers = frozenset(served_layers(model, full_layers))
    emulations = {(m, b): Emulation(m, b, sink, window, page_size, layers) for m in EMULATED for b in budgets}
    result = AgreementResult(
        methods=list(methods),
        budgets=budgets,
        new_tokens=new_tokens,
        sink=sink,
        window=window,
        page_size=page_size,
        full_layers=full_layers,
        served_layers=sorted(layers),
    )
    result.info["page_format"] = page_format
    result.info["refresh"] = refresh
    first = next(iter(configs.values()))
    result.info["effort"], result.info["group_view"] = first.effort, first.group_view
    enable(model)
    bar = progress_bar(total=len(prompts) * (1 + len(methods) * len(budgets)), desc="agreement", enable=progress)
    try:
        for prompt in prompts:
            t0 = time.perf_counter()
            prefix = DynamicCache(config=model.config)
            with torch.inference_mode():
                model(torch.tensor([prompt.ids[:-1]]), logits_to_keep=1, **{cache_keyword(model): prefix})
            with emulating(model, None):
                reference = _decode(model, copy.deepcopy(prefix), prompt.ids[-1], new_tokens, None)
            bar.update(1)
            for method in methods:
                for b in budgets:
                    if method in BUDGET_MODE and configs[(method, b)].calibrates:
                        cache = IceCache(configs[(method, b)], model)
                        with torch.inference_mode():
                            model(torch.tensor([prompt.ids[:-1]]), logits_to_keep=1, **{cache_keyword(model): cache})
                        cache.wait_indexed()
                        run = f"{prompt.name} {method} B={b}"
                        result.info.setdefault("calibration", {})[run] = _calibration(cache)
                        got = _decode(model, cache, prompt.ids[-1], new_tokens, reference)
                        del cache
                    elif method in BUDGET_MODE:
                        cache = IceCache.from_prefilled(configs[(method, b)], model, prefix)
                        got = _decode(model, cache, prompt.ids[-1], new_tokens, reference)
                        del cache
                    else:
                        with emulating(model, emulations[(method, b)]):
                            got = _decode(model, copy.deepcopy(prefix), prompt.ids[-1], new_tokens, reference)
                    a = agreement(reference, got)
                    result.runs.append(
                        PromptRun(prompt.name, prompt.kind, len(prompt.ids), method, b, a.share, a.first_divergence)
                    )
                    bar.update(1)
            result.timings[prompt.name] = time.perf_counter() - t0
            if on_prompt is not None:
                on_prompt(result)
    finally:
        bar.close()
    return result


def evaluate_agreement(
    n_prose: int = 2,
    n_code: int = 2,
    n_tokens: int = 4096,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    methods: Sequence[str] = METHODS,
    *,
    new_tokens: int = 64,
    model: str = "smollm2",
    seed: int = 0,
    out_dir: Union[str, os.PathLike, None] = None,
    plot: bool = True,
    progress: bool = True,
    **settings: Any,
) -> AgreementResult:
    """Agreement on real prompts shipped with the package (:func:`icecache.texts.documents`):
    ``n_prose`` Austen and ``n_code`` Python documents of ``n_tokens`` tokens (``seed``).

    With ``out_dir``, ``agreement_table.md`` and ``agreement.json`` are written after every
    prompt, then (with ``plot``) ``agreement_vs_budget.png``. A plot that needs a missing
    matplotlib raises ``ImportError`` before any work.

    Args:
        model: ``"smollm2"`` or ``"gemma3"`` (:func:`icecache.models.load_model`).
        settings: ``sink``, ``window``, ``page_size``, ``full_layers``, ``threads``, ``effort``,
            ``page_format``, ``refresh``, ``group_view`` (see :func:`evaluate_prompts`).
    """
    from icecache import models, texts

    if out_dir is not None and plot:
        missing = plotting_missing()
        if missing is not None:
            raise ImportError(f"the agreement plot needs what is missing: {missing}; or pass plot=False")
    lm, tokenizer = models.load_model(model)
    prompts = []
    for kind, n in (("prose", n_prose), ("code", n_code)):
        if n > 0:
            docs = texts.documents(tokenizer, n, n_tokens, seed=seed, kind=kind)
            sources = texts.document_sources(n, seed=seed, kind=kind)
            prompts += [Prompt(f"{kind}-{i} {src}", kind, ids) for i, (ids, src) in enumerate(zip(docs, sources))]

    def save(res: AgreementResult) -> None:
        if out_dir is not None:
            res.save_table(Path(out_dir) / "agreement_table.md")
            res.save_json(Path(out_dir) / "agreement.json")

    res = evaluate_prompts(
        lm, prompts, budgets, methods, new_tokens=new_tokens, progress=progress, on_prompt=save, **settings
    )
    res.info.update(model=model, n_tokens=n_tokens, seed=seed)
    res.info["prompt_starts"] = {p.name: tokenizer.decode(p.ids[:12]) for p in prompts}
    save(res)
    if out_dir is not None and plot:
        res.save_plot(Path(out_dir) / "agreement_vs_budget.png")
    return res
