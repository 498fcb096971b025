//! Prioritized DCI (Li & Malik 2017) inside one tier-0 cell.
//!
//! Each of the `L` composite indices owns `m` simple indices (random directions; the cell's
//! members sorted by projection). A composite walks outward from the query's projection in all
//! its simple indices at once, always advancing the one whose next point is closest in
//! projection (a priority queue). A point becomes a candidate when all `m` simple indices of a
//! composite have visited it. The walk stops at the candidate budget.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::cells::Cell;
use super::DciIndex;

/// Reusable buffers of one P-DCI search.
#[derive(Default)]
pub(super) struct PdciScratch {
    counts: Vec<u8>,
    seen: Vec<bool>,
    heap: BinaryHeap<Reverse<(u32, u32, u32)>>,
}

impl DciIndex {
    /// Appends to `out` the member positions (indices into `cell.members`) that P-DCI retrieves
    /// for a query whose projections onto the directions are `qproj`; at most `budget` per
    /// composite index, deduplicated across composites.
    pub(super) fn pdci_candidates(
        &self,
        cell: &Cell,
        qproj: &[f32],
        budget: usize,
        s: &mut PdciScratch,
        out: &mut Vec<u32>,
    ) {
        let n = cell.members.len();
        let m = self.cfg.num_simple;
        let pos_of = &self.tiers[0].member_pos;
        s.seen.clear();
        s.seen.resize(n, false);
        for l in 0..self.cfg.num_composite {
            s.counts.clear();
            s.counts.resize(n, 0);
            s.heap.clear();
            // Entries: (gap bits, direction, index into the sorted array). Gaps are
            // non-negative, so their bit patterns order like the floats.
            let gap = |arr: &[(f32, u32)], i: usize, q: f32| (arr[i].0 - q).abs().to_bits();
            for (j, &q) in qproj.iter().enumerate().take((l + 1) * m).skip(l * m) {
                let arr = &cell.sorted[j];
                let at = arr.partition_point(|e| e.0 < q);
                // Two frontiers per simple index, walking left and right from the query;
                // `encode` packs an entry's index with the side it walks.
                if at > 0 {
                    s.heap.push(Reverse((gap(arr, at - 1, q), j as u32, encode(at - 1, false))));
                }
                if at < n {
                    s.heap.push(Reverse((gap(arr, at, q), j as u32, encode(at, true))));
                }
            }
            let mut found = 0;
            while found < budget {
                let Some(Reverse((_, j, code))) = s.heap.pop() else { break };
                let (i, right) = decode(code);
                let arr = &cell.sorted[j as usize];
                let pos = pos_of[arr[i].1 as usize] as usize;
                s.counts[pos] += 1;
                if s.counts[pos] as usize == m {
                    found += 1;
                    if !s.seen[pos] {
                        s.seen[pos] = true;
                        out.push(pos as u32);
                    }
                }
                let q = qproj[j as usize];
                if right && i + 1 < n {
                    s.heap.push(Reverse((gap(arr, i + 1, q), j, encode(i + 1, true))));
                } else if !right && i > 0 {
                    s.heap.push(Reverse((gap(arr, i - 1, q), j, encode(i - 1, false))));
                }
            }
        }
    }
}

fn encode(i: usize, right: bool) -> u32 {
    ((i as u32) << 1) | right as u32
}

fn decode(code: u32) -> (usize, bool) {
    ((code >> 1) as usize, code & 1 == 1)
}
