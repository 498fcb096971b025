"""The KV-cache methods that the agreement evaluation decodes with (see :mod:`icecache.eval.agreement`).

``icecache`` and ``icecache_adaptive`` are the runtime itself (:class:`icecache.IceCache`, with
``budget_mode`` ``"fixed"`` and ``"adaptive"``). ``quest`` and ``streamingllm``
are emulated over a full cache: an attention function (:data:`ATTN_IMPLEMENTATION`) gives each
decode step's query of a served layer only the tokens the method keeps, chosen by the recall
evaluation's selectors (:func:`icecache.eval.recall.methods.make_selectors`), so both
evaluations compare the same selections.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Iterator, Optional, Tuple

import numpy as np

from icecache._util import register_attention

if TYPE_CHECKING:  # torch is imported where it is used: the CLI's parser imports this module
    import torch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BUDGET_MODE",
    "EMULATED",
    "METHODS",
    "METHOD_LABELS",
    "Emulation",
    "emulating",
    "keep_mask",
]

#: Methods evaluated by default.
METHODS: Tuple[str, ...] = ("icecache", "icecache_adaptive", "quest", "streamingllm")
#: The methods that run the IceCache runtime, with their ``IceCacheConfig.budget_mode``.
BUDGET_MODE: Dict[str, str] = {"icecache": "fixed", "icecache_adaptive": "adaptive"}
#: The methods emulated over a full cache (the others run the IceCache runtime).
EMULATED: Tuple[str, ...] = ("quest", "streamingllm")
#: Names for tables and plots.
METHOD_LABELS: Dict[str, str] = {
    "icecache": "IceCache",
    "icecache_adaptive": "IceCache, adaptive budgets",
    "quest": "Quest",
    "streamingllm": "StreamingLLM",
}
#: Attention implementation name of the emulation, registered with transformers.
ATTN_IMPLEMENTATION = "icecache_emulation"

_slot = threading.local()


@dataclass(frozen=True)
class Emulation:
    """One emulated method at one budget, with the same token accounting as IceCache.

    The budget counts the tokens in the softmax of one (layer, KV head, step): ``sink`` first
    tokens + the ``window`` most recent ones (this step's included) + what the method selects
    from the middle between them: ``quest``, ``(budget - sink - window) // page_size`` pages of
    ``page_size`` consecutive middle tokens (the same pages IceCache retrieves, but positional);
    ``streamingllm``, the ``budget - sink - window`` most recent middle tokens, i.e. sink + the
    ``budget - sink`` most recent tokens.

    Attributes:
        method: ``"quest"`` or ``"streamingllm"``.
        budget, sink, window, page_size: as in :class:`icecache.IceCacheConfig`.
        layers: the layers served; the others (IceCache's full-cache layers, sliding-window
            layers) attend to their whole cache.
    """

    method: str
    budget: int
    sink: int
    window: int
    page_size: int
    layers: FrozenSet[int]

    def __post_init__(self) -> None:
        if self.method not in EMULATED:
            raise ValueError(f"method must be one of {EMULATED}, got {self.method!r}")
        if min(self.sink, self.window) < 0 or self.page_size < 1 or self.budget < self.sink + self.window:
            raise ValueError(
                f"need sink, window >= 0, page_size >= 1 and budget >= sink + window; got budget {self.budget}, "
                f"sink {self.sink}, window {self.window}, page_size {self.page_size}"
            )

    @property
    def pages(self) -> int:
        """Pages a step attends to (``quest``)."""
        return (self.budget - self.sink - self.window) // self.page_size


def keep_mask(emulation: Emulation, query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The tokens one decode step attends to: ``[H_kv, T]`` bool.

    Args:
        emulation: the method and its budget.
        query: this step's query ``[H_q, D]`` (post-RoPE); each KV head's selection serves
            its group of ``H_q / H_kv`` query heads (Quest's page score is the group's maximum).
        keys: the whole cache's keys ``[H_kv, T, D]`` (post-RoPE), this step's token last.
        scale: the softmax scale.

    Raises:
        RuntimeError: a selection charged more than the budget.
    """
    import torch

    from icecache.eval.recall.methods import Query, make_selectors, quest_page_bounds

    em = emulation
    n_kv, T, D = keys.shape
    mid_lo, mid_hi = min(em.sink, T), max(min(em.sink, T), T - em.window)
    keep = torch.ones(n_kv, T, dtype=torch.bool)
    n_mid = mid_hi - mid_lo
    if n_mid == 0:
        return keep
    keep[:, mid_lo:mid_hi] = False
    k_mid = keys[:, mid_lo:mid_hi].float().numpy()
    kbounds = quest_page_bounds(k_mid, em.page_size) if em.method == "quest" else None
    qg = query.float().reshape(n_kv, -1, D).numpy()
    # Only the queries, the middle's shape and Quest's page bounds are read by these selectors.
    ctx = Query(qg, k_mid, None, None, None, kbounds, em.page_size, None)
    extra = em.budget - em.sink - em.window
    (tokens, _pages, charged), *_ = make_selectors(scale, None, {})[em.method](ctx, [extra], [em.pages])
    if float(np.max(charged)) > extra:
        raise RuntimeError(f"{em.method} selected {float(np.max(charged))} middle slots, the budget allows {extra}")
    for h, idx in enumerate(tokens):
        keep[h, torch.as_tensor(np.asarray(idx, dtype=np.int64)) + mid_lo] = True
    return keep


def _emulated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention implementation :data:`ATTN_IMPLEMENTATION`: SDPA, except in the decode steps of
    the layers an active :class:`Emulation` serves, which attend to :func:`keep_mask`'s tokens."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    em: Optional[Emulation] = getattr(_slot, "emulation", None)
    if em is None or query.shape[2] != 1 or getattr(module, "layer_idx", None) not in em.layers:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError("the emulation decodes one sequence at a time")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("the emulation does not support attention logit soft-capping or attention sinks")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query[0, :, 0].float(), key[0].float(), value[0].float()  # [H_q, D], [H_kv, T, D] x 2
    n_kv, T, D = k.shape
    keep = keep_mask(em, q, k, scale)
    logits = torch.einsum("hgd,htd->hgt", q.reshape(n_kv, -1, D), k) * scale
    logits = logits.masked_fill(~keep[:, None], float("-inf"))
    out = torch.einsum("hgt,htd->hgd", torch.softmax(logits, dim=-1), v).reshape(1, 1, -1, D)
    return out.to(query.dtype), None  # [B, 1, H_q, D], as transformers expects


@contextlib.contextmanager
def emulating(model: Any, emulation: Optional[Emulation]) -> Iterator[None]:
    """Run ``model`` with :data:`ATTN_IMPLEMENTATION` and ``emulation`` active (``None``: plain
    SDPA, the full cache) in this thread; restores the model's attention implementation."""
    register_attention(ATTN_IMPLEMENTATION, _emulated_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    _slot.emulation = emulation
    try:
        yield
    finally:
        _slot.emulation = None
        model.set_attn_implementation(before)
