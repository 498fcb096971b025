//! Loading selected pages to the device (DESIGN 2.5): which pages are resident in which device
//! slot, and the gather of the missing ones into one staging buffer for a single bulk copy.

use rayon::prelude::*;

use crate::error::{ensure, Result};

const EMPTY: u32 = u32::MAX;

/// Device page slots of each KV head: page → slot, with least-recently-used eviction and a
/// stale mark for pages whose contents changed since they were loaded.
pub struct ResidentPages {
    capacity: usize,
    /// Per head: slot → (page or EMPTY, last step used, stale).
    slots: Vec<Vec<(u32, u64, bool)>>,
    /// Per head: page → slot (dense; grows with the page count).
    slot_of: Vec<Vec<u32>>,
    step: u64,
}

/// What one step must load, and where every selected page lives on the device.
pub struct LoadPlan {
    /// Pages to copy, sorted by (head, page) — i.e. by source address in the page store.
    pub heads: Vec<i32>,
    pub pages: Vec<i32>,
    /// Device slot each copied page goes to.
    pub slots: Vec<i32>,
    /// `[H_kv, max_pages]`: device slot of each selected page, -1 past its head's count.
    pub table: Vec<i32>,
}

impl ResidentPages {
    pub fn new(num_heads: usize, capacity: usize) -> Result<ResidentPages> {
        ensure!(num_heads >= 1, "num_heads must be at least 1");
        ensure!(capacity >= 1, "capacity must be at least 1");
        Ok(ResidentPages {
            capacity,
            slots: vec![vec![(EMPTY, 0, false); capacity]; num_heads],
            slot_of: vec![Vec::new(); num_heads],
            step: 0,
        })
    }

