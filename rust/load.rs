//! Loading selected pages to the device (docs/ARCHITECTURE.md, section Load): which pages are
//! resident in which device slot, and the gather of the missing ones into one staging buffer for
//! a single bulk copy.

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

    /// `[H_kv, capacity]`: the page in each device slot, -1 for an empty one.
    pub fn slot_pages(&self) -> Vec<i32> {
        self.slots.iter().flatten().map(|&(p, _, _)| if p == EMPTY { -1 } else { p as i32 }).collect()
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
        let mut plan = LoadPlan {
            heads: Vec::new(),
            pages: Vec::new(),
            slots: Vec::new(),
            table: vec![-1; h * width],
            cleared: Vec::new(),
        };
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
            // Free and stale slots first, then the least recently used of those not needed this
            // step.
            let mut victims: Vec<usize> = (0..self.capacity).filter(|&s| slots[s].1 != step).collect();
            victims.sort_by_key(|&s| (slots[s].0 != EMPTY && !slots[s].2, slots[s].1));
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
            // Stale pages that were not selected again leave the device.
            for (s, entry) in slots.iter_mut().enumerate() {
                if entry.2 && entry.0 != EMPTY {
                    slot_of[entry.0 as usize] = EMPTY;
                    *entry = (EMPTY, 0, false);
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
