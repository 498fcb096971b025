"""Recall measurement for evaluation (``IceCache(track_recall=True)``), after a layer's
decode attention."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from icecache import _core
from icecache.attend.ranked import RankedAttention
from icecache.runtime.jobs import FollowerJobs, LayerJobs, LeaderJobs
from icecache.runtime.runtime import RuntimeStats
from icecache.runtime.window import DeviceWindow

__all__ = ["track_recall"]


def _token_maps(jobs: LayerJobs, b: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per KV head, the (page, slot) of each offloaded token of sequence ``b`` in the layout of
    the job this step applied. A leader reads its index, whose next job starts only after this
    probe, and keeps the maps for its followers: by their probes that next job may have inserted
    tokens and split pages, while their stores keep the applied layout until their own next
    job."""
    if isinstance(jobs, FollowerJobs):
        maps = jobs.leader.probe_maps.get(b)
        if maps is None:
            raise RuntimeError(f"layer {jobs.layer_idx}: its leader's recall probe did not run this step")
        return maps
    if not isinstance(jobs, LeaderJobs):
        raise TypeError(f"unknown layer jobs {type(jobs).__name__}")
    forest = jobs.indexes[b].forest
    if forest is None:
        raise RuntimeError(f"layer {jobs.layer_idx}: sequence {b} has no index to probe")
    maps = []
    for h in range(jobs.heads):
        page, slot = forest.token_map(h)
        maps.append((torch.from_numpy(page).long(), torch.from_numpy(slot).long()))
    jobs.probe_maps[b] = maps
    return maps


def track_recall(
    q: torch.Tensor,
    res: RankedAttention,
    outcome: _core.LookAheadOutcome,
    *,
    pages: int,
    scale: float,
    window: DeviceWindow,
    jobs: LayerJobs,
    pool_valid: torch.Tensor,
    lookahead: bool,
    stats: RuntimeStats,
) -> None:
    """Append this step's measurements to ``stats``.

    Recall, per sequence: the share of the full attention mass on the attended tokens, from
    the attended logits' log-sum-exp against one over every token (the device's sink and
    window, and every offloaded token in the CPU stores). With look-ahead, also the share of
    attended pool pages that the host's own ranking of its superset would not have attended
    (its first ``pages`` pages): what the device's ranking changed.

    Args:
        q: the step's queries ``[B, H_q, D]``.
        res: the device step's full result (with its log-sum-exp).
        outcome: the job the step applied.
        pages: pages the step attended per KV head.
        scale: the attention's scale.
        window, jobs, pool_valid: the layer's device window, host side and pool mask.
        lookahead: ``IceCacheConfig.lookahead``.
    """
    if res.lse is None:
        raise RuntimeError("recall tracking needs the device step's log-sum-exp (want_lse)")
    lse = res.lse.cpu()
    B, H, D = jobs.batch, jobs.heads, jobs.dim
    G = q.shape[1] // H
    dense_valid = window.dense_valid.cpu()
    dense_k = window.dense_kv[0].cpu().float()
    for b, index in enumerate(jobs.group_indexes):
        qb = q[b].cpu().float().view(H, G, D)
        dense = torch.einsum("hgd,htd->hgt", qb, dense_k[b]) * scale
        total = torch.logsumexp(dense.masked_fill(~dense_valid[b, :, None], float("-inf")), dim=-1)  # [H, G]
        if index.forest is not None:
            store = jobs.stores[b].tokens(jobs.dtype)[0].float()  # as the device attends it
            for h, (page, slot) in enumerate(_token_maps(jobs, b)):
                mid = qb[h] @ store[h, page, slot].T * scale  # [G, n]
                total[h] = torch.logaddexp(total[h], torch.logsumexp(mid, dim=-1))
        recall = torch.exp(lse[b].view(H, G) - total)
        stats.recalls.append(float(recall.mean()))
    if not lookahead or outcome.selected == 0:
        return  # nothing selected this step (``refresh``): nothing for the device to change
    # The applied job's table (superset slots in the host's rank order) is still in the host
    # staging: the next job writes it only after this step's flag.
    table = jobs.host_staging.table(outcome.width).numpy()
    kept = res.kept.cpu().numpy()
    occupied = pool_valid.any(-1).cpu().numpy()
    moved = total_kept = 0
    for b, h in np.ndindex(B, H):
        host_top = set(table[b, h][table[b, h] >= 0][:pages].tolist())
        chosen = np.flatnonzero(kept[b, h] & occupied[b, h])
        total_kept += len(chosen)
        moved += sum(1 for s in chosen.tolist() if s not in host_top)
    if total_kept:
        stats.reranked.append(moved / total_kept)
