"""Configuration of the IceCache runtime, validated when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any, Callable, Literal, Optional, Sequence, Union

__all__ = ["CALIBRATION_POSITIONS", "IceCacheConfig"]

#: Default look-ahead superset: this many times the pages a step attends, and at least
#: ``SUPERSET_MIN`` pages (see ``superset_pages``).
SUPERSET_FACTOR = 4
SUPERSET_MIN = 32
#: How a layer's page budget is shared among its KV heads (see ``budget_mode``).
BUDGET_MODES = ("fixed", "adaptive")
#: How the host page stores hold K and V (see ``page_format``).
PAGE_FORMATS = ("native", "int8", "k8v4")
#: With ``effort="auto"``: each IceCache layer calibrates its index on the queries of (up to) this
#: many last prompt positions, of every query head.
CALIBRATION_POSITIONS = 64
#: The core's re-rank factor: a ``k``-query re-ranks ``2 * k * max(effort, 1)`` keys of its field
#: of view (see ``HeadForest.calibrate``).
_RERANK = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _non_negative_int(value: Any) -> Optional[str]:
    return None if _is_int(value) and value >= 0 else f"must be a non-negative int, got {value!r}"


def _optional(check: Callable[[Any], Optional[str]]) -> Callable[[Any], Optional[str]]:
    return lambda value: None if value is None else check(value)


def _positive_int(value: Any) -> Optional[str]:
    return None if _is_int(value) and value >= 1 else f"must be an int >= 1 (or None), got {value!r}"


def _effort(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return None if value == "auto" else f'must be a number or "auto", got the string {value!r}'
    if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value)) and float(value) > 0:
        return None
    return f"must be > 0 and finite, got {value!r}"


def _core_refusal(name: str, value: Any, make: Callable[[], Any]) -> Optional[str]:
    """What the core says is wrong with ``value`` when ``make`` builds a throw-away object with
    it, or None: so the limits live in one place."""
    try:
        make()
    except (TypeError, ValueError, OverflowError) as exc:
        # The core's message may start with the parameter's name (and value), which ours gives.
        message = str(exc).removeprefix(f"{name} = {value!r} ").removeprefix(f"{name} ")
        return message if "got" in message else f"{message} (got {value!r})"
    return None


def _index_parameter(name: str) -> Callable[[Any], Optional[str]]:
    """A parameter of :class:`icecache.HeadForest` whose range the core checks: an empty index
    made with it says whether it is valid."""

    def check(value: Any) -> Optional[str]:
        if isinstance(value, bool):
            return f"must be a number, got {value!r}"
        if name == "promotion" and isinstance(value, str):
            return f"must be a ratio in (0, 1) or a sequence of them, got {value!r}"
        from icecache import DCIIndex

        return _core_refusal(name, value, lambda: DCIIndex(1, **{name: value}))

    return check


def _page_size(value: Any) -> Optional[str]:
    """A page size the core's forests accept, checked by a forest of one key."""
    problem = _non_negative_int(value)
    if problem is not None:
        return problem
    import numpy as np

    from icecache import HeadForest

    one_key = np.zeros((1, 1, 1), dtype=np.float32)
    return _core_refusal("page_size", value, lambda: HeadForest(one_key, page_size=value, threads=1))


def _device(value: Any) -> Optional[str]:
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        return str(exc)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            return f"{value!r} names CUDA device {device.index or 0}, but {count} CUDA device(s) are available"
    return None


def _budget_mode(value: Any) -> Optional[str]:
    return None if value in BUDGET_MODES else f"must be one of {BUDGET_MODES}, got {value!r}"


def _page_format(value: Any) -> Optional[str]:
    return None if value in PAGE_FORMATS else f"must be one of {PAGE_FORMATS}, got {value!r}"


def _bool(value: Any) -> Optional[str]:
    return None if isinstance(value, bool) else f"must be True or False, got {value!r}"


# One check per field: it returns what is wrong with a value, or None. Every field has one.
_FIELD_CHECKS: dict[str, Callable[[Any], Optional[str]]] = {
    "budget": _non_negative_int,
    "page_size": _page_size,
    "sink": _non_negative_int,
    "window": _non_negative_int,
    "full_layers": _non_negative_int,
    "reuse": _non_negative_int,
    "budget_mode": _budget_mode,
    "lookahead": _bool,
    "exact_until_indexed": _bool,
    "superset_pages": _optional(_non_negative_int),
    "successors": _non_negative_int,
    "refresh": _non_negative_int,
    "cuda_graphs": _bool,
    "step_graph": _bool,
    "pool_pages": _optional(_non_negative_int),
    "effort": _effort,
    "group_view": _bool,
    "num_simple": _optional(_index_parameter("num_simple")),
    "num_composite": _optional(_index_parameter("num_composite")),
    "promotion": _optional(_index_parameter("promotion")),
    "seed": _optional(_index_parameter("seed")),
    "threads": _optional(_positive_int),
    "device": _optional(_device),
    "page_format": _page_format,
    "prefill_chunk": _optional(_positive_int),
}


