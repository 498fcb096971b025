"""Tensor parallelism: which KV heads a rank holds, and its share of the host's cores.

Under transformers' tensor parallelism (``from_pretrained(..., distributed_config=
DistributedConfig(tp_plan="auto"))`` on ``torch.distributed``), the key and value projections
are split by output rows, so each rank computes, caches and attends with a contiguous block
of the KV heads (and the query heads of their GQA groups). An :class:`IceCache` in each rank
therefore sees only its local heads in ``Cache.update`` and indexes, stores and selects only
those, with no collective of its own: the model's all-reduces are the only cross-rank traffic.

Two things still depend on the rank, and are settled here:

- the index seeds head ``h`` of a layer with ``seed + h``; a rank whose first head is global
  head ``first`` uses ``seed + first``, so that every head gets the trees (and selections) it
  gets in a single process;
- the ranks on one host share its cores: unless ``IceCacheConfig.threads`` is set, each rank's
  index uses ``cores // LOCAL_WORLD_SIZE`` threads (``LOCAL_WORLD_SIZE`` as set by torchrun).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from icecache.runtime.config import IceCacheConfig

__all__ = ["HeadShard", "head_shard", "host_threads", "kv_heads_per_rank", "rank_config"]


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """The KV heads one rank holds: global heads ``first`` .. ``first + count - 1``.

    Attributes:
        rank: this rank's place in the tensor-parallel group (0 without tensor parallelism).
        size: ranks in the group that split the KV heads (1: every rank holds every head).
        first: global index of this rank's first KV head.
        count: KV heads of this rank.
    """

    rank: int
    size: int
    first: int
    count: int


def kv_heads_per_rank(text_config: Any, ranks: int) -> int:
    """KV heads of each of ``ranks`` tensor-parallel ranks for a model of ``text_config``.

    Call it before loading a model to fail early; :class:`IceCache` calls it too.

    Raises:
        ValueError: the query or KV heads do not divide by ``ranks`` (each rank must hold
            whole GQA groups: its KV heads and all the query heads that share them).
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    q_heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or q_heads
    if kv_heads % ranks or q_heads % ranks:
        raise ValueError(
            f"IceCache under tensor parallelism needs the KV heads split evenly between the ranks, "
            f"whole GQA groups per rank: {getattr(text_config, 'model_type', 'the model')} has "
            f"{q_heads} query / {kv_heads} KV heads, which do not divide by {ranks} ranks; use a "
            f"tensor-parallel size that divides {kv_heads}"
        )
    return kv_heads // ranks


def _key_weight(model: Any) -> Any:
    """The key projection weight of the model's first attention module (``None``: none)."""
    for module in model.modules():
        k_proj = getattr(module, "k_proj", None)
        if k_proj is not None and hasattr(k_proj, "weight"):
            return k_proj.weight
    return None


def head_shard(model: Any, text_config: Any) -> HeadShard:
    """Which KV heads this process holds of ``model``.

    Read from the key projection's weight: under transformers' tensor parallelism it is a
    ``DTensor`` sharded on its output rows (``Shard(0)``) over the tensor-parallel mesh
    dimension, whose local rank gives the block of heads. Any other weight (a plain tensor, or
    a replicated one) means every head is local.

    Raises:
        ValueError: the heads do not divide by the tensor-parallel size
            (:func:`kv_heads_per_rank`).
    """
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    alone = HeadShard(rank=0, size=1, first=0, count=kv_heads)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed support: nothing can be sharded
        return alone
    weight = _key_weight(model)
    if isinstance(weight, DTensor):
        for dim, placement in enumerate(weight.placements):
            if placement.is_shard(0):
                size = weight.device_mesh.size(dim)
                count = kv_heads_per_rank(text_config, size)
                rank = weight.device_mesh.get_local_rank(dim)
                return HeadShard(rank=rank, size=size, first=rank * count, count=count)
    return alone


def host_threads() -> Optional[int]:
    """Default index threads of this process: ``None`` (all cores) in a single process; under
    ``torch.distributed`` with several ranks on this host (``LOCAL_WORLD_SIZE``, as torchrun
    sets it), an even share of the cores this process may run on, at least 1."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local <= 1:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local)


def rank_config(config: IceCacheConfig, shard: HeadShard) -> IceCacheConfig:
    """``config`` as this rank runs it: index seed shifted to the rank's first KV head (as the
    core seeds head ``h`` with ``seed + h``; same wrap-around), and ``threads`` defaulted to
    :func:`host_threads` where left ``None``."""
    changes: dict = {}
    if config.seed is not None and shard.first:
        changes["seed"] = (config.seed + shard.first) % 2**64
    if config.threads is None:
        threads = host_threads()
        if threads is not None:
            changes["threads"] = threads
    return dataclasses.replace(config, **changes) if changes else config
