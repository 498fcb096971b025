//! Attention over the device pages: the token lists that FlashInfer's paged decode reads
//! (`python/icecache/attend/flashinfer.py`; docs/ARCHITECTURE.md, section Attend), one list per
//! (sequence, KV head), built on the host from the step's page table and lengths and sent with
//! the step's other metadata.

use crate::error::{ensure, Result};

/// Where one layer's device tokens of one (sequence, KV head) live: `pool_slots` pages of
/// `page_size` tokens, then `sink_cap` sink slots, then `win_cap` window slots.
#[derive(Clone, Copy, Debug)]
pub struct DeviceLayout {
    pub pool_slots: usize,
    pub page_size: usize,
    pub sink_cap: usize,
    pub win_cap: usize,
}

impl DeviceLayout {
    /// Token slots per (sequence, KV head).
    pub fn tokens(&self) -> usize {
        self.pool_slots * self.page_size + self.sink_cap + self.win_cap
    }
}

/// Token lists of attention over the layer's buffer folded to pages of one token (FlashInfer
/// decode, `python/icecache/attend/flashinfer.py`): request `r = b·H + h` reads sequence `b`'s
/// `sink_len[b]` sink tokens, the first `page_len[b, h, j]` tokens of each selected page (pool
/// slot `table[b, h, j]`, -1 for none), then its `win_len[b]` window tokens; token `t` of request
/// `r` is folded index `r·T + t` (`T` = [`DeviceLayout::tokens`]). `table` and `page_len` are
/// `[B, H, M]`. Returns `(indptr [B·H + 1], indices)`: request `r` reads
/// `indices[indptr[r]..indptr[r + 1]]`.
pub fn fold_token_lists(
    table: &[i32],
    page_len: &[i32],
    sink_len: &[i32],
    win_len: &[i32],
    heads: usize,
    layout: DeviceLayout,
) -> Result<(Vec<i32>, Vec<i32>)> {
    let batch = sink_len.len();
    ensure!(batch >= 1 && heads >= 1, "fold_token_lists: empty batch or no heads");
    ensure!(win_len.len() == batch, "win_len has {} sequences, sink_len {batch}", win_len.len());
    ensure!(
        table.len() == page_len.len() && table.len().is_multiple_of(batch * heads),
        "table and page_len must both be [B, H, M] with B = {batch}, H = {heads}"
    );
    let per_request = layout.tokens();
    ensure!(
        batch * heads * per_request <= i32::MAX as usize,
        "the layer's buffer has too many tokens for int32 indices"
    );
    for (&s, &w) in sink_len.iter().zip(win_len) {
        ensure!(s >= 0 && s as usize <= layout.sink_cap, "sink_len {s} outside 0..={}", layout.sink_cap);
        ensure!(w >= 0 && w as usize <= layout.win_cap, "win_len {w} outside 0..={}", layout.win_cap);
    }
    for (&slot, &len) in table.iter().zip(page_len) {
        ensure!(slot >= -1 && slot < layout.pool_slots as i32, "pool slot {slot} outside -1..{}", layout.pool_slots);
        ensure!(len >= 0 && len as usize <= layout.page_size, "page length {len} outside 0..={}", layout.page_size);
    }
    let m = table.len() / (batch * heads);
    let (page, sink_at) = (layout.page_size as i32, (layout.pool_slots * layout.page_size) as i32);
    let mut indptr = Vec::with_capacity(batch * heads + 1);
    indptr.push(0);
    let mut indices = Vec::new();
    for b in 0..batch {
        for h in 0..heads {
            let r = b * heads + h;
            let base = (r * per_request) as i32;
            let sink = base + sink_at;
            indices.extend(sink..sink + sink_len[b]);
            for j in r * m..(r + 1) * m {
                if table[j] >= 0 {
                    let first = base + table[j] * page;
                    indices.extend(first..first + page_len[j]);
                }
            }
            let window = sink + layout.sink_cap as i32;
            indices.extend(window..window + win_len[b]);
            indptr.push(indices.len() as i32);
        }
    }
    Ok((indptr, indices))
}
