"""The staging buffer's regions as typed tensors, derived once from ``_core.StagingLayout``.

A look-ahead job writes one staging buffer per layer (``icecache._core.StagingLayout`` documents
the byte layout); the host copy and the device copy have the same layout. :class:`Staging` holds
a layer's layout with the shapes it was made for, and :meth:`Staging.view` names every region of
a buffer with its dtype, so that no caller computes an offset of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache import _core
from icecache.runtime.config import IceCacheConfig

__all__ = ["Staging", "StagingView"]


@dataclass(frozen=True)
class StagingView:
    """One staging buffer (host or device), region by region."""

    #: int64 ``[max_loads]``: the pool slot of each loaded page (padding: the trash slot).
    load_idx: torch.Tensor
    #: int64 ``[max_masks]``: the pool slots whose valid-token mask changes (padding: trash).
    mask_idx: torch.Tensor
    #: int32 ``[2 * B * H_kv * max_pages]``: the selection table then ``table_len``, both packed
    #: at the job's ``width`` (see :meth:`table`).
    tables: torch.Tensor
    #: bool ``[max_masks, page_size]``: the new mask of each ``mask_idx`` slot.
    masks: torch.Tensor
    #: ``[max_loads, 2, page_size * D]`` in the KV dtype (K then V of each loaded page), or with
    #: quantised pages uint8 ``[max_loads, k_page_bytes + v_page_bytes]`` (the K page, then the V
    #: page: see ``icecache.runtime.pages``).
    rows: torch.Tensor
    #: The pool slot that padded entries name (one past the pool).
    trash: int
    batch: int
    kv_heads: int

    def table(self, width: int) -> torch.Tensor:
        """int32 ``[B, H_kv, width]``: the pool slot of each selected page in the host's rank
        order, -1 past the head's count (``width``: the job's ``LookAheadOutcome.width``)."""
        return self.tables[: self.batch * self.kv_heads * width].view(self.batch, self.kv_heads, width)


@dataclass(frozen=True)
class Staging:
    """A layer's staging layout and the shapes it was made for."""

    layout: _core.StagingLayout
    batch: int
    kv_heads: int
    page_size: int
    dim: int
    dtype: torch.dtype
    page_format: str

    @classmethod
    def for_layer(cls, config: IceCacheConfig, *, batch: int, kv_heads: int, dim: int, dtype: torch.dtype) -> Staging:
        """The layout a layer of these shapes stages under ``config``: its pages, a job's
        selection (``selected_pages``) and the device pool (``device_pages``)."""
        layout = _core.LookAheadLayer.staging_layout(
            batch=batch,
            kv_heads=kv_heads,
            dim=dim,
            page_size=config.page_size,
            itemsize=dtype.itemsize,
            max_pages=config.selected_pages,
            capacity=config.device_pages,
            page_format=config.page_format,
        )
        return cls(layout, batch, kv_heads, config.page_size, dim, dtype, config.page_format)

    @property
    def bytes(self) -> int:
        """The buffer's size."""
        return self.layout.bytes

    def view(self, buffer: torch.Tensor) -> StagingView:
        """The regions of ``buffer`` (uint8 ``[bytes]``), as views that share its memory."""
        lay, S, D = self.layout, self.page_size, self.dim
        n, m = lay.max_loads, lay.max_masks
        rows = buffer[lay.rows_at : lay.bytes]
        if self.page_format == "native":
            rows = rows.view(self.dtype).view(n, 2, S * D)
        else:
            rows = rows.view(n, lay.k_page_bytes + lay.v_page_bytes)
        return StagingView(
            load_idx=buffer[lay.load_idx_at : lay.load_idx_at + 8 * n].view(torch.int64),
            mask_idx=buffer[lay.mask_idx_at : lay.mask_idx_at + 8 * m].view(torch.int64),
            tables=buffer[lay.table_at : lay.table_len_at + 4 * lay.table_entries].view(torch.int32),
            masks=buffer[lay.mask_at : lay.mask_at + m * S].view(torch.bool).view(m, S),
            rows=rows,
            trash=lay.trash,
            batch=self.batch,
            kv_heads=self.kv_heads,
        )
