//! Loading selected pages to the device (docs/ARCHITECTURE.md, section Load): which pages are
//! resident in which device slot, and the gather of the missing ones into one staging buffer for
//! a single bulk copy.

use std::collections::HashMap;

use rayon::prelude::*;

use crate::error::{ensure, try_filled, Result};

const EMPTY: u32 = u32::MAX;

/// Device page slots of each KV head: page → slot, with least-recently-used eviction and a
/// stale mark for pages whose contents changed since they were loaded. Memory grows with the
/// slots used so far, not with `capacity` or with page ids.
pub struct ResidentPages {
    capacity: usize,
    /// Per head: the slots used so far (slot → what it holds, `EMPTY` once cleared); slots
    /// `len..capacity` have never been used.
    slots: Vec<Vec<Slot>>,
    /// Per head: page → slot, for the pages resident.
    slot_of: Vec<HashMap<u32, u32>>,
    step: u64,
}

#[derive(Clone, Copy)]
struct Slot {
    /// The page held, or `EMPTY`.
    page: u32,
    /// The step that last used it.
    used: u64,
    /// The page changed since it was loaded.
    stale: bool,
}

/// What one step must load, and where every selected page lives on the device.
#[derive(Clone, Debug, Default)]
pub struct LoadPlan {
    /// Pages to copy, sorted by (head, page) — i.e. by source address in the page store.
    pub heads: Vec<i32>,
    pub pages: Vec<i32>,
    /// Device slot each copied page goes to.
    pub slots: Vec<i32>,
    /// `[H_kv, max_pages]`: device slot of each selected page, -1 past its head's count.
    pub table: Vec<i32>,
    /// Slots freed because their page changed and was not selected again (`(head, slot)`, by
    /// head): their device copy is stale, so whoever reads every resident slot (the look-ahead
    /// ranking on the device) must stop reading them.
    pub cleared: Vec<(i32, i32)>,
}

impl ResidentPages {
    /// `capacity` device slots for each of `num_heads` heads; both at most `i32::MAX` (plans
    /// name them as int32).
    pub fn new(num_heads: usize, capacity: usize) -> Result<ResidentPages> {
        let max = i32::MAX as usize;
        ensure!((1..=max).contains(&num_heads), "num_heads must be in 1..={max}, got {num_heads}");
        ensure!((1..=max).contains(&capacity), "capacity must be in 1..={max}, got {capacity}");
        Ok(ResidentPages {
            capacity,
            slots: try_filled(num_heads, Vec::new(), "the slot tables")?,
            slot_of: try_filled(num_heads, HashMap::new(), "the page maps")?,
            step: 0,
        })
    }

    pub fn num_heads(&self) -> usize {
        self.slots.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// `[H_kv, capacity]`: the page in each device slot, -1 for an empty one (allocated
    /// fallibly: `capacity` may be far larger than the slots in use).
    pub fn slot_pages(&self) -> Result<Vec<i32>> {
        let n = self.slots.len().saturating_mul(self.capacity);
        let mut out = try_filled(n, -1, "the slot table [H_kv, capacity]")?;
        for (row, slots) in out.chunks_exact_mut(self.capacity.max(1)).zip(&self.slots) {
            for (o, s) in row.iter_mut().zip(slots) {
                if s.page != EMPTY {
                    *o = s.page as i32;
                }
            }
        }
        Ok(out)
    }

    /// Marks `pages` of `head` stale: they are reloaded the next time they are selected.
    pub fn invalidate(&mut self, head: usize, pages: &[i64]) -> Result<()> {
        ensure!(head < self.slots.len(), "head {head} out of range ({} heads)", self.slots.len());
        for &p in pages {
            ensure!(p >= 0 && p <= i32::MAX as i64, "invalid page {p}");
        }
        for &p in pages {
            if let Some(&s) = self.slot_of[head].get(&(p as u32)) {
                self.slots[head][s as usize].stale = true;
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
        let mut plan = LoadPlan { table: vec![-1; h * width], ..LoadPlan::default() };
        for hi in 0..h {
            let sel = &pages[hi * width..hi * width + counts[hi] as usize];
            let (slots, slot_of) = (&mut self.slots[hi], &mut self.slot_of[hi]);
            let mut missing = Vec::new();
            for (i, &p) in sel.iter().enumerate() {
                match slot_of.get(&(p as u32)) {
                    None => missing.push(i),
                    Some(&s) => {
                        let slot = &mut slots[s as usize];
                        slot.used = step;
                        plan.table[hi * width + i] = s as i32;
                        if slot.stale {
                            slot.stale = false;
                            plan.heads.push(hi as i32);
                            plan.pages.push(p);
                            plan.slots.push(s as i32);
                        }
                    }
                }
            }
            // Free and stale slots first (cleared ones, then never used ones, then stale ones
            // from the least recently used), then the least recently used of those not needed
            // this step.
            let cleared: Vec<usize> = (0..slots.len()).filter(|&s| slots[s].page == EMPTY).collect();
            let fresh = self.capacity - slots.len();
            let mut used: Vec<usize> =
                (0..slots.len()).filter(|&s| slots[s].page != EMPTY && slots[s].used != step).collect();
            used.sort_by_key(|&s| (!slots[s].stale, slots[s].used));
            for (n, i) in missing.into_iter().enumerate() {
                let p = sel[i] as u32;
                let new = Slot { page: p, used: step, stale: false };
                let s = if n < cleared.len() {
                    cleared[n]
                } else if n < cleared.len() + fresh {
                    slots.push(new);
                    slots.len() - 1
                } else {
                    used[n - cleared.len() - fresh]
                };
                if slots[s].page != EMPTY {
                    slot_of.remove(&slots[s].page);
                }
                slots[s] = new;
                slot_of.insert(p, s as u32);
                plan.table[hi * width + i] = s as i32;
                plan.heads.push(hi as i32);
                plan.pages.push(p as i32);
                plan.slots.push(s as i32);
            }
            // Stale pages that were not selected again leave the device.
            for (s, slot) in slots.iter_mut().enumerate() {
                if slot.stale && slot.page != EMPTY {
                    slot_of.remove(&slot.page);
                    *slot = Slot { page: EMPTY, used: 0, stale: false };
                    plan.cleared.push((hi as i32, s as i32));
                }
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
            cleared: plan.cleared,
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
