//! Queries: beam descent to the best leaf cells, an int8 first pass over their members (or
//! P-DCI inside large cells), exact f32 re-ranking of the survivors. `exact` scans every key.

use rayon::prelude::*;

use super::descent::Descent;
use super::pdci::PdciScratch;
use super::rank::{pack, truncate_best, unpack};
use super::{DciIndex, Metric, FREE};
use crate::error::{try_filled, Result};
use crate::simd;

/// Leaf cells in the default field of view, per square root of the number of leaf cells.
/// Tuned on real attention keys (SmolLM2, 28k keys): recall@100 0.99 at effort 1.
const FOV_SCALE: f32 = 2.8;

/// Above the leaves, each tier keeps this many times the candidates the tier below needs.
const BEAM_SLACK: f32 = 3.0;
/// Share of a large cell's members that P-DCI retrieves per composite index at effort 1.
const PDCI_SHARE: f32 = 0.25;

/// The field of view of a search among `cells` leaf cells holding `keys` keys in all: enough
/// cells for `pool` keys (at the mean cell size, and one more), and `FOV_SCALE` per square
/// root of the cells at effort 1, scaled by `effort`; at most every cell.
pub(crate) fn field_of_view(cells: usize, keys: usize, pool: usize, effort: f32) -> usize {
    let mean = keys as f32 / cells as f32;
    let min_cells = (pool as f32 / mean).ceil() as usize + 1;
    ((FOV_SCALE * (cells as f32).sqrt() * effort).ceil() as usize).max(min_cells).min(cells)
}

/// Per-query buffers, reused across the queries one worker runs.
#[derive(Default)]
pub struct Scratch {
    descent: Descent,
    covers: Vec<usize>,
    /// The leaf cells to scan.
    view: Vec<u32>,
    /// The quantised query.
    qcode: Vec<i8>,
    dots: Vec<i32>,
    qproj: Vec<f32>,
    pdci: PdciScratch,
    picked: Vec<u32>,
    /// Candidates packed by `pack`: larger is better for both metrics.
    cand: Vec<u64>,
    scan: Vec<f32>,
}

impl DciIndex {
    pub(super) fn query_batch(
        &self,
        queries: &[f32],
        nq: usize,
        k: usize,
        effort: f32,
        exact: bool,
    ) -> Result<(Vec<i64>, Vec<f32>)> {
        let d = self.cfg.dim;
        // `nq * k` comes from the caller (k up to the index size): allocated fallibly.
        let n = nq.saturating_mul(k);
        let mut ids = try_filled(n, 0i64, "the result ids [nq, k]")?;
        let mut scores = try_filled(n, 0f32, "the result scores [nq, k]")?;
        let one = |s: &mut Scratch, ((oi, os), q): ((&mut [i64], &mut [f32]), &[f32])| {
            self.best(q, k, effort, exact, s);
            for ((oi, os), &p) in oi.iter_mut().zip(os.iter_mut()).zip(&s.cand) {
                (*oi, *os) = self.result(p);
            }
        };
        if nq == 1 {
            // A single query stays on the caller's thread: handing it to a pool costs more.
            one(&mut Scratch::default(), ((&mut ids[..], &mut scores[..]), queries));
        } else {
            ids.par_chunks_mut(k)
                .zip(scores.par_chunks_mut(k))
                .zip(queries.par_chunks_exact(d))
                .for_each_init(Scratch::default, one);
        }
        Ok((ids, scores))
    }

    /// Rank score (larger is better) from `q · k`: the inner product itself, or `2 q·k - |k|²`
    /// which orders like `-|q - k|²`.
    fn rank(&self, dot: f32, slot: u32) -> f32 {
        match self.cfg.metric {
            Metric::InnerProduct => dot,
            Metric::L2 => 2.0 * dot - self.sq_norms[slot as usize],
        }
    }

    /// Rank scores of the routes of tier-`t` `cells` for query `q`, into `out`.
    fn route_scores(&self, t: usize, cells: &[u32], q: &[f32], out: &mut [f32]) {
        let tier = &self.tiers[t];
        simd::dot_gather(q, &tier.routes, cells, out);
        if self.cfg.metric == Metric::L2 {
            for (o, &c) in out.iter_mut().zip(cells) {
                *o = 2.0 * *o - tier.route_sq[c as usize];
            }
        }
    }

    /// Exact rank score: `q · k`, or `-|q - k|²` computed directly (no cancellation).
    fn exact_rank(&self, q: &[f32], slot: u32) -> f32 {
        match self.cfg.metric {
            Metric::InnerProduct => simd::dot(q, self.key(slot)),
            Metric::L2 => -simd::sq_dist(q, self.key(slot)),
        }
    }

    fn exact_candidates(&self, q: &[f32], s: &mut Scratch) {
        let slots = self.level.len();
        s.scan.resize(slots, 0.0);
        let sign = match self.cfg.metric {
            Metric::InnerProduct => {
                simd::dot_rows(q, &self.keys, &mut s.scan);
                1.0
            }
            Metric::L2 => {
                simd::sq_dist_rows(q, &self.keys, &mut s.scan);
                -1.0
            }
        };
        s.cand.clear();
        for (slot, &v) in s.scan.iter().enumerate() {
            if self.level[slot] != FREE {
                s.cand.push(pack(sign * v, slot as u32));
            }
        }
    }

