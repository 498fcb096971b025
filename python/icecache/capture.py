"""Record exactly what a transformers model's attention sees: post-RoPE queries, keys, values.

IceCache indexes attention keys and searches them with attention queries, so benchmarks need
the real vectors as the attention kernel receives them: after the q/k/v projections, after
any QK-norm, after RoPE. Hooks on ``k_proj`` would give pre-RoPE vectors, which rank keys
differently. Instead this module registers its own attention implementation with
transformers' ``AttentionInterface``: it copies ``query``/``key``/``value`` and then calls
transformers' own SDPA attention with the same arguments, so the forward pass is unchanged
(the logits are bit-identical to ``attn_implementation="sdpa"``).

A custom attention name must also be registered with ``AttentionMaskInterface``: otherwise
transformers' mask creation finds no mask function for the name and silently passes
``attention_mask=None`` to every layer. SDPA then falls back to ``is_causal`` for a plain
forward, but padding is ignored (measured: a left-out mask changes padded-batch logits) and any
attention code that does not fall back to causal attends to the future. Here we register
transformers' ``sdpa_mask``, so the masks are exactly those of ``"sdpa"``.

torch and transformers are imported lazily, inside the functions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import numpy as np

from icecache._util import register_attention

__all__ = ["ATTN_IMPLEMENTATION", "QKV", "capture_qkv", "recording"]

#: Name under which the recording attention function is registered with transformers.
ATTN_IMPLEMENTATION = "icecache_capture"

#: What one attention layer saw: ``(q [H_q, T, D], k [H_kv, T, D], v [H_kv, T, D])``.
QKV = Tuple[np.ndarray, np.ndarray, np.ndarray]

# The recorder of the capture in progress. Module-level because transformers looks the
# attention function up by name; a capture is not reentrant (one model forward at a time).
_active: Optional["_Recorder"] = None


class _StopForward(Exception):
    """Raised after the last wanted layer so that capture_qkv skips the rest of the forward."""


class _Recorder:
    """Collects per-layer copies of q, k, v from the recording attention function."""

    def __init__(self, layers: Optional[Iterable[int]], stop_early: bool = False):
        self.layers = None if layers is None else {int(i) for i in layers}
        self.stop_early = stop_early and self.layers is not None
        self.data: Dict[int, QKV] = {}
        self._order: Dict[int, int] = {}  # id(module) -> index, for modules without layer_idx

    def record(self, module: Any, query: Any, key: Any, value: Any) -> None:
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            idx = self._order.setdefault(id(module), len(self._order))
        idx = int(idx)
        if self.layers is not None and idx not in self.layers:
            return
        if query.shape[0] != 1:
            raise ValueError(f"capture needs batch size 1, got {query.shape[0]}")
        # [B, H, T, D] -> [H, T, D]; copy so that later in-place ops on the tensor can't touch it.
        q, k, v = (t[0].detach().float().cpu().numpy().copy() for t in (query, key, value))
        self.data[idx] = (q, k, v)
        if self.stop_early and self.layers is not None and self.layers <= self.data.keys():
            raise _StopForward


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention function registered as :data:`ATTN_IMPLEMENTATION`: record, then plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rec = _active
    if rec is not None:
        rec.record(module, query, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    register_attention(ATTN_IMPLEMENTATION, _recording_attention)


@contextlib.contextmanager
def recording(
    model: Any,
    layers: Optional[Iterable[int]] = None,
    *,
    _stop_early: bool = False,
) -> Iterator[Dict[int, QKV]]:
    """Context manager: while active, every forward of ``model`` records q, k, v.

    Yields a dict that fills as the model runs: ``{layer_idx: (q, k, v)}`` with ``q`` of shape
    ``[H_q, T, D]`` (one row block per query head) and ``k``, ``v`` of shape ``[H_kv, T, D]``
    (one per KV head), float32 numpy arrays, batch size 1. ``T`` is the key length the
    attention saw (with a KV cache, the whole cache). A later forward overwrites earlier
    entries. The model's attention implementation is restored on exit, even on error.

    Queries are not pre-scaled: attention logits are ``q @ k.T * D**-0.5``.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through
            ``AttentionInterface`` (Llama, Qwen, Gemma, ... in transformers 5).
        layers: layer indices to record; default all.
    """
    global _active
    _register()
    if _active is not None:
        raise RuntimeError("a capture is already in progress")
    original = model.config._attn_implementation
    rec = _Recorder(layers, _stop_early)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    _active = rec
    try:
        yield rec.data
    finally:
        _active = None
        model.set_attn_implementation(original)


def capture_qkv(
    model: Any, input_ids: Any, layers: Optional[Iterable[int]] = None, *, stop_early: bool = True
) -> Dict[int, QKV]:
    """Run one forward of ``model`` on ``input_ids`` and return what each attention layer saw.

    Only the last position's logits are computed (``logits_to_keep=1``: full logits of a long
    input would take ``T * vocab * 4`` bytes), and with ``stop_early`` the forward is cut off
    right after the last layer in ``layers`` has been recorded (layers only depend on earlier
    ones, so this changes nothing that is returned; capturing layer 15 of 30 halves the time).
    Use :func:`recording` to capture during a complete forward of your own.

    Args:
        model: a transformers causal LM (see :func:`recording`).
        input_ids: token ids, shape ``[T]`` or ``[1, T]`` (tensor, array or list).
        layers: layer indices to keep; default all (memory: ``(H_q + 2 H_kv) * T * D * 4``
            bytes per layer).
        stop_early: skip the layers after the last one wanted.

    Returns:
        ``{layer_idx: (q [H_q, T, D], k [H_kv, T, D], v [H_kv, T, D])}``, float32 numpy,
        post-RoPE (post-QK-norm where the model has one).
    """
    import torch

    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [T] or [1, T], got {tuple(ids.shape)}")
    device = next(model.parameters()).device
    with recording(model, layers, _stop_early=stop_early) as data, torch.inference_mode():
        try:
            # No cache: the keys are exactly this input's.
            model(ids.to(device), use_cache=False, logits_to_keep=1)
        except _StopForward:
            pass
    missing = set() if layers is None else {int(i) for i in layers} - data.keys()
    if missing:
        raise ValueError(f"model has no attention layer(s) {sorted(missing)}")
    return data
