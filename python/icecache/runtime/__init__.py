"""The IceCache KV-cache runtime for transformers 5.x.

- :class:`IceCacheConfig`: budget, page size, sink, window, full layers, layer reuse, index
  parameters, device.
- :class:`IceCache`: a transformers ``Cache``; ``model.generate(input_ids,
  past_key_values=IceCache(config, model))`` decodes with KV retrieval.
- :func:`enable`: switch a model to the ``"icecache"`` attention implementation (done by
  ``IceCache(config, model)``; plain SDPA for any other cache).

Everything runs on the CPU too: the device is then the CPU and the same page path runs with
plain copies.
"""

from icecache.runtime.cache import SUPPORTED_MODEL_TYPES, IceCache
from icecache.runtime.config import IceCacheConfig
from icecache.runtime.integration import ATTN_IMPLEMENTATION, enable
from icecache.runtime.layer import RuntimeStats

__all__ = ["ATTN_IMPLEMENTATION", "IceCache", "IceCacheConfig", "RuntimeStats", "SUPPORTED_MODEL_TYPES", "enable"]
