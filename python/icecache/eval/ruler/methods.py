"""Decode-time KV caches of the baselines RULER compares IceCache with: StreamingLLM, Quest and a
token-level oracle, as transformers ``Cache`` subclasses that generate answers.

Every method here is a :class:`BudgetCache`: the layers IceCache would serve (full-attention
layers after the first ``full_layers``) are :class:`BudgetLayer` s; the others keep a full cache
(sliding-window layers their own window), as in :class:`icecache.IceCache`. The layers use
IceCache's own attention path (:mod:`icecache.runtime.integration`): a layer's ``update`` hands
the layer to the ``"icecache"`` attention function, which runs exact SDPA over the prompt (then
calls :meth:`BudgetLayer.ingest_chunk`) and :meth:`BudgetLayer.attend` at every decode step.

The budget counts the tokens in the softmax of one (layer, KV head, step), as
:class:`icecache.IceCacheConfig` does:

* ``streamingllm``: the ``sink`` first tokens and the ``budget - sink`` most recent ones (this
  step's included). Only those are kept: the rest is dropped after the prompt's exact attention
  and as decoding goes on. Keys keep the positions RoPE gave them (no re-rotation into a
  shorter window).
* ``quest``: every token is kept. The tokens after the sink are cut into pages of ``page_size``
  positions, each with the element-wise min and max of its keys (kept up to date as tokens
  arrive). A step scores every page that starts before the window by Quest's upper bound
  ``sum_d max(q_d min_d, q_d max_d)``, takes for each KV head the maximum over its query heads
  (one selection per KV head, which GQA's shared keys need), and attends the sink, the
  ``window`` most recent tokens and the best ``(budget - sink - window) // page_size`` pages'
  tokens before the window.
* ``oracle``: every token is kept; a step attends, per KV head, the ``budget`` tokens of largest
  exact attention weight (softmax over all keys, averaged over the KV head's query heads). No
  retrieval: the ceiling of any selection of ``budget`` tokens by attention weight.

At a budget that covers the whole context, each attends every token: exactly the full cache.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from icecache.runtime.cache import _cache_layers, _layer_types
from icecache.runtime.integration import enable, hand_off

__all__ = ["BASELINES", "BaselineConfig", "BudgetCache", "BudgetLayer"]


#: The baseline methods :class:`BudgetCache` implements.
BASELINES: Tuple[str, ...] = ("streamingllm", "quest", "oracle")


@dataclass(frozen=True)
class BaselineConfig:
    """One baseline at one budget, with IceCache's token accounting.

    Attributes:
        method: one of :data:`BASELINES`.
        budget: tokens in the softmax per (layer, KV head, decode step).
        sink: first tokens always attended (``streamingllm``, ``quest``).
        window: most recent tokens always attended (``quest``; ``streamingllm``'s recent part is
            ``budget - sink``).
        page_size: tokens per Quest page.
        full_layers: leading full-attention layers that keep the full cache (as IceCache's).
    """

    method: str
    budget: int
    sink: int = 16
    window: int = 32
    page_size: int = 16
    full_layers: int = 2

    def __post_init__(self) -> None:
        if self.method not in BASELINES:
            raise ValueError(f"method must be one of {BASELINES}, got {self.method!r}")
        if min(self.sink, self.window, self.full_layers) < 0 or self.page_size < 1:
            raise ValueError(
                f"need sink, window, full_layers >= 0 and page_size >= 1; got sink {self.sink}, window "
                f"{self.window}, full_layers {self.full_layers}, page_size {self.page_size}"
            )
        if self.budget < self.sink + self.window:
            raise ValueError(
                f"budget {self.budget} is below sink + window = {self.sink} + {self.window}: "
                "a step attends at least the sink and the window"
            )

    @property
    def pages(self) -> int:
        """Quest's pages per step: ``(budget - sink - window) // page_size``."""
        return (self.budget - self.sink - self.window) // self.page_size


class BudgetLayer(CacheLayerMixin):
    """The cache of one served layer under a baseline (see the module docstring).

    Follows transformers' cache layer interface (``update``, ``get_seq_length``,
    ``get_mask_sizes``) and IceCache's attention protocol (``decoding``, ``bridging``,
    ``ingest_chunk``, ``attend``). One sequence, one prompt, then one token per step.

    Attributes:
        keys, values: the kept tokens ``[1, H_kv, n, D]`` (all of them but for StreamingLLM).
        length: positions seen (the logical sequence length).
        decoding: whether the prompt has been taken (its exact attention has run).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False
    bridging = False  # IceCache's attention path asks; these layers never bridge

    def __init__(self, config: BaselineConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.length = 0
        self.decoding = False
        # Quest: per page of positions after the sink, the min and max of its keys [H_kv, pages, D].
        self.kmin: Optional[torch.Tensor] = None
        self.kmax: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """transformers' hook; the layer takes its first tokens, the prompt, in :meth:`update`."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Take this step's keys and values (post-RoPE, ``[1, H_kv, T, D]``): the prompt first,
        returned whole for exact attention, then one token per step."""
        if key_states.shape[0] != 1:
            raise ValueError(f"the baseline caches decode one sequence at a time, got a batch of {key_states.shape[0]}")
        if self.keys is None:
            self.is_initialized = True
            self.keys, self.values = key_states, value_states
            self.length = key_states.shape[-2]
            hand_off(self)
            return key_states, value_states
        if key_states.shape[-2] != 1:
            raise NotImplementedError(
                f"layer {self.layer_idx} got {key_states.shape[-2]} tokens after the prompt: one prompt, then "
                "one token per step"
            )
        assert self.keys is not None and self.values is not None
        self.keys = self._trim(torch.cat([self.keys, key_states], dim=-2))
        self.values = self._trim(torch.cat([self.values, value_states], dim=-2))
        self.length += 1
        if self.config.method == "quest":
            self._bound_from(self.length - 1)
        hand_off(self)
        return self.keys, self.values

    def _trim(self, x: torch.Tensor) -> torch.Tensor:
        """StreamingLLM's eviction: the sink and the ``budget - sink`` most recent tokens."""
        cfg = self.config
        if cfg.method != "streamingllm" or x.shape[-2] <= cfg.budget:
            return x
        return torch.cat([x[..., : cfg.sink, :], x[..., x.shape[-2] - (cfg.budget - cfg.sink) :, :]], dim=-2)

    def _bound_from(self, start: int) -> None:
        """Quest: recompute the key min/max of the pages holding positions ``start..`` (a page
        that gains a token is recomputed from its keys, at most ``page_size`` of them)."""
        cfg = self.config
        assert self.keys is not None
        k = self.keys[0].float()  # [H_kv, T, D]
        H, T, D = k.shape
        first = max(0, (start - cfg.sink) // cfg.page_size) if start >= cfg.sink else 0
        n_pages = max(0, -(-(T - cfg.sink) // cfg.page_size))
        if n_pages == 0:
            return
        lo = cfg.sink + first * cfg.page_size
        tail = k[:, lo:]
        pad = (n_pages - first) * cfg.page_size - tail.shape[1]
        # Pad the last page with copies of its last key: they change neither its min nor its max.
        if pad:
            tail = torch.cat([tail, tail[:, -1:].expand(H, pad, D)], dim=1)
        pages = tail.reshape(H, n_pages - first, cfg.page_size, D)
        new_min, new_max = pages.amin(2), pages.amax(2)
        if self.kmin is None or self.kmax is None:
            self.kmin, self.kmax = new_min, new_max
        else:
            self.kmin = torch.cat([self.kmin[:, :first], new_min], dim=1)
            self.kmax = torch.cat([self.kmax[:, :first], new_max], dim=1)

    def ingest_chunk(
        self, valid: Optional[torch.Tensor], queries: Optional[torch.Tensor] = None, scale: Optional[float] = None
    ) -> None:
        """Called by the attention path once the prompt's exact attention has run (the
        arguments of ``IceLayer.ingest_chunk``): StreamingLLM drops what it does not keep,
        Quest bounds the prompt's pages. The prompt comes in one forward (the evaluation runs
        no chunked prefill)."""
        if valid is not None and not bool(valid.all()):
            raise ValueError("the baseline caches do not take padded prompts")
        assert self.keys is not None and self.values is not None
        self.keys, self.values = self._trim(self.keys), self._trim(self.values)
        if self.config.method == "quest":
            self._bound_from(0)
        self.decoding = True

    def load_prompt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take a prompt that ran with a full cache (``[1, H_kv, T, D]``, copied) as if it had run
        here: its attention was exact either way."""
        self.is_initialized = True
        self.keys, self.values = keys.clone(), values.clone()
        self.length = keys.shape[-2]
        self.ingest_chunk(None)

    def keep_mask(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The kept tokens this step attends: ``[H_kv, n]`` bool, for ``query`` ``[H_q, D]``."""
        cfg = self.config
        assert self.keys is not None
        k = self.keys[0].float()
        H, T, D = k.shape
        keep = torch.ones(H, T, dtype=torch.bool, device=k.device)
        if cfg.method == "streamingllm" or T <= cfg.budget:
            return keep  # StreamingLLM keeps only what it attends
        qg = query.float().reshape(H, -1, D)
        if cfg.method == "oracle":
            weight = torch.softmax(torch.einsum("hgd,htd->hgt", qg, k) * scale, dim=-1).mean(1)
            keep.zero_()
            keep.scatter_(1, weight.topk(cfg.budget, dim=-1).indices, True)
            return keep
        mid_hi = T - cfg.window
        keep[:, cfg.sink : mid_hi] = False
        assert self.kmin is not None and self.kmax is not None
        eligible = max(0, -(-(mid_hi - cfg.sink) // cfg.page_size))  # pages starting before the window
        if eligible == 0 or cfg.pages == 0:
            return keep
        lo, hi = self.kmin[:, :eligible], self.kmax[:, :eligible]  # [H, P, D]
        bound = torch.maximum(qg[:, :, None] * lo[:, None], qg[:, :, None] * hi[:, None]).sum(-1)  # [H, G, P]
        best = bound.amax(1).topk(min(cfg.pages, eligible), dim=-1).indices  # [H, pages]
        pos = cfg.sink + best[:, :, None] * cfg.page_size + torch.arange(cfg.page_size, device=k.device)
        # A page's tokens from the window on are kept anyway; the last page may end past T.
        keep.scatter_(1, pos.reshape(H, -1).clamp(max=T - 1), True)
        return keep

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """This step's attention: query ``[1, H_q, 1, D]`` over the kept tokens of
        :meth:`keep_mask`; returns ``[1, 1, H_q, D]`` as transformers expects."""
        assert self.keys is not None and self.values is not None
        q = query[0, :, 0].float()
        k, v = self.keys[0].float(), self.values[0].float()
        H, T, D = k.shape
        keep = self.keep_mask(q, scale)
        logits = torch.einsum("hgd,htd->hgt", q.reshape(H, -1, D), k) * scale
        logits = logits.masked_fill(~keep[:, None], float("-inf"))
        out = torch.einsum("hgt,htd->hgd", torch.softmax(logits, dim=-1), v)
        return out.reshape(1, 1, -1, D).to(query.dtype)

    def get_seq_length(self) -> int:
        """Logical length: every position seen, dropped ones included (RoPE positions go on)."""
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple:
        """transformers' mask sizes for the logical length (decode steps ignore the mask)."""
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        """No maximum length."""
        return -1

    def reset(self) -> None:
        """Forget the sequence; the layer initialises again on the next prompt."""
        self.keys = self.values = self.kmin = self.kmax = None
        self.is_initialized = self.decoding = False
        self.length = 0


class BudgetCache(Cache):
    """A transformers ``Cache`` that decodes with a baseline (see the module docstring): the layers
    IceCache would serve are :class:`BudgetLayer` s, the others full (or, sliding-window layers,
    their own window). Making it switches ``model`` to the ``"icecache"`` attention
    implementation (:func:`icecache.runtime.enable`), plain SDPA for every other layer and cache.
    One sequence (no padding), one prompt, then one token per step.

    Args:
        config: the baseline and its budget.
        model: the transformers model it serves (a model :class:`icecache.IceCache` supports).

    Raises:
        ValueError: a model IceCache does not support.
    """

    def __init__(self, config: BaselineConfig, model: Any):
        text_config = model.config.get_text_config(decoder=True)
        layers = _cache_layers(
            _layer_types(text_config), text_config, config.full_layers, lambda idx: BudgetLayer(config, idx)
        )
        self.config = config
        super().__init__(layers=layers)
        enable(model)

    @classmethod
    def from_prefilled(cls, config: BaselineConfig, model: Any, prefilled: Cache) -> "BudgetCache":
        """A cache holding a prompt that ran with a full cache (``prefilled``, left unchanged),
        as if the prompt had run through it: prefill attention is exact either way."""
        cache = cls(config, model)
        if len(prefilled.layers) != len(cache.layers):
            raise ValueError(f"cache has {len(prefilled.layers)} layers, the model {len(cache.layers)}")
        for i, (mine, theirs) in enumerate(zip(cache.layers, prefilled.layers)):
            if isinstance(mine, BudgetLayer):
                keys, values = getattr(theirs, "keys", None), getattr(theirs, "values", None)
                if getattr(theirs, "is_sliding", False) or keys is None or values is None:
                    raise ValueError(f"layer {i} of the prefilled cache lacks the full prompt")
                mine.load_prompt(keys, values)
            else:
                cache.layers[i] = copy.deepcopy(theirs)
        return cache
