"""RULER with every KV-cache method (see :mod:`icecache.eval.ruler`)."""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from icecache._util import atomic_file, cache_keyword, progress_bar
from icecache.eval.recall.report import plotting_missing
from icecache.eval.ruler.data import TASKS, Sample, generate_samples, ruler_missing, score_task, task_spec
from icecache.eval.ruler.report import Prediction, RulerResult

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_LENGTHS",
    "METHODS",
    "RulerSettings",
    "check_arguments",
    "context_length",
    "evaluate_ruler",
    "evaluate_samples",
    "resolve_device",
]

#: Methods evaluated by default: the full cache, IceCache, the baselines
#: (:mod:`icecache.eval.ruler.methods`) and the oracle.
METHODS: Tuple[str, ...] = ("full", "icecache", "quest", "streamingllm", "oracle")
#: Budgets evaluated by default.
DEFAULT_BUDGETS: Tuple[int, ...] = (256, 1024)
#: Lengths evaluated by default.
DEFAULT_LENGTHS: Tuple[int, ...] = (4096,)


class RulerSettings:
    """The budget accounting shared by every method, and IceCache's own options.

    Attributes:
        sink, window, page_size, full_layers: as in :class:`icecache.IceCacheConfig` (defaults
            16, 32, 16, 2: IceCache's).
        icecache: further :class:`icecache.IceCacheConfig` fields for IceCache (e.g.
            ``{"budget_mode": "fixed"}``); ``exact_until_indexed`` defaults to ``False`` here, so
            that every decode step retrieves (the method is measured, not the bridge).
    """

    def __init__(
        self,
        sink: int = 16,
        window: int = 32,
        page_size: int = 16,
        full_layers: int = 2,
        icecache: Optional[Mapping[str, Any]] = None,
    ):
        self.sink, self.window, self.page_size, self.full_layers = sink, window, page_size, full_layers
        self.icecache: Dict[str, Any] = dict(icecache or {})
        bad = sorted(set(self.icecache) & {"budget", "sink", "window", "page_size", "full_layers"})
        if bad:
            raise ValueError(f"IceCache options {bad} are shared by every method: set them as RulerSettings fields")

    def ice_config(self, budget: int) -> Any:
        """IceCache's configuration at ``budget`` (validated by :class:`icecache.IceCacheConfig`)."""
        from icecache.runtime import IceCacheConfig

        options = dict(exact_until_indexed=False, **self.icecache)
        return IceCacheConfig(
            budget=budget,
            sink=self.sink,
            window=self.window,
            page_size=self.page_size,
            full_layers=self.full_layers,
            **options,
        )


def context_length(model: Any) -> Optional[int]:
    """The model's context (``max_position_embeddings`` of its text config), if it says."""
    value = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    return int(value) if value else None


def check_arguments(
    tasks: Sequence[str],
    lengths: Sequence[int],
    methods: Sequence[str],
    budgets: Sequence[int],
    settings: RulerSettings,
    *,
    context: Optional[int] = None,
    n_samples: int = 1,
) -> None:
    """Check an evaluation's arguments before any work.

    Raises:
        ValueError: an unknown task or method, no tasks, lengths or methods, a length below 1
            or longer than ``context`` (the model's), a budget below ``sink + window``, fewer
            than one sample, or an invalid IceCache option.
    """
    if not tasks:
        raise ValueError("no tasks")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown RULER task {t!r}; known: {', '.join(TASKS)}")
    if not methods:
        raise ValueError("no methods")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    if not lengths:
        raise ValueError("no lengths")
    for n in lengths:
        if n < 1:
            raise ValueError(f"lengths must be >= 1, got {n}")
        if context is not None and n > context:
            raise ValueError(f"length {n} is longer than the model's context of {context} tokens")
    if n_samples < 1:
        raise ValueError(f"samples per task must be >= 1, got {n_samples}")
    floor = settings.sink + settings.window
    if any(m != "full" for m in methods):
        if not budgets:
            raise ValueError("no budgets")
        for b in budgets:
            if b < floor:
                raise ValueError(
                    f"budget {b} is below sink + window = {settings.sink} + {settings.window} = {floor}: every "
                    "method attends at least the sink and the window"
                )
    if "icecache" in methods:
        for b in budgets:
            settings.ice_config(b)