    pub fn num_heads(&self) -> usize {
        self.slots.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Marks `pages` of `head` stale: they are reloaded the next time they are selected.
    pub fn invalidate(&mut self, head: usize, pages: &[i64]) -> Result<()> {
        ensure!(head < self.slots.len(), "head {head} out of range ({} heads)", self.slots.len());
        for &p in pages {
            ensure!(p >= 0 && p < u32::MAX as i64, "invalid page {p}");
            if let Some(&s) = self.slot_of[head].get(p as usize) {
                if s != EMPTY {
                    self.slots[head][s as usize].2 = true;
                }
            }
        }
        Ok(())
    }

    /// Plans one step for `pages` `[H_kv, max_pages]` / `counts` (as `select` returns).
    pub fn plan(&mut self, pages: &[i32], counts: &[i32]) -> Result<LoadPlan> {
        let h = self.slots.len();
        ensure!(counts.len() == h, "counts must have {h} entries, got {}", counts.len());
        ensure!(!pages.is_empty() && pages.len().is_multiple_of(h), "pages must be [{h}, max_pages]");
        let width = pages.len() / h;
        for (hi, &c) in counts.iter().enumerate() {
            ensure!(c >= 0 && c as usize <= width, "counts[{hi}] = {c} is outside 0..={width}");
            ensure!(c as usize <= self.capacity, "head {hi} selects {c} pages; capacity is {}", self.capacity);
            let sel = &pages[hi * width..hi * width + c as usize];
            ensure!(sel.iter().all(|&p| p >= 0), "head {hi}: negative page id among the first {c}");
            let mut sorted = sel.to_vec();
            sorted.sort_unstable();
            ensure!(sorted.windows(2).all(|w| w[0] != w[1]), "head {hi} selects a page twice");
        }
        self.step += 1;
        let step = self.step;
        let mut plan = LoadPlan { heads: Vec::new(), pages: Vec::new(), slots: Vec::new(), table: vec![-1; h * width] };
        for hi in 0..h {
            let sel = &pages[hi * width..hi * width + counts[hi] as usize];
            let (slots, slot_of) = (&mut self.slots[hi], &mut self.slot_of[hi]);
            let mut missing = Vec::new();
            for (i, &p) in sel.iter().enumerate() {
                let p = p as usize;
                if slot_of.len() <= p {
                    slot_of.resize(p + 1, EMPTY);
                }
                match slot_of[p] {
                    EMPTY => missing.push(i),
                    s => {
                        slots[s as usize].1 = step;
                        plan.table[hi * width + i] = s as i32;
                        if slots[s as usize].2 {
                            slots[s as usize].2 = false;
                            plan.heads.push(hi as i32);
                            plan.pages.push(p as i32);
                            plan.slots.push(s as i32);
                        }
                    }
                }
            }
            // Free slots first, then the least recently used of those not needed this step.
            let mut victims: Vec<usize> = (0..self.capacity).filter(|&s| slots[s].1 != step).collect();
            victims.sort_by_key(|&s| (slots[s].0 != EMPTY, slots[s].1));
            for (i, s) in missing.into_iter().zip(victims) {
                let p = sel[i] as u32;
                let old = slots[s].0;
                if old != EMPTY {
                    slot_of[old as usize] = EMPTY;
                }
                slots[s] = (p, step, false);
                slot_of[p as usize] = s as u32;
                plan.table[hi * width + i] = s as i32;
                plan.heads.push(hi as i32);
                plan.pages.push(p as i32);
                plan.slots.push(s as i32);
            }
        }
        // Source-address order: (head, page) ascending.
        let mut order: Vec<usize> = (0..plan.pages.len()).collect();
        order.sort_unstable_by_key(|&i| (plan.heads[i], plan.pages[i]));
        let pick = |v: &[i32]| order.iter().map(|&i| v[i]).collect::<Vec<_>>();
        plan = LoadPlan {
            heads: pick(&plan.heads),
            pages: pick(&plan.pages),
            slots: pick(&plan.slots),
            table: plan.table,
        };
        Ok(plan)
    }
}

/// Copies page `pages[i]` of head `heads[i]` from the stores (`[H_kv, P, block]` flattened,
/// `block = page_size · d`) into row `i` of the staging buffers (`[R, block]`), in parallel.
// Eight plain slices and sizes, each named at the call site; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub fn gather_pages<T: Copy + Send + Sync>(
    k_store: &[T],
    v_store: &[T],
    num_heads: usize,
    block: usize,
    heads: &[i32],
    pages: &[i32],
    k_stage: &mut [T],
    v_stage: &mut [T],
) -> Result<()> {
    ensure!(block >= 1 && num_heads >= 1, "empty page blocks");
    ensure!(k_store.len() == v_store.len(), "k_store and v_store differ in size");
    ensure!(k_store.len().is_multiple_of(num_heads * block), "stores are not [H_kv, P, page_size, d]");
    let p = k_store.len() / (num_heads * block);
    ensure!(heads.len() == pages.len(), "heads and pages differ in length");
    ensure!(k_stage.len() == v_stage.len(), "k_stage and v_stage differ in size");
    ensure!(k_stage.len().is_multiple_of(block), "staging buffers are not [R, page_size, d]");
    ensure!(
        k_stage.len() / block >= pages.len(),
        "staging buffers hold {} pages, {} requested",
        k_stage.len() / block,
        pages.len()
    );
    for (&hh, &pp) in heads.iter().zip(pages) {
        ensure!(hh >= 0 && (hh as usize) < num_heads, "head {hh} out of range");
        ensure!(pp >= 0 && (pp as usize) < p, "page {pp} out of range (stores hold {p})");
    }
    let n = pages.len();
    for (store, stage) in [(k_store, &mut *k_stage), (v_store, &mut *v_stage)] {
        stage[..n * block].par_chunks_mut(block).enumerate().for_each(|(i, row)| {
            let src = (heads[i] as usize * p + pages[i] as usize) * block;
            row.copy_from_slice(&store[src..src + block]);
        });
    }
    Ok(())
}

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
