"""IceCache: KV-cache retrieval for long-context LLMs.

``DCIIndex`` is the multi-level Dynamic Continuous Indexing (M-DCI) index from the Rust core,
usable on its own as an approximate nearest-neighbour index (inner product or L2).
"""

from icecache._core import DCIIndex, IndexFileError, __version__

__all__ = ["DCIIndex", "IndexFileError", "__version__"]
