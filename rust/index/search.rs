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

/// One key a scan scored: `q · k` (an int8 estimate, or exact), the key's tag (see
/// `DciIndex::tags`) and its slot (`DciIndex::slot_id` gives its id).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scored {
    pub score: f32,
    pub tag: u32,
    pub slot: u32,
}

/// Per-query buffers, reused across the queries one worker runs.
#[derive(Default)]
pub struct Scratch {
    descent: Descent,
    covers: Vec<usize>,
    /// The leaf cells to scan, and (group view) each query's own, best first.
    view: Vec<u32>,
    lists: Vec<Vec<u32>>,
    /// Marks the cells already in a group's view; all false between calls.
    in_view: Vec<bool>,
    /// Quantised queries `[G, d]` and their scales.
    qcode: Vec<i8>,
    qscales: Vec<f32>,
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
            if exact {
                self.exact_candidates(q, s);
            } else {
                self.approx_candidates(q, k, effort, s);
                if s.cand.len() < k {
                    // The field of view held fewer than k points (tiny index or huge k).
                    self.exact_candidates(q, s);
                }
            }
            self.emit(k, s, oi, os);
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

    /// Inner products of `q` with the keys a search looks at: every key the first pass scans
    /// (int8 estimates; at least `pool` keys) or, with `exact`, every key exactly. Appends one
    /// [`Scored`] per key to `out`. Inner-product indexes only (what attention needs).
    pub(crate) fn scan_scores(
        &self,
        q: &[f32],
        pool: usize,
        effort: f32,
        exact: bool,
        s: &mut Scratch,
        out: &mut Vec<Scored>,
    ) {
        debug_assert_eq!(self.cfg.metric, Metric::InnerProduct);
        if exact {
            self.exact_candidates(q, s);
            out.extend(s.cand.iter().map(|&p| {
                let (score, slot) = unpack(p);
                Scored { score, tag: self.tags[slot as usize], slot }
            }));
            return;
        }
        // Codes are relative to `code_center`: add back its (constant) share of the score.
        let shift = simd::dot(q, &self.code_center);
        self.scan_view(q, pool, effort, s, |v, slot, tag| out.push(Scored { score: v + shift, tag, slot }));
    }

    /// Beam descent to the best leaf cells and an int8 pass over their members: fills
    /// `s.cand` with packed `(approximate rank, slot)`. The field of view covers at least `pool`
    /// keys.
    fn first_pass(&self, q: &[f32], pool: usize, effort: f32, s: &mut Scratch) {
        let mut cand = std::mem::take(&mut s.cand);
        cand.clear();
        self.scan_view(q, pool, effort, s, |v, slot, _| cand.push(pack(self.rank(v, slot), slot)));
        s.cand = cand;
    }

    /// Beam descent to the best leaf cells, then int8 estimates of `q · k` (relative to
    /// `code_center`) for the keys in view: every member of a small cell, P-DCI's picks in a
    /// large one. Calls `emit(estimate, slot, tag)` for each, cell by cell. The field of view
    /// covers at least `pool` keys.
    fn scan_view(&self, q: &[f32], pool: usize, effort: f32, s: &mut Scratch, mut emit: impl FnMut(f32, u32, u32)) {
        self.view_cells(q, pool, effort, s, false);
        let view = std::mem::take(&mut s.view);
        self.scan_cells(q, &view, effort, s, |_, v, slot, tag| emit(v, slot, tag));
        s.view = view;
    }

    /// The leaf cells in `q`'s field of view (enough cells for `pool` keys, and more with
    /// `effort`), into `s.view`: best route score first when `ordered`, else in the descent's
    /// order.
    fn view_cells(&self, q: &[f32], pool: usize, effort: f32, s: &mut Scratch, ordered: bool) {
        let top = self.tiers.len() - 1;
        let leaves = &self.tiers[0];
        let n0 = leaves.live_cells();
        let avg0 = leaves.num_members as f32 / n0 as f32;
        let min_cells = (pool as f32 / avg0).ceil() as usize + 1;
        let fov = ((FOV_SCALE * (n0 as f32).sqrt() * effort).ceil() as usize).max(min_cells).min(n0);

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
        if ordered {
            cells.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        }
        s.view.clear();
        s.view.extend(cells.iter().map(|&(_, cell)| cell));
    }