def _eos_ids(model: Any, tokenizer: Any) -> List[int]:
    """Token ids that end an answer: the generation config's end tokens and the tokenizer's."""
    ids: List[int] = []
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        ids += [int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
    return sorted(set(ids))


def _greedy(model: Any, cache: Any, first: int, max_tokens: int, eos: Sequence[int]) -> List[int]:
    """Greedy decoding with ``cache`` from ``first``, the token the exact prefill chose (it is
    the answer's first token): one-token steps until an end token or ``max_tokens`` in all."""
    import torch

    out, kw = [first], cache_keyword(model)
    with torch.inference_mode():
        while len(out) < max_tokens and out[-1] not in eos:
            token = torch.tensor([[out[-1]]], device=model.device)
            logits = model(token, logits_to_keep=1, **{kw: cache}).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def _method_cache(method: str, budget: Optional[int], model: Any, prefix: Any, ids: Any, settings: RulerSettings):
    """The method's cache holding the prompt: made from the shared prefill ``prefix`` (or, for
    IceCache with ``effort="auto"``, which calibrates on the prompt's queries, by its own
    prefill of the same tokens: exact attention either way)."""
    import torch

    if method == "full":
        return copy.deepcopy(prefix)
    assert budget is not None
    if method == "icecache":
        from icecache.runtime import IceCache

        config = settings.ice_config(budget)
        if not config.calibrates:
            return IceCache.from_prefilled(config, model, prefix)
        cache = IceCache(config, model)
        with torch.inference_mode():
            model(ids, logits_to_keep=1, **{cache_keyword(model): cache})
        return cache
    from icecache.eval.ruler.methods import BaselineConfig, BudgetCache

    config = BaselineConfig(method, budget, settings.sink, settings.window, settings.page_size, settings.full_layers)
    return BudgetCache.from_prefilled(config, model, prefix)


def _empty_result(
    samples: Mapping[Tuple[str, int], Sequence[Sample]],
    methods: Sequence[str],
    budgets: Sequence[int],
    settings: RulerSettings,
    model_name: str,
    context: Optional[int],
) -> RulerResult:
    """The result that the predictions for ``samples`` go into, the arguments checked first."""
    budgets = sorted({int(b) for b in budgets})
    tasks = list(dict.fromkeys(t for t, _ in samples))
    lengths = sorted({n for _, n in samples})
    check_arguments(tasks, lengths, methods, budgets, settings, context=context)
    result = RulerResult(
        model=model_name,
        tasks=tasks,
        lengths=lengths,
        methods=list(methods),
        budgets=budgets,
        sink=settings.sink,
        window=settings.window,
        page_size=settings.page_size,
        full_layers=settings.full_layers,
    )
    result.info["icecache_options"] = dict(exact_until_indexed=False, **settings.icecache)
    return result


def evaluate_samples(
    model: Any,
    tokenizer: Any,
    samples: Mapping[Tuple[str, int], Sequence[Sample]],
    methods: Sequence[str] = METHODS,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    settings: Optional[RulerSettings] = None,
    *,
    model_name: str = "model",
    progress: bool = True,
    on_prediction: Optional[Callable[[RulerResult, Prediction], None]] = None,
) -> RulerResult:
    """Every method's answers to ``samples`` (per (task, length)), scored by RULER's metrics.

    Per sample: one exact prefill of the prompt into a full cache; its last position's argmax
    is the answer's first token for every method (as ``model.generate`` does with any cache,
    IceCache's included: prefill attention is exact). Then each method decodes greedily from a
    cache holding that prefill (``full``: a copy; ``icecache``: :meth:`icecache.IceCache.from_prefilled`
    with :meth:`RulerSettings.ice_config`; the others :class:`~icecache.eval.ruler.methods.BudgetCache`)
    up to the task's answer allowance or an end token.

    Args:
        on_prediction: called after each prediction with the results so far (e.g. to save it).

    Raises:
        ValueError: bad arguments (:func:`check_arguments`), before any work.
    """
    import torch

    settings = settings or RulerSettings()
    result = _empty_result(samples, methods, budgets, settings, model_name, context_length(model))
    runs = result.runs()
    from transformers import DynamicCache

    from icecache.runtime import enable

    enable(model)
    eos = _eos_ids(model, tokenizer)
    total = sum(len(s) for s in samples.values()) * len(runs)
    bar = progress_bar(total=total, desc="ruler", enable=progress)
    t_prefill = t_decode = 0.0
    try:
        for (task, length), group in samples.items():
            allowance = task_spec(task).tokens_to_generate
            for sample in group:
                bar.set_postfix_str(f"{task} {length} #{sample.index}")
                ids = tokenizer(sample.input, add_special_tokens=not sample.chat, return_tensors="pt").input_ids
                ids = ids.to(model.device)
                t0 = time.perf_counter()
                prefix = DynamicCache(config=model.config)
                with torch.inference_mode():
                    out = model(ids, logits_to_keep=1, **{cache_keyword(model): prefix})
                    first = int(out.logits[0, -1].argmax())
                t_prefill += time.perf_counter() - t0
                for method, budget in runs:
                    t1 = time.perf_counter()
                    cache = _method_cache(method, budget, model, prefix, ids, settings)
                    tokens = _greedy(model, cache, first, allowance, eos)
                    del cache
                    seconds = time.perf_counter() - t1
                    t_decode += seconds
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    (score,) = score_task(task, [text], [sample.outputs])
                    pred = Prediction(
                        task, sample.index, length, int(ids.shape[1]), method, budget, text,
                        list(sample.outputs), score, len(tokens), seconds,
                    )  # fmt: skip
                    result.predictions.append(pred)
                    if on_prediction is not None:
                        on_prediction(result, pred)
                    bar.update(1)
                del prefix
    finally:
        bar.close()
        result.timings.update(prefill_s=t_prefill, decode_s=t_decode)
    return result


def resolve_device(device: Optional[str] = None, dtype: Optional[str] = None) -> Tuple[str, str]:
    """The device and weight dtype an evaluation runs in: by default CUDA with bfloat16 where
    torch sees a GPU, else the CPU with float32.

    Raises:
        ValueError: an unknown dtype, or a device torch cannot use.
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU")
    if dtype is None:
        dtype = "bfloat16" if kind == "cuda" else "float32"
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r} for weights; e.g. float32, bfloat16, float16")
    return device, dtype


def _load(name: str, device: str, dtype: str) -> Tuple[Any, Any]:
    import torch

    from icecache import models

    lm, tokenizer = models.load_model(name, dtype=getattr(torch, dtype))
    return lm.to(device), tokenizer


#: A worker process's model and what it evaluates (:func:`_worker_start`).
_WORKER: Dict[str, Any] = {}


def _worker_start(
    loader: Callable[[str, str, str], Tuple[Any, Any]],
    name: str,
    device: str,
    dtype: str,
    threads: Optional[int],
    job: Dict[str, Any],
) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    _WORKER["model"], _WORKER["tokenizer"] = loader(name, device, dtype)
    _WORKER.update(job, model_name=name)


def _worker_sample(key: Tuple[str, int], sample: Sample) -> RulerResult:
    w = _WORKER
    return evaluate_samples(
        w["model"], w["tokenizer"], {key: [sample]}, w["methods"], w["budgets"], w["settings"],
        model_name=w["model_name"], progress=False,
    )  # fmt: skip


def _evaluate_in_workers(
    samples: Mapping[Tuple[str, int], Sequence[Sample]],
    result: RulerResult,
    settings: RulerSettings,
    *,
    name: str,
    device: str,
    dtype: str,
    workers: int,
    threads: Optional[int],
    progress: bool,
    on_prediction: Optional[Callable[[RulerResult, Prediction], None]] = None,
    loader: Callable[[str, str, str], Tuple[Any, Any]] = _load,
) -> None:
    """:func:`evaluate_samples` of ``samples`` spread over ``workers`` processes, each with its
    own copy of the model (``loader(name, device, dtype)``: a picklable function returning the
    model and tokenizer), one sample at a time; the predictions go into ``result`` (in the
    order of a run in one process) and to ``on_prediction`` as they come."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    job = dict(methods=result.methods, budgets=result.budgets, settings=settings)
    bar = progress_bar(total=sum(len(g) for g in samples.values()) * len(result.runs()), desc="ruler", enable=progress)
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),  # CUDA cannot be used in a forked child
        initializer=_worker_start,
        initargs=(loader, name, device, dtype, threads, job),
    )
    try:
        futures = [pool.submit(_worker_sample, key, s) for key, group in samples.items() for s in group]
        for fut in as_completed(futures):
            part = fut.result()
            for pred in part.predictions:
                result.predictions.append(pred)
                if on_prediction is not None:
                    on_prediction(result, pred)
            for k, v in part.timings.items():
                result.timings[k] = result.timings.get(k, 0.0) + v
            bar.update(len(part.predictions))
    finally:
        # A failed sample (the rest would fail alike) or an interrupt (Ctrl-C, a time limit's
        # SIGINT) drops the queued samples; only those already running are waited for.
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    _sort_predictions(result)