    /// Fills `s.cand` with re-ranked candidates (exact rank scores) for one query.
    fn approx_candidates(&self, q: &[f32], k: usize, effort: f32, s: &mut Scratch) {
        let pool = (self.cfg.rerank as f32 * k as f32 * effort.max(1.0)).ceil() as usize;
        self.first_pass(q, pool, effort, s);
        // Re-rank the best of the first pass exactly.
        truncate_best(&mut s.cand, pool);
        for e in s.cand.iter_mut() {
            let slot = unpack(*e).1;
            *e = pack(self.exact_rank(q, slot), slot);
        }
    }

    /// Beam descent to the best leaf cells, then int8 estimates of `q · k` (relative to
    /// `code_center`, a constant shift that ranks alike) for the keys in view: every member of a small cell, P-DCI's picks in a
    /// large one. Fills `s.cand` with packed `(approximate rank, slot)`. The field of view covers
    /// at least `pool` keys.
    fn first_pass(&self, q: &[f32], pool: usize, effort: f32, s: &mut Scratch) {
        self.view_cells(q, pool, effort, s);
        let d = self.cfg.dim;
        let leaves = &self.tiers[0];
        s.qcode.resize(d, 0);
        let qscale = simd::quantize_i8(q, &mut s.qcode);
        s.qproj.clear();
        s.cand.clear();
        for &cell in &s.view {
            let c = &leaves.cells[cell as usize];
            let n = c.members.len();
            s.dots.resize(n, 0);
            let mut emit = |dot: i32, scale: f32, slot: u32| {
                s.cand.push(pack(self.rank(dot as f32 * qscale * scale, slot), slot));
            };
            if n >= self.cfg.pdci_min_cell {
                if s.qproj.is_empty() {
                    self.query_proj(q, &mut s.qproj);
                }
                let budget = ((n as f32 * PDCI_SHARE * effort).ceil() as usize).clamp(1, n);
                s.picked.clear();
                self.pdci_candidates(c, &s.qproj, budget, &mut s.pdci, &mut s.picked);
                for &pos in &s.picked {
                    let p = pos as usize;
                    simd::dot_rows_i8(&s.qcode, &c.codes[p * d..(p + 1) * d], &mut s.dots[..1]);
                    emit(s.dots[0], c.scales[p], c.members[p]);
                }
            } else {
                simd::dot_rows_i8(&s.qcode, &c.codes, &mut s.dots);
                for ((&dot, &scale), &slot) in s.dots.iter().zip(&c.scales).zip(&c.members) {
                    emit(dot, scale, slot);
                }
            }
        }
    }

    /// The leaf cells in `q`'s field of view (enough cells for `pool` keys, and more with
    /// `effort`), into `s.view`, in the descent's order.
    fn view_cells(&self, q: &[f32], pool: usize, effort: f32, s: &mut Scratch) {
        let top = self.tiers.len() - 1;
        let leaves = &self.tiers[0];
        let fov = field_of_view(leaves.live_cells(), leaves.num_members, pool, effort);
        s.covers.clear();
        s.covers.push(0);
        let mut need = fov as f32;
        for t in 1..=top {
            let cover = (BEAM_SLACK * need).ceil();
            s.covers.push(cover as usize);
            let tier = &self.tiers[t];
            need = cover / (tier.num_members as f32 / tier.live_cells() as f32);
        }
        let covers = &s.covers;
        self.descend(0, |t| covers[t], |t, cells, out| self.route_scores(t, cells, q, out), &mut s.descent);
        let cells = &mut s.descent.cand;
        if cells.len() > fov {
            cells.select_nth_unstable_by(fov - 1, |a, b| b.0.total_cmp(&a.0));
            cells.truncate(fov);
        }
        s.view.clear();
        s.view.extend(cells.iter().map(|&(_, cell)| cell));
    }

    /// Appends the projections of the transformed query onto the P-DCI directions to `out`.
    fn query_proj(&self, q: &[f32], out: &mut Vec<f32>) {
        let d = self.cfg.dim;
        let norm = match self.cfg.metric {
            Metric::InnerProduct => simd::dot(q, q).sqrt().max(f32::MIN_POSITIVE),
            Metric::L2 => 1.0,
        };
        out.extend(self.dirs.chunks_exact(d + 1).map(|u| simd::dot(q, &u[..d]) / norm));
    }

    /// The best `k` points for `q`, best first, into `s.cand` (packed, exact rank scores).
    fn best(&self, q: &[f32], k: usize, effort: f32, exact: bool, s: &mut Scratch) {
        if exact {
            self.exact_candidates(q, s);
        } else {
            self.approx_candidates(q, k, effort, s);
            if s.cand.len() < k {
                // The field of view held fewer than k points (tiny index or huge k).
                self.exact_candidates(q, s);
            }
        }
        truncate_best(&mut s.cand, k);
        s.cand.sort_unstable_by(|a, b| b.cmp(a));
    }

    /// The id and the score (as `query` reports it) of a packed candidate.
    fn result(&self, p: u64) -> (i64, f32) {
        let (r, slot) = unpack(p);
        let score = match self.cfg.metric {
            Metric::InnerProduct => r,
            Metric::L2 => -r,
        };
        (self.ids[slot as usize], score)
    }

    /// `query` for one query on the caller's thread, reusing `s`: appends the best `k`
    /// (`1 <= k <= len`) as `(id, score)`, best first, to `out`. The caller has validated `q`.
    pub(crate) fn search_into(&self, q: &[f32], k: usize, effort: f32, s: &mut Scratch, out: &mut Vec<(i64, f32)>) {
        debug_assert!(k >= 1 && k <= self.len && q.len() == self.cfg.dim);
        self.best(q, k, effort, false, s);
        out.extend(s.cand.iter().map(|&p| self.result(p)));
    }
}