    /// int8 estimates of `q · k` (relative to `code_center`) of each query of `queries`
    /// (`[G, d]`) with the keys of the leaf cells `cells`: every member of a small cell, each
    /// query's P-DCI picks in a large one. Calls `emit(query, estimate, slot, tag)`, cell by cell,
    /// the queries of a cell one after the other (the cell's codes stay in cache between them).
    fn scan_cells(
        &self,
        queries: &[f32],
        cells: &[u32],
        effort: f32,
        s: &mut Scratch,
        mut emit: impl FnMut(usize, f32, u32, u32),
    ) {
        let d = self.cfg.dim;
        let g = queries.len() / d;
        let leaves = &self.tiers[0];
        s.qcode.resize(g * d, 0);
        s.qscales.clear();
        for (q, code) in queries.chunks_exact(d).zip(s.qcode.chunks_exact_mut(d)) {
            s.qscales.push(simd::quantize_i8(q, code));
        }
        s.qproj.clear();
        for &cell in cells {
            let c = &leaves.cells[cell as usize];
            let n = c.members.len();
            s.dots.resize(n, 0);
            for (j, (qcode, &qscale)) in s.qcode.chunks_exact(d).zip(&s.qscales).enumerate() {
                if n >= self.cfg.pdci_min_cell {
                    if s.qproj.is_empty() {
                        for q in queries.chunks_exact(d) {
                            self.query_proj(q, &mut s.qproj);
                        }
                    }
                    let nd = self.cfg.num_dirs();
                    let budget = ((n as f32 * PDCI_SHARE * effort).ceil() as usize).clamp(1, n);
                    s.picked.clear();
                    self.pdci_candidates(c, &s.qproj[j * nd..(j + 1) * nd], budget, &mut s.pdci, &mut s.picked);
                    for &pos in &s.picked {
                        let p = pos as usize;
                        simd::dot_rows_i8(qcode, &c.codes[p * d..(p + 1) * d], &mut s.dots[..1]);
                        emit(j, s.dots[0] as f32 * qscale * c.scales[p], c.members[p], c.tags[p]);
                    }
                } else {
                    simd::dot_rows_i8(qcode, &c.codes, &mut s.dots);
                    for (((&dot, &scale), &slot), &tag) in s.dots.iter().zip(&c.scales).zip(&c.members).zip(&c.tags) {
                        emit(j, dot as f32 * qscale * scale, slot, tag);
                    }
                }
            }
        }
        s.qproj.clear();
    }

    /// `scan_scores` for the query heads of one GQA group (`queries` `[G, d]`) sharing one field
    /// of view: the leaf cells each query ranks best, taken in turn (every query's best cell,
    /// then every query's second best, ...) until the view holds as many cells as one query's
    /// own, so the group reads one field of view's codes instead of `G`. Every query scores every
    /// key in the shared view; `out[j]` receives query `j`'s scores.
    pub(crate) fn scan_group_scores(
        &self,
        queries: &[f32],
        pool: usize,
        effort: f32,
        s: &mut Scratch,
        out: &mut [Vec<Scored>],
    ) {
        debug_assert_eq!(self.cfg.metric, Metric::InnerProduct);
        let d = self.cfg.dim;
        let mut lists = std::mem::take(&mut s.lists);
        lists.clear();
        let mut fov = 0;
        for q in queries.chunks_exact(d) {
            self.view_cells(q, pool, effort, s, true);
            fov = fov.max(s.view.len());
            lists.push(std::mem::take(&mut s.view));
        }
        s.in_view.resize(self.tiers[0].cells.len(), false);
        let mut view = Vec::with_capacity(fov);
        'fill: for rank in 0..fov {
            for list in &lists {
                if let Some(&cell) = list.get(rank) {
                    if !std::mem::replace(&mut s.in_view[cell as usize], true) {
                        view.push(cell);
                        if view.len() == fov {
                            break 'fill;
                        }
                    }
                }
            }
        }
        for &cell in &view {
            s.in_view[cell as usize] = false;
        }
        let shifts: Vec<f32> = queries.chunks_exact(d).map(|q| simd::dot(q, &self.code_center)).collect();
        self.scan_cells(queries, &view, effort, s, |j, v, slot, tag| {
            out[j].push(Scored { score: v + shifts[j], tag, slot })
        });
        s.view = view;
        s.lists = lists;
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

    /// Writes the best `k` of `s.cand` (exact rank scores), best first.
    fn emit(&self, k: usize, s: &mut Scratch, ids: &mut [i64], scores: &mut [f32]) {
        truncate_best(&mut s.cand, k);
        s.cand.sort_unstable_by(|a, b| b.cmp(a));
        for ((oi, os), &p) in ids.iter_mut().zip(scores.iter_mut()).zip(&s.cand) {
            let (r, slot) = unpack(p);
            *oi = self.ids[slot as usize];
            *os = match self.cfg.metric {
                Metric::InnerProduct => r,
                Metric::L2 => -r,
            };
        }
    }
}
