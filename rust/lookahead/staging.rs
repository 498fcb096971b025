//! The staging buffer: a job's results for the device, laid out for one host-to-device copy.
//!
//! [`StagingLayout`] names every region (offsets in bytes; entries in native byte order):
//! - `load_idx_at` (0): int64 `load_idx [max_loads]`, the device slot of each loaded page as
//!   `(b·H_kv + head)·capacity + slot` (`trash` past the job's loads);
//! - `mask_idx_at`: int64 `mask_idx [max_masks]`, the slots whose valid-token mask changes: the
//!   loaded ones, then those cleared because their page changed and was not selected again
//!   (`trash` past loads + clears);
//! - `table_at`: int32 `table [table_entries]` (`[B, H_kv, width]`), the device slot of each
//!   selected page in rank order (-1 past the head's count);
//! - `table_len_at`: int32 `table_len [table_entries]`, the valid tokens of each;
//! - `mask_at`: `[max_masks, page_size]` bytes, 1 where the slot holds a token;
//! - `rows_at` (aligned to [`ROW_ALIGN`]): `[loads, k_page_bytes + v_page_bytes]`, each loaded
//!   page's K then V page as the stores hold it (`[page_size, d]` elements, int8 codes and
//!   scales: `pages::int8`, or 4-bit V: `pages::value4`), up to the job's `end` (the used
//!   prefix of the buffer).

use rayon::prelude::*;

use super::{Geometry, HostBuf, LanePlan};
use crate::error::{ensure, Result};

/// Alignment of the page rows after the metadata in a staging buffer, in bytes.
pub const ROW_ALIGN: usize = 64;

/// What a staging layout depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingShape {
    pub batch: usize,
    /// KV heads.
    pub heads: usize,
    /// Pages selected per (sequence, KV head).
    pub width: usize,
    /// Device page slots per (sequence, KV head).
    pub capacity: usize,
    pub page_size: usize,
    /// Bytes of one K page and of one V page as the stores hold them (`PageFormat`).
    pub k_page_bytes: usize,
    pub v_page_bytes: usize,
}

impl StagingShape {
    /// Bytes of one loaded page's K and V in staging.
    pub fn row_bytes(&self) -> usize {
        self.k_page_bytes + self.v_page_bytes
    }
}

/// The fixed layout of a layer's staging buffer (see the module docs): every region has room
/// for the most a job can write, padded entries name the device pool's trash slot, so that
/// the device applies any step with the same operations (one CUDA graph) and only the used
/// prefix of the buffer needs copying.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingLayout {
    /// Load entries: every (sequence, KV head) loads at most `width` pages.
    pub max_loads: usize,
    /// Mask entries: the loads, and at most `capacity` cleared slots per (sequence, KV head).
    pub max_masks: usize,
    /// Entries of the page table and of `table_len`: `batch · heads · width`.
    pub table_entries: usize,
    /// Slot id of the trash slot, one past the pool's `batch · heads · capacity` slots.
    pub trash: usize,
    pub load_idx_at: usize,
    pub mask_idx_at: usize,
    pub table_at: usize,
    pub table_len_at: usize,
    pub mask_at: usize,
    pub rows_at: usize,
    /// Bytes of a loaded page's K and V in the rows (`StagingShape`).
    pub k_page_bytes: usize,
    pub v_page_bytes: usize,
    /// Bytes of the whole buffer.
    pub bytes: usize,
}

impl StagingLayout {
    pub fn new(s: &StagingShape) -> StagingLayout {
        let lanes = s.batch * s.heads;
        let (max_loads, max_masks, table_entries) = (lanes * s.width, lanes * (s.width + s.capacity), lanes * s.width);
        let mask_idx_at = 8 * max_loads;
        let table_at = mask_idx_at + 8 * max_masks;
        let table_len_at = table_at + 4 * table_entries;
        let mask_at = table_len_at + 4 * table_entries;
        let rows_at = (mask_at + max_masks * s.page_size).div_ceil(ROW_ALIGN) * ROW_ALIGN;
        let bytes = rows_at + max_loads * s.row_bytes();
        StagingLayout {
            max_loads,
            max_masks,
            table_entries,
            trash: lanes * s.capacity,
            load_idx_at: 0,
            mask_idx_at,
            table_at,
            table_len_at,
            mask_at,
            rows_at,
            k_page_bytes: s.k_page_bytes,
            v_page_bytes: s.v_page_bytes,
            bytes,
        }
    }
}

/// Pages per head of a lane's K and V stores of `k_len` and `v_len` bytes (`[H_kv, P]` pages
/// each, the same `P`).
pub(super) fn store_pages(g: &Geometry, k_len: usize, v_len: usize) -> Result<usize> {
    let (h, kb, vb) = (g.heads, g.k_page_bytes(), g.v_page_bytes());
    let p = k_len / (h * kb);
    ensure!(
        k_len == p * h * kb && v_len == p * h * vb,
        "stores must be [{h}, P] pages of {kb} (K) and {vb} (V) bytes, got {k_len} and {v_len} bytes"
    );
    Ok(p)
}

