"""The IceCache KV-cache runtime for transformers 5.x.

- :class:`IceCacheConfig`: budget, page size, sink, window, full layers, layer reuse, index
  parameters, device.
- :class:`IceCache`: a transformers ``Cache``; ``model.generate(input_ids,
  cache=IceCache(config, model))`` decodes with KV retrieval.
- :func:`enable`: switch a model to the ``"icecache"`` attention implementation (done by
  ``IceCache(config, model)``; plain SDPA for any other cache).
- :func:`kv_heads_per_rank`, :class:`HeadShard`: tensor parallelism, one IceCache per rank
  with that rank's KV heads (:mod:`icecache.runtime.parallel`).

Everything runs on the CPU too: the device is then the CPU and the same page path runs with
plain copies.
"""

from icecache.runtime.cache import SUPPORTED_MODEL_TYPES, IceCache
from icecache.runtime.config import IceCacheConfig
from icecache.runtime.integration import ATTN_IMPLEMENTATION, enable
from icecache.runtime.parallel import HeadShard, kv_heads_per_rank
from icecache.runtime.runtime import RuntimeStats

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HeadShard",
    "IceCache",
    "IceCacheConfig",
    "RuntimeStats",
    "SUPPORTED_MODEL_TYPES",
    "enable",
    "kv_heads_per_rank",
]
