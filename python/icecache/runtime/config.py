"""Configuration of the IceCache runtime, validated when it is made."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Optional, Sequence, Union

__all__ = ["IceCacheConfig"]

# HeadForest accepts pages of 8..=64 tokens.
_PAGE_SIZES = range(8, 65)
#: Default look-ahead superset: this many times the pages a step attends, and at least
#: ``SUPERSET_MIN`` pages (see ``superset_pages``).
SUPERSET_FACTOR = 4
SUPERSET_MIN = 32


@dataclass(frozen=True)
class IceCacheConfig:
    """How much of the KV cache each decode step attends to, and how it is laid out.

    The budget counts the tokens that enter the attention softmax per (layer, KV head, step):
    ``sink`` first tokens + up to ``window`` most recent tokens + the retrieved pages, at most
    ``(budget - sink - window) // page_size`` of them (semantic pages may be partly filled,
    so the retrieved tokens can be fewer).

    Attributes:
        budget: tokens attended per step (see above).
        page_size: tokens per semantic page (8..64).
        sink: first tokens of each sequence, always attended, kept on the device.
        window: most recent tokens, always attended, kept on the device; a multiple of
            ``page_size`` (when full, its oldest page of tokens moves to the index).
        full_layers: leading full-attention layers that keep the whole cache (their attention
            is broad).
        reuse: layer-reuse group size: groups of ``reuse`` consecutive IceCache layers share
            the first layer's page layout and page selection (1: off).
        lookahead: select pages off the critical path (default). Each layer's pages for step
            ``t + 1`` are selected on the host from step ``t``'s queries, by a native worker,
            while the device computes; they wait in the device page pool, where step ``t + 1``
            ranks them by their exact attention mass under its own queries and attends the
            heaviest ``retrieved_pages``. ``False``: fresh selection, where every step sends its
            queries to the host and waits for the selection (the exact reference, slower).
        superset_pages: pages the look-ahead selects per (layer, KV head, step), ranked on the
            device. Default: ``4 * retrieved_pages``, at least 32 (measured on real SmolLM2
            attention, see benches/RESULTS.md: 4x at budget 256; small budgets need the floor).
            Ignored with fresh selection.
        successors: with look-ahead (fresh selection serves the step it selects for, so it uses
            none), the weight of each query head's ``successors`` heaviest
            keys also goes to the page of the next position, so that a head copying text from
            the context (it attends one token further on at the next step) finds that page in
            the superset (``HeadForest.select``'s ``successors``; 0: off).
        refresh: with look-ahead, select a new superset every ``refresh`` steps (and at every
            step that moves a window page into the index); in between the device keeps ranking
            the pages it holds with each step's queries. 1: every step. Larger values cut the
            host's work (see benches/RESULTS.md for the quality cost).
        cuda_graphs: with look-ahead on CUDA, replay each layer's ranking and attention from
            CUDA graphs (captured at the first steps): a few launches per layer and step instead
            of about fifteen.
        pool_pages: device page slots per (sequence, layer, KV head); pages stay resident
            across steps until evicted (least recently selected first). Default with
            look-ahead: ``superset_pages + retrieved_pages``, so that pages of the last few
            supersets stay ranked too; with fresh selection ``budget // page_size``.
        effort, num_simple, num_composite, promotion, seed, threads: index parameters, passed
            to :class:`icecache.HeadForest` (``None``: the index's defaults). ``threads=None``
            is all cores in a single process; under ``torch.distributed`` with several ranks
            on one host, each rank's even share of them (:mod:`icecache.runtime.parallel`).
        device: where sinks, windows and the page pool live. Default: the model's device.
    """

    budget: int = 256
    page_size: int = 16
    sink: int = 16
    window: int = 32
    full_layers: int = 2
    reuse: int = 1
    lookahead: bool = True
    superset_pages: Optional[int] = None
    successors: int = 32
    refresh: int = 1
    cuda_graphs: bool = True
    pool_pages: Optional[int] = None
    effort: float = 1.0
    num_simple: Optional[int] = None
    num_composite: Optional[int] = None
    promotion: Union[float, Sequence[float], None] = None
    seed: Optional[int] = 0
    threads: Optional[int] = None
    device: Any = None

    def __post_init__(self) -> None:
        for name in ("lookahead", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"IceCacheConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("budget", "page_size", "sink", "window", "full_layers", "reuse", "successors", "refresh"):
            value = getattr(self, name)
            if not isinstance(value, Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"IceCacheConfig.{name} must be a non-negative int, got {value!r}")
        if self.page_size not in _PAGE_SIZES:
            raise ValueError(f"IceCacheConfig.page_size must be in 8..64, got {self.page_size}")
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
        if self.superset_pages is not None and (
            not isinstance(self.superset_pages, Integral)
            or isinstance(self.superset_pages, bool)
            or self.superset_pages < self.retrieved_pages
        ):
            raise ValueError(
                f"IceCacheConfig.superset_pages ({self.superset_pages!r}) must be an int >= the retrieved "
                f"pages per step ({self.retrieved_pages})"
            )
        least = self.selected_pages
        if self.pool_pages is not None and (
            not isinstance(self.pool_pages, Integral) or isinstance(self.pool_pages, bool) or self.pool_pages < least
        ):
            raise ValueError(
                f"IceCacheConfig.pool_pages ({self.pool_pages!r}) must be an int >= the pages selected "
                f"per step ({least}: {'superset_pages' if self.lookahead else 'the retrieved pages'})"
            )
        if not isinstance(self.effort, Real) or not self.effort > 0:
            raise ValueError(f"IceCacheConfig.effort must be > 0, got {self.effort!r}")
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"IceCacheConfig.device: {exc}") from None

    @property
    def retrieved_pages(self) -> int:
        """Pages retrieved per (layer, KV head, step)."""
        return (self.budget - self.sink - self.window) // self.page_size

    @property
    def selected_pages(self) -> int:
        """Pages the host selects per (layer, KV head, step): the look-ahead superset, or the
        retrieved pages with fresh selection."""
        if not self.lookahead:
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
        return self.budget // self.page_size

    def index_kwargs(self) -> dict:
        """Keyword arguments for :class:`icecache.HeadForest`."""
        return {
            "page_size": self.page_size,
            "seed": self.seed,
            "threads": self.threads,
            "num_simple": self.num_simple,
            "num_composite": self.num_composite,
            "promotion": self.promotion,
            "effort": self.effort,
        }