/// What [`write_staging`] wrote.
pub(super) struct Staged {
    pub loads: usize,
    pub clears: usize,
    /// Pages selected, summed over sequences and KV heads.
    pub selected: usize,
    /// The used prefix of the buffer, in bytes.
    pub end: usize,
}

/// Writes the metadata of `lanes` (one plan per sequence, `width` pages per KV head) and
/// gathers their loaded pages from `stores` into `staging` (layout in the module docs).
pub(super) fn write_staging(
    g: &Geometry,
    lanes: &[LanePlan],
    width: usize,
    stores: &[(HostBuf, HostBuf)],
    staging: HostBuf,
) -> Result<Staged> {
    let (h, s) = (g.heads, g.page_size);
    let capacity = lanes.first().map_or(1, |l| l.capacity);
    let layout = g.staging_layout(lanes.len(), width, capacity);
    let (n, c) = (lanes.iter().map(|l| l.plan.pages.len()).sum(), lanes.iter().map(|l| l.plan.cleared.len()).sum());
    ensure!(n <= layout.max_loads && n + c <= layout.max_masks, "a job planned more loads than its layout holds");
    let selected = lanes.iter().map(|l| l.plan.table.iter().filter(|&&x| x >= 0).count()).sum();
    let (kb, vb) = (g.k_page_bytes(), g.v_page_bytes());
    let end = layout.rows_at + n * (kb + vb);
    let buf = staging.slice_mut::<u8>("staging")?;
    ensure!(layout.bytes <= buf.len(), "staging holds {} bytes, this layer's jobs need {}", buf.len(), layout.bytes);
    let (meta, rows) = buf.split_at_mut(layout.rows_at);
    let slot_id = |b: usize, head: i32, slot: i32| ((b * h + head as usize) * capacity) as i64 + slot as i64;
    let trash = layout.trash as i64;
    let mut ids: Vec<i64> = Vec::with_capacity(layout.max_loads + layout.max_masks);
    for (b, l) in lanes.iter().enumerate() {
        ids.extend(l.plan.heads.iter().zip(&l.plan.slots).map(|(&hd, &sl)| slot_id(b, hd, sl)));
    }
    ids.resize(layout.max_loads, trash);
    ids.extend_from_within(..n);
    for (b, l) in lanes.iter().enumerate() {
        ids.extend(l.plan.cleared.iter().map(|&(hd, sl)| slot_id(b, hd, sl)));
    }
    ids.resize(layout.max_loads + layout.max_masks, trash);
    for (o, x) in meta[layout.load_idx_at..layout.table_at].chunks_exact_mut(8).zip(&ids) {
        o.copy_from_slice(&x.to_ne_bytes());
    }
    let tables = lanes.iter().flat_map(|l| l.plan.table.iter()).chain(lanes.iter().flat_map(|l| l.table_len.iter()));
    for (o, x) in meta[layout.table_at..layout.mask_at].chunks_exact_mut(4).zip(tables) {
        o.copy_from_slice(&x.to_ne_bytes());
    }
    let lens = lanes.iter().flat_map(|l| l.load_len.iter().copied()).chain(std::iter::repeat_n(0, c));
    for (row, len) in meta[layout.mask_at..layout.mask_at + (n + c) * s].chunks_exact_mut(s).zip(lens) {
        row.iter_mut().enumerate().for_each(|(i, x)| *x = u8::from((i as i32) < len));
    }
    // Page rows: K then V of each loaded page, in plan order (sorted by store address).
    let mut sources = Vec::with_capacity(n);
    for (l, (ks, vs)) in lanes.iter().zip(stores) {
        let (ks, vs) = (ks.slice::<u8>("k_store")?, vs.slice::<u8>("v_store")?);
        let p = store_pages(g, ks.len(), vs.len())?;
        for (&hd, &pg) in l.plan.heads.iter().zip(&l.plan.pages) {
            ensure!((pg as usize) < p, "page {pg} out of range (stores hold {p})");
            let (k_at, v_at) = ((hd as usize * p + pg as usize) * kb, (hd as usize * p + pg as usize) * vb);
            sources.push((&ks[k_at..k_at + kb], &vs[v_at..v_at + vb]));
        }
    }
    rows[..n * (kb + vb)].par_chunks_mut(kb + vb).zip(sources).for_each(|(row, (k, v))| {
        row[..kb].copy_from_slice(k);
        row[kb..].copy_from_slice(v);
    });
    Ok(Staged { loads: n, clears: c, selected, end })
}
