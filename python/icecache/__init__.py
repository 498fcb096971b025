"""IceCache: KV-cache retrieval for long-context LLMs.

The pipeline, stage by stage:

- ``DCIIndex``: the multi-level Dynamic Continuous Indexing (M-DCI) index from the Rust core,
  usable on its own as an approximate nearest-neighbour index (inner product or L2);
- ``HeadForest``: one M-DCI tree per KV head of a layer, its leaf cells laid out as semantic
  pages of the CPU KV store, with page selection (GQA union) and decode-time inserts;
- ``ResidentPages`` and ``gather_pages``: the load stage as standalone building blocks (which
  pages are on the device; the gather of the missing ones into one staging buffer for a single
  bulk host-to-device copy). The runtime does the same inside its look-ahead jobs, whose
  staging writer (``LookAheadLayer``) plans and gathers a whole layer step in one core call;

- ``IceCacheConfig``, ``IceCache`` and ``enable``: the KV-cache runtime for transformers 5.x
  (:mod:`icecache.runtime`; imported on first use, as it needs torch and transformers).
"""

from icecache._core import (
    Calibration,
    DCIIndex,
    HeadForest,
    IndexFileError,
    ResidentPages,
    __version__,
    gather_pages,
)

__all__ = [
    "Calibration",
    "DCIIndex",
    "HeadForest",
    "IndexFileError",
    "ResidentPages",
    "gather_pages",
    "__version__",
    "IceCacheConfig",
    "IceCache",
    "enable",
]

_RUNTIME = ("IceCacheConfig", "IceCache", "enable")


def __getattr__(name):
    # The runtime needs torch and transformers: import it only when asked for, so that the
    # index stays usable with numpy alone.
    if name in _RUNTIME:
        from icecache import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'icecache' has no attribute {name!r}")