@dataclass(frozen=True)
class IceCacheConfig:
    """How much of the KV cache each decode step attends to, and how it is laid out.

    The budget counts the tokens that enter the attention softmax per (layer, KV head, step):
    ``sink`` first tokens + up to ``window`` most recent tokens + the retrieved pages, at most
    ``(budget - sink - window) // page_size`` of them (semantic pages may be partly filled,
    so the retrieved tokens can be fewer). The measurements behind the defaults and the opt-in
    options are in benches/RESULTS.md, in the sections named below.

    Attributes:
        budget: tokens attended per step (see above).
        page_size: tokens per semantic page (the range :class:`icecache.HeadForest` accepts).
        sink: first tokens of each sequence, always attended, kept on the device.
        window: most recent tokens, always attended, kept on the device; a multiple of
            ``page_size`` (when full, its oldest page of tokens moves to the index).
        full_layers: leading full-attention layers that keep the whole cache (their attention
            is broad).
        budget_mode: how each layer's pages are shared among its KV heads at a step.
            ``"adaptive"`` (default): the sequence's KV heads together attend
            ``H_kv * retrieved_pages`` pages, those with the largest share of their head's mass
            over its candidate pages (:func:`icecache.attend.ranked_decode_attention`), so heads
            whose attention is spread get more pages and peaked heads fewer. ``"fixed"``: every
            KV head attends ``retrieved_pages``. Both attend as many tokens per layer and hold
            the same device memory. The candidates are the device pool (look-ahead) or, with
            fresh selection, a superset of ``selected_pages`` per head. Section "Adaptive
            per-head page budgets".
        reuse: layer-reuse group size: groups of ``reuse`` consecutive IceCache layers share
            the first layer's page layout and page selection (1: off).
        lookahead: select pages off the critical path (default): a native worker selects each
            layer's pages for step ``t + 1`` on the host from step ``t``'s queries while the
            device computes; step ``t + 1`` ranks them in the device page pool by their exact
            attention mass under its own queries and attends the heaviest ``retrieved_pages``.
            ``False``: fresh selection, each step waits for the host to select from its own
            queries (the exact reference, slower).
        exact_until_indexed: decode each layer from its prompt's whole cache until its index,
            built on a worker thread, is ready (default), so the first tokens come at the full
            cache's pace (the prefill pipeline holds the prompt's keys and values on the device
            until the worker has copied them anyway; after a prompt in chunks they are read back
            from the host). The first step after a layer's (its reuse group's) index is ready
            moves the tokens decoded meanwhile into the index and the window, frees the
            prompt's device copy and starts retrieving; that step depends on how fast the host
            builds, so the tokens generated can differ between runs and machines. ``False``: the
            first decode step waits for the indexes (reproducible; the prompt leaves the device
            as soon as it is copied). Section "Decode from the whole cache until the index is
            ready".
        superset_pages: pages the look-ahead selects per (layer, KV head, step), ranked on the
            device. Default: ``4 * retrieved_pages``, at least 32 (small budgets need the
            floor). Ignored with fresh selection and ``budget_mode="fixed"``. Section "Quality of
            look-ahead on real attention".
        successors: with look-ahead, the weight of each query head's ``successors`` heaviest
            keys also goes to the page of the next position, so that a head copying text from
            the context (it attends one token further on at the next step) finds that page in
            the superset (``HeadForest.select``'s ``successors``; 0: off). Fresh selection
            serves the step it selects for, so it uses none.
        refresh: with look-ahead, select a new superset every ``refresh`` steps (and at every
            step that moves a window page into the index); in between the device keeps ranking
            the pages it holds with each step's queries. 1: every step. Larger values cut the
            host's work at a quality cost (section "Quality of the cheaper selections").
        cuda_graphs: with look-ahead on CUDA, replay each layer's ranking and attention from
            CUDA graphs captured at the first steps, so a step launches a few kernels per layer.
        step_graph: with ``cuda_graphs``, replay each whole decode step (every layer of the
            model's decoder) from CUDA graphs where the model allows
            (:mod:`icecache.runtime.stepgraph`: no sliding-window layers; the first steps and
            any other step run eagerly, each IceCache layer from its own graphs). Off: each
            IceCache layer replays its own graphs and the rest of the model runs eagerly.
        pool_pages: device page slots per (sequence, layer, KV head); pages stay resident
            across steps until evicted (least recently selected first). Default with
            look-ahead: ``superset_pages + retrieved_pages``, so that pages of the last few
            supersets stay ranked too; with fresh selection ``budget // page_size`` (``"fixed"``)
            or ``superset_pages`` (``"adaptive"``).
        effort: the index's search effort (field of view), a number > 0 for every KV head
            (default 1.5, for the shared view of ``group_view``), or ``"auto"``: once a layer's
            index is built, the index worker calibrates each KV head's effort
            (``HeadForest.calibrate``) on the queries of the last ``CALIBRATION_POSITIONS``
            prompt positions (every query head, post-RoPE) for
            recall@``calibration_k``, with ``DCIIndex(effort="auto")``'s ``AUTO_TARGET`` and
            ``AUTO_MIN_EFFORT``. An index built without prompt queries (a prompt within sink +
            window) keeps ``AUTO_MIN_EFFORT``; :meth:`IceCache.from_prefilled` has none and
            refuses ``"auto"``. Calibrating delays the first decode step, and the higher
            efforts it picks slow the steps: section "The runtime calibrates at prefill".
        group_view: the query heads of each GQA group search one shared field of view (the
            cells each head ranks best, taken in turn, as many as one head's own view at
            ``effort``) instead of one each, so selection reads each KV head's keys in view once
            per step rather than once per query head (``HeadForest.select``'s ``group_view``).
            On by default, with ``effort=1.5``: the shared view then holds 1.5 views' cells, so
            a head whose mass sits in cells of its own still finds them, and the look-ahead
            worker's selections take about 0.64x the time of one view per head at effort 1
            (8B shape, 32k, H100 host). Section "The defaults: one shared field of view at
            effort 1.5".
        num_simple, num_composite, promotion, seed, threads: index parameters, passed
            to :class:`icecache.HeadForest` (``None``: the index's defaults). ``threads=None``
            is all cores in a single process; under ``torch.distributed`` with several ranks
            on one host, each rank's even share of them (:mod:`icecache.runtime.parallel`).
        device: where sinks, windows and the page pool live. Default: the model's device.
        page_format: how the host page stores hold the offloaded K and V. ``"native"``: the
            model's KV dtype. ``"int8"`` (default): int8 codes with one float32 scale per (KV
            head, token) row (``max |x| / 127``; every value within half a step, up to float32
            rounding), ``(D + 4) / (2 D)`` of bf16's host and PCIe bytes per page. ``"k8v4"``:
            those 8-bit K pages, and V pages of 4-bit codes with a bfloat16 step and minimum
            per group of 32 values of a row (every value within half its group's step), 0.41x
            of bf16's bytes for K and V at ``D = 128``: a fifth fewer host and PCIe bytes than
            int8 for lossier values (attention output error about 4x int8's; RULER and greedy
            agreement a little lower at large budgets), for memory-bound serving. The device dequantises
            loaded pages into its pool (in the model dtype), so attention reads the dequantised
            tokens. The index reads its keys from the 8-bit K rows (each key is stored once);
            with ``"native"`` it keeps the same int8 rows beside the 16-bit pages. Sections
            "8-bit host pages", "4-bit V pages" and "Each key once".
        prefill_chunk: the prompt chunk ``generate`` feeds the model when its generation config
            sets none: :class:`IceCache` sets ``model.generation_config.prefill_chunk_size`` to
            this where it is ``None`` (``None`` here: leave it alone). A chunk's attention is
            exact over every earlier token, which an IceCache layer keeps in host memory and
            reads back layer by layer, so the prompt's device memory is bounded by one chunk's
            activations and one layer's prompt, not the whole prompt's cache. A one-token forward
            is a decode step (``prefill_chunk=1`` decodes the prompt token by token). Section
            "Chunked prefill in bounded GPU memory".
    """

    budget: int = 256
    page_size: int = 16
    sink: int = 16
    window: int = 32
    full_layers: int = 2
    reuse: int = 1
    budget_mode: str = "adaptive"
    lookahead: bool = True
    exact_until_indexed: bool = True
    superset_pages: Optional[int] = None
    successors: int = 32
    refresh: int = 1
    cuda_graphs: bool = True
    step_graph: bool = True
    pool_pages: Optional[int] = None
    effort: Union[float, Literal["auto"]] = 1.5
    group_view: bool = True
    num_simple: Optional[int] = None
    num_composite: Optional[int] = None
    promotion: Union[float, Sequence[float], None] = None
    seed: Optional[int] = 0
    threads: Optional[int] = None
    device: Any = None
    page_format: str = "int8"
    prefill_chunk: Optional[int] = 8192

    def __post_init__(self) -> None:
        for f in fields(self):
            problem = _FIELD_CHECKS[f.name](getattr(self, f.name))
            if problem is not None:
                raise ValueError(f"IceCacheConfig.{f.name} {problem}")
        if self.window < self.page_size or self.window % self.page_size:
            raise ValueError(
                f"IceCacheConfig.window ({self.window}) must be a positive multiple of "
                f"page_size ({self.page_size}): the window moves to the index a page at a time"
            )
        if self.refresh < 1:
            raise ValueError(f"IceCacheConfig.refresh must be >= 1 (1 = every step), got {self.refresh}")
        if self.reuse < 1:
            raise ValueError(f"IceCacheConfig.reuse must be >= 1 (1 = no layer reuse), got {self.reuse}")
        need = self.sink + self.window + self.page_size
        if self.budget < need:
            raise ValueError(
                f"IceCacheConfig.budget ({self.budget}) is below sink ({self.sink}) + window "
                f"({self.window}) + one page ({self.page_size}); it must be at least {need}"
            )
        if self.superset_pages is not None and self.superset_pages < self.retrieved_pages:
            raise ValueError(
                f"IceCacheConfig.superset_pages ({self.superset_pages!r}) must be an int >= the retrieved "
                f"pages per step ({self.retrieved_pages})"
            )
        least = self.selected_pages
        if self.pool_pages is not None and self.pool_pages < least:
            what = "the retrieved pages" if least == self.retrieved_pages else "superset_pages"
            raise ValueError(
                f"IceCacheConfig.pool_pages ({self.pool_pages!r}) must be an int >= the pages selected "
                f"per step ({least}: {what})"
            )

    @property
    def retrieved_pages(self) -> int:
        """Pages retrieved per (layer, KV head, step)."""
        return (self.budget - self.sink - self.window) // self.page_size

    @property
    def selected_pages(self) -> int:
        """Pages the host selects per (layer, KV head, step): the look-ahead superset, or with
        fresh selection the retrieved pages (``budget_mode="fixed"``) or the superset that
        the device shares among the heads (``"adaptive"``)."""
        if not self.lookahead and self.budget_mode == "fixed":
            return self.retrieved_pages
        if self.superset_pages is not None:
            return self.superset_pages
        return max(SUPERSET_FACTOR * self.retrieved_pages, SUPERSET_MIN)

    @property
    def device_pages(self) -> int:
        """Device page slots per (sequence, layer, KV head)."""
        if self.pool_pages is not None:
            return self.pool_pages
        if self.lookahead:
            return self.selected_pages + self.retrieved_pages
        if self.budget_mode == "adaptive":
            return self.selected_pages
        return self.budget // self.page_size

    @property
    def calibrates(self) -> bool:
        """Whether each layer's index calibrates its efforts on the prompt (``effort="auto"``)."""
        return self.effort == "auto"

    def calibration_k(self, keys: int) -> int:
        """The ``k`` of the recall@``k`` that ``effort="auto"`` calibrates for, on an index of
        ``keys`` tokens per head: ``selected_pages * page_size / 2``, at most ``keys``.
        ``HeadForest.calibrate`` measures the field of view of a selection of ``2 * k`` tokens,
        which is what a selection of ``selected_pages`` pages searches."""
        return max(1, min(self.selected_pages * self.page_size // _RERANK, keys))

    def index_kwargs(self) -> dict:
        """Keyword arguments for :class:`icecache.HeadForest` (with ``effort="auto"``, the
        effort every head starts at: ``AUTO_MIN_EFFORT``)."""
        from icecache import _core

        return {
            "page_size": self.page_size,
            "page_format": self.page_format,
            "seed": self.seed,
            "threads": self.threads,
            "num_simple": self.num_simple,
            "num_composite": self.num_composite,
            "promotion": self.promotion,
            "effort": _core.AUTO_MIN_EFFORT if self.effort == "auto" else self.effort,
            # Builds run behind decode steps: a step's threads (the main thread, the look-ahead
            # worker's) take the cores first while later layers' indexes are built.
            "background": True,
        }