def _sort_predictions(result: RulerResult) -> None:
    """Put ``result``'s predictions in the order of a run in one process."""
    tasks = {t: i for i, t in enumerate(result.tasks)}
    runs = {r: i for i, r in enumerate(result.runs())}
    result.predictions.sort(key=lambda p: (tasks[p.task], p.length, p.index, runs[(p.method, p.budget)]))


def _resumable(out: Path, run: Dict[str, Any]) -> List[Prediction]:
    """The predictions that an earlier run saved in ``out`` (none if it holds none), after
    checking that it ran with the settings ``run``; a line cut short by a killed run is skipped.

    Raises:
        ValueError: the earlier run's settings differ.
    """
    saved, lines = out / "ruler.json", out / "ruler_predictions.jsonl"
    if not saved.is_file() or not lines.is_file():
        return []
    data = json.loads(saved.read_text())
    info = data.get("info", {})
    then = dict(
        model=data.get("model"),
        sink=data.get("sink"),
        window=data.get("window"),
        page_size=data.get("page_size"),
        full_layers=data.get("full_layers"),
        icecache_options=info.get("icecache_options"),
        seed=info.get("seed"),
        samples_per_task=info.get("samples_per_task"),
        dtype=info.get("dtype"),
        device_type=info.get("device_type"),
    )
    differ = [f"{k} {then[k]!r} (now {run[k]!r})" for k in run if then.get(k) != run[k]]
    if differ:
        raise ValueError(f"cannot resume the run in {out}: it ran with {', '.join(differ)}")
    preds = []
    for line in lines.read_text().splitlines():
        try:
            preds.append(Prediction(**json.loads(line)))
        except (ValueError, TypeError):  # a line cut short, or not a prediction
            continue
    return preds


