"""``IceCache``: a transformers 5.x ``Cache`` that retrieves KV pages per decode step."""

from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from icecache.runtime import graphs
from icecache.runtime.config import IceCacheConfig
from icecache.runtime.integration import enable
from icecache.runtime.layer import IceLayer
from icecache.runtime.parallel import HeadShard, head_shard, rank_config
from icecache.runtime.runtime import Runtime, RuntimeStats
from icecache.runtime.stepgraph import StaticFullLayer, StepGraph, install

__all__ = ["IceCache", "SUPPORTED_MODEL_TYPES"]

#: ``config.model_type`` of the (text) models whose attention IceCache is known to serve:
#: GQA/MQA attention that calls ``cache.update`` then the registered attention function.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def _layer_types(text_config: Any) -> List[str]:
    """Attention type of every layer of a supported model; ``ValueError`` for anything else."""
    model_type = getattr(text_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"IceCache does not support model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(text_config, "attn_logit_softcapping", None) is not None:
        raise ValueError("IceCache does not support attention logit soft-capping (attn_logit_softcapping)")
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:  # as transformers' own caches infer it
        sliding = getattr(text_config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * text_config.num_hidden_layers
    unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ValueError(f"IceCache does not support attention layers of type {', '.join(unknown)}")
    return list(layer_types)


def _cache_layers(
    layer_types: List[str], text_config: Any, full_layers: int, served: Callable[[int], Any]
) -> List[Any]:
    """A cache's layers for ``layer_types``: a sliding-window layer keeps its window, the first
    ``full_layers`` full-attention layers a full cache, and ``served(idx)`` makes each later one
    (the layers a retrieval cache serves)."""
    layers: List[Any] = []
    seen_full = 0
    for idx, kind in enumerate(layer_types):
        if kind == "sliding_attention":
            layers.append(DynamicSlidingWindowLayer(sliding_window=text_config.sliding_window))
        elif seen_full < full_layers:
            layers.append(DynamicLayer())
            seen_full += 1
        else:
            layers.append(served(idx))
    return layers


class IceCache(Cache):
    """KV cache that keeps sink and recent tokens on the device and retrieves the rest.

    Per full-attention layer past the first ``config.full_layers``, each sequence's middle
    tokens live in CPU memory as semantic pages indexed by an M-DCI forest (one tree per KV
    head), and every decode step attends to the sink tokens, the recent window and the pages
    the index selects for the step's queries (GQA union), within ``config.budget`` tokens.
    The leading full layers keep a full cache; sliding-window layers keep their own window.

    Use it like any cache::

        cache = icecache.IceCache(icecache.IceCacheConfig(budget=256), model)
        out = model.generate(input_ids, cache=cache, max_new_tokens=64)

    (transformers 5.24 renamed ``past_key_values`` to ``cache``; the old name still works.)

    Constructing it switches ``model`` to the ``"icecache"`` attention implementation
    (:func:`icecache.runtime.enable`), which is plain SDPA for any other cache, and routes
    its decoder's one-token forwards with an IceCache through that cache's step graph (with
    ``config.step_graph``: each decode step from CUDA graphs, :mod:`icecache.runtime.stepgraph`).
    One cache
    serves one ``generate`` (or one prompt forward followed by one-token forwards); call
    :meth:`reset` to reuse it. The prompt may come in chunks (``generate(...,
    prefill_chunk_size=N)``, or forwards of several tokens before the first one-token forward);
    constructing an IceCache sets ``model.generation_config.prefill_chunk_size`` to
    ``config.prefill_chunk`` where it is unset, so that ``generate`` prefills in bounded device
    memory. Beam search and cropping are not supported.

    Under tensor parallelism (transformers' ``tp_plan``, one process per GPU), make one
    IceCache in every rank: each indexes, stores and selects only the KV heads of its rank
    (:attr:`shard`), with the selections a single process makes for those heads, and never
    communicates; see :mod:`icecache.runtime.parallel`.

    Args:
        config: an :class:`IceCacheConfig` (``None``: the defaults).
        model: the transformers model it will serve (Llama, Mistral, Qwen2/3, Gemma 3 text).
        track_recall: also measure per step the share of full attention mass that the
            selection keeps (costs a full attention over the CPU pages; for evaluation).

    Raises:
        ValueError: unsupported model or attention type, or KV heads that do not divide by
            the model's tensor-parallel size.

    Attributes:
        shard: the KV heads this process holds (all of them without tensor parallelism).
    """

    shard: HeadShard

    def __init__(self, config: Optional[IceCacheConfig], model: Any, *, track_recall: bool = False):
        config = IceCacheConfig() if config is None else config
        if not isinstance(config, IceCacheConfig):
            raise TypeError(f"config must be an IceCacheConfig, got {type(config).__name__}")
        text_config = model.config.get_text_config(decoder=True)
        layer_types = _layer_types(text_config)
        shard = head_shard(model, text_config)
        device = torch.device(config.device) if config.device is not None else next(model.parameters()).device
        self.config = config
        self.shard = shard
        query_heads = text_config.num_attention_heads // shard.size
        self.runtime = Runtime(rank_config(config, shard), device, track_recall, query_heads=query_heads)

        ice: List[IceLayer] = []

        def served(idx: int) -> IceLayer:
            # Reuse groups of `config.reuse` consecutive layers, each led by its first.
            group = ice[len(ice) - len(ice) % config.reuse :]
            layer = IceLayer(self.runtime, idx, leader=group[0] if group else None)
            ice.append(layer)
            return layer

        layers = _cache_layers(layer_types, text_config, config.full_layers, served)
        for layer, after in zip(ice, ice[1:] + ice[:1]):
            layer.next_layer = after
        self.runtime.served_layers = len(ice)
        super().__init__(layers=layers)
        #: Decode steps from one CUDA graph each (``config.step_graph``).
        self.step_graph = StepGraph(self)
        enable(model)
        install(model)
        generation = getattr(model, "generation_config", None)
        if config.prefill_chunk is not None and generation is not None and generation.prefill_chunk_size is None:
            generation.prefill_chunk_size = config.prefill_chunk
        # A safe point: the graphs of caches collected since are destroyed now.
        graphs.release_retired()

    @classmethod
    def from_prefilled(
        cls,
        config: Optional[IceCacheConfig],
        model: Any,
        cache: Cache,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        track_recall: bool = False,
    ) -> "IceCache":
        """An IceCache holding a prompt that already ran with a full cache (e.g. a
        ``DynamicCache``), as if it had run with this IceCache: prefill attention is exact
        either way. Lets one prefill serve several configurations, or a prefill done elsewhere
        continue with retrieval. ``cache`` is left unchanged; no memory is shared with it.

        Args:
            config, model, track_recall: as for :class:`IceCache`.
            cache: a full cache of ``model`` after the prompt (dense ``keys``/``values`` per
                layer; sliding-window layers are copied as they are).
            attention_mask: the prompt's ``[B, T]`` padding mask (``None``: no padding).

        Raises:
            ValueError: ``config.effort == "auto"``: it calibrates on the prompt's queries,
                which a full cache does not hold (run the prompt through an IceCache instead).
        """
        if config is not None and config.calibrates:
            raise ValueError(
                'IceCache.from_prefilled cannot serve effort="auto": it calibrates each index on the '
                "prompt's last queries, which a prefilled cache does not hold; run the prompt through "
                "the IceCache instead"
            )
        ice = cls(config, model, track_recall=track_recall)
        if len(cache.layers) != len(ice.layers):
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {len(ice.layers)}")
        valid = None if attention_mask is None else attention_mask.bool()
        for i, (mine, theirs) in enumerate(zip(ice.layers, cache.layers)):
            if isinstance(mine, IceLayer):
                if getattr(theirs, "is_sliding", False):
                    raise ValueError(f"layer {i} of cache is a sliding-window layer: it lacks the full prompt")
                if not isinstance(theirs, CacheLayerMixin) or theirs.keys is None or theirs.values is None:
                    raise ValueError(f"layer {i} of cache holds no keys and values: run the prompt through it first")
                k, v = theirs.keys, theirs.values
                if ice.config.exact_until_indexed:  # the bridge keeps them: its own copy
                    k, v = k.clone(), v.clone()
                mine.load_prompt(k, v, valid)
            else:
                ice.layers[i] = copy.deepcopy(theirs)
        return ice

    def wait_indexed(self) -> None:
        """Block until the prompt is offloaded and indexed. Prefill hands that work to a worker
        thread and the first decode step waits for it; call this to wait (or time it) earlier.
        Raises the worker's error if indexing failed."""
        self.runtime.wait_indexed()

    @property
    def stats(self) -> RuntimeStats:
        """Timing, page and recall counters of the decode steps so far."""
        return self.runtime.stats

    def nbytes(self) -> dict:
        """KV bytes held now: ``{"device": ..., "host": ...}``. Device bytes are every layer's
        on-device cache (full and sliding layers' caches; sinks, windows and page pools of
        IceCache layers); host bytes are the CPU page stores, the indexes (trees and page
        layouts, ``HeadForest.nbytes``), staging and transit buffers, and a chunked prompt's host
        copy while it is held (not the pinned blocks the process keeps for the next prompt,
        :data:`icecache.runtime.prefix.PINNED`)."""
        total = {"device": 0, "host": self.runtime.transit.nbytes()}
        for layer in self.layers:
            if isinstance(layer, IceLayer):
                for key, value in layer.nbytes().items():
                    total[key] += value
            elif isinstance(layer, StaticFullLayer):
                total["device"] += layer.nbytes()
            elif isinstance(layer, CacheLayerMixin) and layer.is_initialized and layer.keys is not None:
                total["device"] += 2 * layer.keys.numel() * layer.keys.element_size()
        return total

    def reset(self) -> None:
        """Empty the cache (all layers and counters) so that it can serve a new prompt. Work
        still running for the old prompt (indexing, look-ahead jobs) is waited for or
        cancelled, and its errors are forgotten."""
        self.runtime.wait_indexed(errors=False)
        self.step_graph.forget()
        for layer in self.layers:
            if isinstance(layer, DynamicLayer) and layer.is_initialized:
                # Dropped, not zeroed: transformers before 5.24 zeroes a dynamic layer's tensors
                # (which fails on inference tensors, and the next prompt would follow as many
                # zero tokens). Not initialised, the layer's own reset skips them.
                layer.keys = layer.values = None
                layer.is_initialized = False
        super().reset()
        self.runtime.forget()
