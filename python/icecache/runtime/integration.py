"""Hooks into transformers 5.x: the ``"icecache"`` attention and mask functions.

transformers looks attention up by name (``config._attn_implementation``) and never hands
the cache to the attention function. An IceCache layer therefore hands itself over in
``update`` (which every supported attention module calls right before attention) through a
thread-local slot, and the attention function takes it from there:

- no IceCache layer waiting (full-cache layers, sliding-window layers, other caches): plain
  transformers SDPA, so ``"icecache"`` is ``"sdpa"`` there, except that one-token steps on a
  GPU do not use cuDNN's SDPA backend: it builds a new execution plan for every new key length,
  which costs more host time than the whole attention (benches/RESULTS.md, "GPU decode on the
  H200, synchronous selection", under "What moved the figures"); the flash and memory-efficient
  kernels need no plan;
- an IceCache layer with its prompt: exact SDPA over the prompt, then the layer offloads and
  indexes it (the mask tells which positions are padding; with ``effort="auto"`` the layer
  also keeps the prompt's last queries, to calibrate its index on);
- an IceCache layer in a decode step: sparse attention over sink + selected pages + window;
  while the indexes are still being built (``IceCacheConfig.exact_until_indexed``), SDPA over
  the layer's whole cache, as for a full cache;
- a full-cache layer in a step graph (:class:`icecache.runtime.stepgraph.StaticFullLayer`, which
  hands itself over there): its whole storage under its mask of written positions, by
  :func:`icecache.attend.full.masked_decode_attention` (SDPA with a mask would run a kernel that
  reads each head's keys in one thread block, slower the longer the context).

The mask function is transformers' ``sdpa_mask`` (without a registered mask function,
transformers silently passes ``attention_mask=None`` and padding would be ignored), except for
a causal mask of a prompt chunk after earlier tokens: that would be ``[B, 1, L, T]`` booleans (16
GiB for a 32k chunk of a 512k prompt), so the mask function returns a :class:`ChunkMask` of the
padding alone and the attention function applies the causal part in the kernel
(:func:`icecache.attend.chunk.chunk_attention`), for every full-attention layer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from icecache._util import register_attention
from icecache.attend.chunk import chunk_attention, left_padding
from icecache.attend.full import masked_decode_attention

__all__ = ["ATTN_IMPLEMENTATION", "ChunkMask", "enable", "register"]

#: Attention implementation name registered with transformers.
ATTN_IMPLEMENTATION = "icecache"

_slot = threading.local()

#: SDPA backends for one-token steps on a GPU (see the module docstring: no cuDNN).
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class ChunkMask:
    """The mask of a prompt chunk after earlier tokens, for the ``"icecache"`` attention: causal
    with the diagonal at the bottom right, and ``valid`` ``[B, T]``, the real (non-padding) key
    positions, or ``None`` for all."""

    valid: Optional[torch.Tensor]


def chunk_mask(*args, **kwargs) -> Any:
    """The ``"icecache"`` mask function: transformers' ``sdpa_mask``, except for the plain causal
    mask of a chunk of several queries after earlier keys, left padded or not padded, which is a
    :class:`ChunkMask`. (transformers 5.17 passes ``cache_position``, later ones ``q_length``.)"""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:
        q_length = kwargs["cache_position"].shape[0]
    kv_length, kv_offset = kwargs.get("kv_length"), kwargs.get("kv_offset", 0)
    plain = kwargs.get("mask_function") is causal_mask_function and kwargs.get("local_size") is None
    if args or not plain or q_length is None or kv_length is None or not 1 < q_length < kv_length or kv_offset:
        return sdpa_mask(*args, **kwargs)
    padding = kwargs.get("attention_mask")
    valid = None
    if padding is not None:
        valid = padding[:, :kv_length].bool()
        if bool(valid.all()):
            valid = None
        elif left_padding(valid) is None:
            return sdpa_mask(*args, **kwargs)
    return ChunkMask(valid)


def hand_off(layer: Any) -> None:
    """Called by an IceCache layer's ``update``: its attention call comes next."""
    if getattr(_slot, "layer", None) is not None:
        _slot.layer = None
        raise RuntimeError(
            "IceCache layers are updated but their attention never runs: the model does not use "
            f"the {ATTN_IMPLEMENTATION!r} attention implementation. Call icecache.enable(model) "
            "(IceCache(config, model) does this) and do not switch it back while using IceCache."
        )
    _slot.layer = layer


def _take(module: Any) -> Optional[Any]:
    layer = getattr(_slot, "layer", None)
    _slot.layer = None
    if layer is not None and layer.layer_idx != getattr(module, "layer_idx", None):
        raise RuntimeError(
            f"IceCache layer {layer.layer_idx} was updated but attention ran for layer "
            f"{getattr(module, 'layer_idx', None)}: this model's attention is not supported"
        )
    return layer


def _valid_positions(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[B, T]`` bool of the keys that are real tokens (the last query row of the prompt's
    causal mask sees every real key), or ``None`` when nothing is masked."""
    if attention_mask is None:
        return None
    row = attention_mask[:, 0, -1, :]
    return row if row.dtype == torch.bool else row == 0


def icecache_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention function registered as ``"icecache"`` (see the module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _take(module)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    key_mask = getattr(layer, "key_mask", None)
    if key_mask is not None:  # a full layer in a step graph: its whole storage, under its mask
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            raise ValueError("IceCache's step graph does not support attention logit soft-capping or attention sinks")
        return masked_decode_attention(query, key, value, key_mask, scale), None
    if isinstance(attention_mask, ChunkMask):
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            raise ValueError("IceCache's chunked prefill does not support attention logit soft-capping or sinks")
        out = chunk_attention(query, key, value, attention_mask.valid, scale)
        if layer is not None:
            valid = attention_mask.valid
            layer.ingest_chunk(None if valid is None else valid[:, -query.shape[2] :], query, scale)
        return out, None
    if layer is None or not layer.decoding or layer.bridging:
        if layer is not None and layer.decoding:  # a bridged step: its queries serve the first job after
            layer.keep_query(query[:, :, 0], scale)
        if query.shape[2] == 1 and query.is_cuda:
            with sdpa_kernel(_DECODE_BACKENDS):
                return sdpa_attention_forward(
                    module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
                )
        result = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        if layer is not None and not layer.decoding:
            valid = _valid_positions(attention_mask)
            layer.ingest_chunk(None if valid is None else valid[:, -query.shape[2] :], query, scale)
        return result
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("IceCache does not support attention logit soft-capping or attention sinks")
    return layer.attend(query, scale), None


def register() -> None:
    """Register the ``"icecache"`` attention and mask functions with transformers (once)."""
    register_attention(ATTN_IMPLEMENTATION, icecache_attention, chunk_mask)


def enable(model: Any) -> None:
    """Switch ``model`` to the ``"icecache"`` attention implementation.

    It behaves like ``"sdpa"`` (minus cuDNN's backend in one-token GPU steps, see the module
    docstring) unless the model runs with an :class:`IceCache`, so the model can keep it for
    full-cache runs too. ``IceCache(config, model)`` calls this.
    """
    register()
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