def evaluate_ruler(
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    n_samples: int = 2,
    methods: Sequence[str] = METHODS,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    settings: Optional[RulerSettings] = None,
    *,
    model: str = "smollm2",
    seed: int = 42,
    cache_dir: Union[str, os.PathLike, None] = None,
    out_dir: Union[str, os.PathLike, None] = None,
    plot: bool = True,
    progress: bool = True,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    workers: int = 1,
    threads: Optional[int] = None,
    resume: bool = False,
) -> RulerResult:
    """RULER on a model :func:`icecache.models.load_model` loads: ``n_samples`` samples per task
    and length (:func:`~icecache.eval.ruler.data.generate_samples`, cached), then
    :func:`evaluate_samples`.

    With ``out_dir``, every prediction is appended to ``ruler_predictions.jsonl`` as it is made,
    and ``ruler_table.md`` and ``ruler.json`` are rewritten after each sample; at the end (with
    ``plot``) ``ruler_vs_length.png``.

    Args:
        device, dtype: where the model runs and its weights' dtype (:func:`resolve_device`:
            by default CUDA in bfloat16 where there is a GPU, else the CPU in float32).
        workers: processes that answer samples in parallel, each with its own copy of the model
            (1: this process). Decoding a small model is bound by the host's per-step work, so
            on a GPU several workers share it well; the samples are generated in parallel too.
        threads: torch threads of each worker (default: torch's).
        resume: keep the predictions already saved in ``out_dir`` by a run with the same
            settings and samples per task (one that stopped, or asked for fewer tasks or
            lengths) and answer only the samples that lack some of their runs.

    Raises:
        ValueError: bad arguments (:func:`check_arguments`; the length against the model's
            context once it is loaded; the device, dtype or ``workers``; ``resume`` without
            ``out_dir``, or over a run with other settings), before the slow work.
        ImportError: the ``ruler`` extra is missing, or the plot's matplotlib is.
    """
    settings = settings or RulerSettings()
    check_arguments(list(tasks), list(lengths), list(methods), list(budgets), settings, n_samples=n_samples)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if resume and out_dir is None:
        raise ValueError("resume needs out_dir: the directory of the run to resume")
    device, dtype = resolve_device(device, dtype)
    import torch

    out = Path(out_dir) if out_dir is not None else None
    run = dict(
        model=model,
        sink=settings.sink,
        window=settings.window,
        page_size=settings.page_size,
        full_layers=settings.full_layers,
        icecache_options=dict(exact_until_indexed=False, **settings.icecache),
        seed=seed,
        samples_per_task=n_samples,  # a sample's index names another sample in another count
        dtype=dtype,
        device_type=torch.device(device).type,
    )
    earlier = _resumable(out, run) if resume and out is not None else []
    missing = ruler_missing()
    if missing is not None:
        raise ImportError(missing)
    if out_dir is not None and plot and plotting_missing() is not None:
        raise ImportError(f"the RULER plot needs what is missing: {plotting_missing()}; or pass plot=False")
    t0 = time.perf_counter()
    # With workers, this process needs only the tokenizer and the model's context.
    lm, tokenizer = _load(model, device if workers == 1 else "cpu", dtype)
    context = context_length(lm)
    check_arguments(list(tasks), list(lengths), list(methods), list(budgets), settings, context=context)
    t_load = time.perf_counter() - t0

    def note(text: str) -> None:
        if progress:
            print(text, file=sys.stderr, flush=True)

    keys = [(task, length) for task in tasks for length in lengths]
    t0 = time.perf_counter()

    def generate(key: Tuple[str, int]) -> List[Sample]:
        return generate_samples(key[0], key[1], tokenizer, n_samples, seed=seed, cache_dir=cache_dir, log=note)

    # The first alone: it saves the tokenizer and the sentence data that the others share.
    samples: Dict[Tuple[str, int], List[Sample]] = {keys[0]: generate(keys[0])}
    if workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:  # each generator is a process of its own
            samples.update(zip(keys[1:], pool.map(generate, keys[1:])))
    else:
        samples.update((key, generate(key)) for key in keys[1:])
    t_samples = time.perf_counter() - t0

    res = _empty_result(samples, methods, budgets, settings, model, context)
    res.info.update(
        seed=seed,
        samples_per_task=n_samples,
        context=context,
        device=device,
        device_type=run["device_type"],
        dtype=dtype,
        workers=workers,
    )
    # A sample is done when every run of it was saved; the others are answered (again).
    runs = res.runs()
    wanted = {(t, n, s.index) for (t, n), group in samples.items() for s in group}
    have: Dict[Tuple[str, int, int], Dict[Tuple[str, Optional[int]], Prediction]] = {}
    for pred in earlier:
        if (pred.task, pred.length, pred.index) in wanted and (pred.method, pred.budget) in runs:
            have.setdefault((pred.task, pred.length, pred.index), {})[(pred.method, pred.budget)] = pred
    done = {key for key, got in have.items() if len(got) == len(runs)}
    res.predictions.extend(p for key in done for p in have[key].values())
    todo = {k: [s for s in g if (k[0], k[1], s.index) not in done] for k, g in samples.items()}
    todo = {k: g for k, g in todo.items() if g}
    if earlier:
        note(f"resuming: {len(done)} of {len(wanted)} samples done, {sum(len(g) for g in todo.values())} to answer")

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with atomic_file(out / "ruler_predictions.jsonl") as path:
            path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in res.predictions))

    def save(pred: Prediction) -> None:
        if out is None:
            return
        with open(out / "ruler_predictions.jsonl", "a") as f:
            f.write(json.dumps(asdict(pred)) + "\n")
        if (pred.method, pred.budget) == runs[-1]:  # a sample's last run
            res.save_table(out / "ruler_table.md")
            res.save_json(out / "ruler.json")

    def take(_: RulerResult, pred: Prediction) -> None:
        res.predictions.append(pred)
        save(pred)

    if todo and workers == 1:
        answered = evaluate_samples(
            lm, tokenizer, todo, methods, budgets, settings, model_name=model, progress=progress, on_prediction=take
        )
        res.timings.update(answered.timings)
    elif todo:
        del lm
        _evaluate_in_workers(
            todo, res, settings, name=model, device=device, dtype=dtype, workers=workers, threads=threads,
            progress=progress, on_prediction=lambda _, pred: save(pred),
        )  # fmt: skip
    _sort_predictions(res)
    res.timings.update(load_s=t_load, samples_s=t_samples)
    if out is not None:
        res.save_table(out / "ruler_table.md")
        res.save_json(out / "ruler.json")
        if plot:
            res.save_plot(out / "ruler_vs_length.png")
    return res
