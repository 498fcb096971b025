"""Host memory for a prompt: what its offloaded tokens need, what the machine has, and the check
that a prompt chunk makes before anything of it is allocated.

While a prompt of several chunks streams in, each IceCache layer holds its keys and values twice
in host memory: once as they came (:class:`icecache.runtime.prefix.HostPrefix`, read back by the next chunks and
the first decode steps) and once in the page stores with the index, which are built after the
last chunk. So each chunk checks the whole prompt so far against the memory that was available
when the prompt began: a prompt that cannot fit raises :class:`MemoryError` naming both
figures, instead of the kernel ending the process halfway through the prefill or its index
build.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from icecache.runtime.pages import page_bytes

__all__ = ["PINNING", "available_bytes", "bytes_per_token", "check_prompt_fits", "pin_by_registering"]

#: Index bytes per token and KV head beyond its rows (cells, tree, position maps), rounded up.
INDEX_BYTES = 32
#: The page stores' bytes per token, in percent of a full page's: pages are not all full
#: (97-98% of their slots hold a token), and the room the stores reserve for decode tokens is
#: not resident until used.
PAGE_SLACK_PERCENT = 105


#: How torch is asked to pin host memory (:func:`pin_by_registering`): ordinary pages, touched by
#: 8 threads, then registered with the driver.
PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
_ALLOC_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def pin_by_registering() -> bool:
    """Have torch pin host memory as :data:`PINNING` says instead of with ``cudaHostAlloc``.

    A chunked prompt pins its host copy as it streams in (4 GiB at 32k tokens of the Llama-8B
    shape), on the main thread. ``cudaHostAlloc`` pinned 1.6 GiB/s on the H200's host and holds a
    driver lock that stalls every CUDA call of the process meanwhile; registering ordinary pages
    pinned 8.4 GiB/s (benches/RESULTS.md). The setting is the process's (torch's caching host
    allocator), so it is made only where the process configured no allocator of its own (none of
    the ``PYTORCH_*ALLOC_CONF`` variables, no runtime setting); such a process keeps its own, and
    adds :data:`PINNING` to it to get this. A torch that can set but not read the settings
    (2.11) cannot show a runtime setting: there only the variables are looked at (the setting
    changes only the keys it names). Returns whether the setting was made now."""
    if any(os.environ.get(var) for var in _ALLOC_CONF):
        return False
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None or (getter is not None and getter()):
        return False
    setter(PINNING)
    return True


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_bytes() -> Optional[int]:
    """Host memory this process can still take: the kernel's ``MemAvailable``, or less where a
    cgroup (v2) limit leaves less; ``None`` where neither is known (not Linux)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        left = max(0, limit - used)
        avail = left if avail is None else min(avail, left)
    return avail


def bytes_per_token(
    heads: int, dim: int, dtype: torch.dtype, page_format: str, streamed: bool, page_size: int = 16
) -> int:
    """Resident host bytes one prompt token of one layer needs: in the page stores (pages of
    ``page_size`` tokens) with the index, and with ``streamed`` (a prompt of several chunks) its
    keys and values as they came too (a prompt of one chunk has no host copy of its own)."""
    size = torch.empty((), dtype=dtype).element_size()
    came = 2 * dim * size
    if page_format == "native":
        stored = came + dim + 4  # the bf16 pages, and the int8 row and scale the index keeps
    else:
        stored = sum(page_bytes(page_format, page_size, dim)) // page_size
    return heads * ((came if streamed else 0) + (stored + INDEX_BYTES) * PAGE_SLACK_PERCENT // 100)


def check_prompt_fits(tokens: int, per_token: int, layers: int, available: Optional[int]) -> None:
    """Raise :class:`MemoryError` if a prompt of ``tokens`` tokens (of all sequences) needs more
    host memory, at ``per_token`` bytes per token and layer over ``layers`` layers, than the
    ``available`` bytes (``None``: unknown, no check). Allocates nothing."""
    need = tokens * per_token * layers
    if available is not None and need > available:
        gib = 2**30
        raise MemoryError(
            f"IceCache: a prompt of {tokens} tokens needs {need / gib:.2f} GiB of host memory ({layers} layers "
            f"x {per_token} bytes a token), but {available / gib:.2f} GiB were available when it began; use a "
            "shorter prompt, fewer sequences or a smaller page_format ('int8', 'k8v4')"
        )
