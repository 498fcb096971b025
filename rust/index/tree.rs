//! The M-DCI tree: tiers of cells, bulk build, incremental insert and delete.

use rayon::prelude::*;

use super::cells::{Cell, Tier, NONE};
use super::descent::Descent;
use super::rank::{insert_best, pack, unpack};
use super::{DciIndex, Metric, C_HEADROOM, FREE};
use crate::simd;

/// Members a build descent keeps in view at each tier above the target (its beam).
const BUILD_COVER: usize = 32;
/// The same for single inserts and removals. Half of it placed enough points in a cell other
/// than their nearest to cost grown indexes recall (clustered keys, d = 64).
const INSERT_COVER: usize = 32;
/// Nearest cells a new member chooses among, and a promoted point re-clusters with.
const STEAL_CELLS: usize = 4;
/// Fewest points at which inserts rebuild the tree (and a 32nd of it for the upper tiers):
/// below it, a tree is a handful of cells.
const REGROW_MIN: usize = 512;
/// Inserts rebuild the upper tiers when their points have grown by 1 / this.
const UPPER_REGROW: usize = 20;
/// Cells the build's refinement round chooses among for each point.
const REFINE_CHOICES: usize = 4;
/// Rows per task of the build's first pass over the keys (norms, projections, mean).
const PREP_ROWS: usize = 4096;
/// Most cells a tier may have for the build to score a chunk of points against all of them at
/// once (`upper_nearness`); larger tiers are scored point by point, only the cells met.
const DENSE_CELLS: usize = 256;
/// Points per task of the build's grouped scoring: enough to share tiles (each chosen cell
/// gets dozens), few enough that their keys stay in cache between descent and scoring.
const BUILD_CHUNK: usize = 512;
/// Fewest cells per task of the build's key sums (`push_members`): each task reads every
/// point's cell, and the keys of its own cells.
const SUM_CELLS: usize = 8;

/// What a point's nearness to any route needs.
#[derive(Clone, Copy)]
struct Terms {
    sq: f32,
    extra: f32,
    inv_c2: f32,
    ip: bool,
}

impl Terms {
    /// Minus the squared transformed distance to a route, from their dot product and the
    /// route's squared norm and mean extra (larger is nearer).
    #[inline(always)]
    fn nearness(self, dot: f32, route_sq: f32, route_extra: f32) -> f32 {
        let base = self.sq - 2.0 * dot + route_sq;
        if self.ip {
            let e = self.extra - route_extra;
            -(base * self.inv_c2 + e * e)
        } else {
            -base
        }
    }

    /// `nearness` in place over a row of dot products with routes whose squared norms and mean
    /// extras are `route_sq` and `route_extra` (in row order).
    #[inline(always)]
    fn nearness_row(self, dots: &mut [f32], route_sq: &[f32], route_extra: &[f32]) {
        for ((o, &sq), &extra) in dots.iter_mut().zip(route_sq).zip(route_extra) {
            *o = self.nearness(*o, sq, extra);
        }
    }
}

/// The cells one tier below a cell, with their routes laid out for `dot_cross_cols`.
struct Below {
    cells: Vec<u32>,
    /// By column (`simd::columns`), `stride` floats per dimension.
    routes: Vec<f32>,
    stride: usize,
    sq: Vec<f32>,
    extra: Vec<f32>,
}

/// Reusable buffers of one build task.
#[derive(Default)]
struct BuildScratch {
    descent: Descent,
    pairs: Vec<u64>,
    /// Per tier, `upper_nearness`'s matrix for the chunk.
    upper: Vec<Vec<f32>>,
    slots: Vec<u32>,
    dots: Vec<f32>,
}

impl DciIndex {
    // ---------------------------------------------------------------- cells

    fn new_cell(&mut self, t: usize, owner: u32) -> u32 {
        let d = self.cfg.dim;
        let tier = &mut self.tiers[t];
        let cell = Cell { live: true, owner, sum: vec![0.0; d], ..Cell::default() };
        let id = if let Some(id) = tier.free_cells.pop() {
            tier.cells[id as usize] = cell;
            id
        } else {
            tier.cells.push(cell);
            tier.routes.resize(tier.cells.len() * d, 0.0);
            tier.route_sq.push(0.0);
            tier.route_extra.push(0.0);
            (tier.cells.len() - 1) as u32
        };
        if owner != NONE {
            tier.owned_cell[owner as usize] = id;
        }
        id
    }

    fn free_cell(&mut self, t: usize, id: u32) {
        let tier = &mut self.tiers[t];
        debug_assert!(tier.cells[id as usize].members.is_empty());
        if tier.cells[id as usize].owner != NONE {
            tier.owned_cell[tier.cells[id as usize].owner as usize] = NONE;
        }
        tier.cells[id as usize] = Cell::default();
        tier.free_cells.push(id);
    }

    /// Adds `slot` to `cell` of tier `t`; `leaf` also writes its code and P-DCI entries.
    fn cell_push(&mut self, t: usize, cell: u32, slot: u32, leaf: bool) {
        let d = self.cfg.dim;
        let extra = self.extra(slot) as f64;
        let tier = &mut self.tiers[t];
        let c = &mut tier.cells[cell as usize];
        tier.member_cell[slot as usize] = cell;
        tier.member_pos[slot as usize] = c.members.len() as u32;
        c.members.push(slot);
        let key = &self.keys[slot as usize * d..(slot as usize + 1) * d];
        for (s, x) in c.sum.iter_mut().zip(key) {
            *s += *x as f64;
        }
        c.sum_extra += extra;
        tier.num_members += 1;
        if leaf {
            let mut code = vec![0i8; d];
            let scale = self.code_of(slot, &mut code);
            let c = &mut self.tiers[0].cells[cell as usize];
            c.codes.extend_from_slice(&code);
            c.scales.push(scale);
            if !c.sorted.is_empty() {
                for j in 0..self.cfg.num_dirs() {
                    let p = self.key_proj(slot, j);
                    let arr = &mut self.tiers[0].cells[cell as usize].sorted[j];
                    let at = arr.partition_point(|e| e.0 < p);
                    arr.insert(at, (p, slot));
                }
            } else if c.members.len() >= self.cfg.pdci_min_cell {
                let mut c = std::mem::take(&mut self.tiers[0].cells[cell as usize]);
                self.sort_projections(&mut c);
                self.tiers[0].cells[cell as usize] = c;
            }
        }
    }

    /// A leaf cell's P-DCI arrays: per direction, its members sorted by projection. Only cells
    /// of at least `pdci_min_cell` members keep them (smaller ones are scanned, never walked).
    fn sort_projections(&self, c: &mut Cell) {
        let mut packed = Vec::with_capacity(c.members.len());
        c.sorted = (0..self.cfg.num_dirs())
            .map(|j| {
                // Sorting plain integers is several times faster than float pairs.
                packed.clear();
                packed.extend(c.members.iter().map(|&m| pack(self.key_proj(m, j), m)));
                packed.sort_unstable();
                packed.iter().map(|&p| unpack(p)).collect()
            })
            .collect();
    }

    pub(super) fn cell_add(&mut self, t: usize, cell: u32, slot: u32) {
        self.cell_push(t, cell, slot, t == 0);
        self.update_route(t, cell);
    }

    pub(super) fn cell_remove(&mut self, t: usize, cell: u32, slot: u32) {
        let d = self.cfg.dim;
        let extra = self.extra(slot) as f64;
        let walked = t == 0 && !self.tiers[0].cells[cell as usize].sorted.is_empty();
        let projs: Vec<f32> =
            if walked { (0..self.cfg.num_dirs()).map(|j| self.key_proj(slot, j)).collect() } else { Vec::new() };
        let tier = &mut self.tiers[t];
        let pos = tier.member_pos[slot as usize] as usize;
        let c = &mut tier.cells[cell as usize];
        debug_assert_eq!(c.members[pos], slot);
        c.members.swap_remove(pos);
        if pos < c.members.len() {
            tier.member_pos[c.members[pos] as usize] = pos as u32;
        }
        tier.member_cell[slot as usize] = NONE;
        tier.member_pos[slot as usize] = NONE;
        tier.num_members -= 1;
        let key = &self.keys[slot as usize * d..(slot as usize + 1) * d];
        if c.members.is_empty() {
            c.sum.fill(0.0);
            c.sum_extra = 0.0;
        } else {
            for (s, x) in c.sum.iter_mut().zip(key) {
                *s -= *x as f64;
            }
            c.sum_extra -= extra;
        }
        if t == 0 {
            let last = c.scales.len() - 1;
            if pos != last {
                c.codes.copy_within(last * d..(last + 1) * d, pos * d);
            }
            c.codes.truncate(last * d);
            c.scales.swap_remove(pos);
            for (arr, p) in c.sorted.iter_mut().zip(projs) {
                let mut at = arr.partition_point(|e| e.0 < p);
                while arr[at].1 != slot {
                    at += 1;
                }
                arr.remove(at);
            }
            if c.members.len() < self.cfg.pdci_min_cell {
                c.sorted = Vec::new();
            }
        }
        self.update_route(t, cell);
    }

    fn update_route(&mut self, t: usize, cell: u32) {
        let d = self.cfg.dim;
        let tier = &mut self.tiers[t];
        let c = &tier.cells[cell as usize];
        let n = c.members.len().max(1) as f64;
        let route = &mut tier.routes[cell as usize * d..(cell as usize + 1) * d];
        for (r, s) in route.iter_mut().zip(&c.sum) {
            *r = (*s / n) as f32;
        }
        tier.route_sq[cell as usize] = simd::dot(route, route);
        tier.route_extra[cell as usize] = (c.sum_extra / n) as f32;
    }

    /// Routes of every cell of tier `t`, from their sums.
    fn update_routes(&mut self, t: usize) {
        for c in 0..self.tiers[t].cells.len() as u32 {
            self.update_route(t, c);
        }
    }

    /// Every live cell's sums and route from its members (a loaded file's sums are not trusted:
    /// every later route derives from them).
    pub(super) fn recompute_sums(&mut self) {
        let d = self.cfg.dim;
        for t in 0..self.tiers.len() {
            for cell in 0..self.tiers[t].cells.len() {
                let c = &self.tiers[t].cells[cell];
                if !c.live {
                    continue;
                }
                let mut sum = vec![0f64; d];
                let mut extra = 0f64;
                for &m in &c.members {
                    sum.iter_mut().zip(self.key(m)).for_each(|(s, &x)| *s += x as f64);
                    extra += self.extra(m) as f64;
                }
                let c = &mut self.tiers[t].cells[cell];
                c.sum = sum;
                c.sum_extra = extra;
                self.update_route(t, cell as u32);
            }
        }
    }

    /// Codes and P-DCI arrays of every tier-0 cell, from scratch (after a build or a change of `c`).
    fn reindex_leaves(&mut self) {
        let d = self.cfg.dim;
        // Codes in slot order first (the keys stream), then copied in member order (a code is a
        // quarter of a key): cheaper than reading the keys themselves in member order.
        let slots = self.level.len();
        let mut codes = vec![0i8; slots * d];
        let mut scales = vec![0f32; slots];
        codes.par_chunks_mut(PREP_ROWS * d).zip(scales.par_chunks_mut(PREP_ROWS)).enumerate().for_each(
            |(i, (codes, scales))| {
                for (j, (code, scale)) in codes.chunks_exact_mut(d).zip(scales).enumerate() {
                    let slot = i * PREP_ROWS + j;
                    if self.level[slot] != FREE {
                        *scale = self.code_of(slot as u32, code);
                    }
                }
            },
        );
        let mut cells = std::mem::take(&mut self.tiers[0].cells);
        let this = &*self;
        cells.par_iter_mut().filter(|c| c.live).for_each(|c| {
            c.codes.clear();
            c.codes.reserve_exact(c.members.len() * d);
            for &m in &c.members {
                c.codes.extend_from_slice(&codes[m as usize * d..(m as usize + 1) * d]);
            }
            c.scales.clear();
            c.scales.extend(c.members.iter().map(|&m| scales[m as usize]));
            if c.members.len() >= this.cfg.pdci_min_cell {
                this.sort_projections(c);
            } else {
                c.sorted = Vec::new();
            }
        });
        self.tiers[0].cells = cells;
    }

    /// Recomputes everything that depends on `c` (called when `c` grows).
    fn refresh_transform(&mut self) {
        if self.cfg.metric != Metric::InnerProduct {
            return;
        }
        for t in 0..self.tiers.len() {
            for cell in 0..self.tiers[t].cells.len() as u32 {
                if !self.tiers[t].cells[cell as usize].live {
                    continue;
                }
                let s: f64 = self.tiers[t].cells[cell as usize].members.iter().map(|&m| self.extra(m) as f64).sum();
                self.tiers[t].cells[cell as usize].sum_extra = s;
                self.update_route(t, cell);
            }
        }
        if !self.tiers.is_empty() {
            self.reindex_leaves();
        }
    }

    // ---------------------------------------------------------------- distances

    /// Scores of tier-`t` cells for point `slot`: `out[i]` = minus the squared transformed
    /// distance to the route of `cells[i]` (larger is nearer). The point's terms are computed
    /// once; the dot products run in blocks.
    fn route_nearness(&self, slot: u32) -> impl Fn(usize, &[u32], &mut [f32]) + '_ {
        let key = self.key(slot);
        let terms = self.terms(slot);
        move |t, cells, out| {
            let tier = &self.tiers[t];
            simd::dot_gather(key, &tier.routes, cells, out);
            for (o, &c) in out.iter_mut().zip(cells) {
                *o = terms.nearness(*o, tier.route_sq[c as usize], tier.route_extra[c as usize]);
            }
        }
    }

    fn terms(&self, slot: u32) -> Terms {
        Terms {
            sq: self.sq_norms[slot as usize],
            extra: self.extra(slot),
            inv_c2: if self.c > 0.0 { 1.0 / (self.c * self.c) } else { 0.0 },
            ip: self.cfg.metric == Metric::InnerProduct,
        }
    }

    /// Squared transformed distance between two points.
    fn point_dist(&self, a: u32, b: u32) -> f32 {
        let base = simd::sq_dist(self.key(a), self.key(b));
        match self.cfg.metric {
            Metric::L2 => base,
            Metric::InnerProduct => {
                let e = self.extra(a) - self.extra(b);
                base / (self.c * self.c) + e * e
            }
        }
    }

    // ---------------------------------------------------------------- nearest cells

    /// The `want` tier-`t` cells whose routes are nearest to point `slot`, nearest first.
    fn near_cells<'b>(&self, t: usize, slot: u32, want: usize, cover: usize, buf: &'b mut Descent) -> &'b [(f32, u32)] {
        self.descend(t, |_| cover, self.route_nearness(slot), buf);
        // `want` is tiny: one insertion pass keeps the best in order, cheaper than a selection.
        let cand = &mut buf.cand;
        let keep = want.min(cand.len());
        cand[..keep].sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        for i in keep..cand.len() {
            let x = cand[i];
            insert_best(&mut cand[..keep], x);
        }
        cand.truncate(keep);
        cand
    }

    /// `near_cells(t, x, REFINE_CHOICES, BUILD_COVER)` for each of `points` (`t` below the top),
    /// the same cells up to ties. Each point descends alone to the tier-`t + 1` cells it
    /// chooses; then, a chunk of points at a time, the points that chose a cell are scored
    /// together against the cells below it, in tiles that load each route once for many points
    /// (one point at a time, every point reloads each of its candidate routes).
    fn build_near(&self, t: usize, points: &[u32]) -> Vec<[u32; REFINE_CHOICES]> {
        let d = self.cfg.dim;
        let below: Vec<Below> = (0..self.tiers[t + 1].cells.len() as u32)
            .map(|c| {
                let cells: Vec<u32> = self.cells_below(t + 1, c).collect();
                let tier = &self.tiers[t];
                let routes: Vec<f32> = cells.iter().flat_map(|&b| tier.route(b, d)).copied().collect();
                let (routes, stride) = simd::columns(&routes, d);
                Below {
                    routes,
                    stride,
                    sq: cells.iter().map(|&b| tier.route_sq[b as usize]).collect(),
                    extra: cells.iter().map(|&b| tier.route_extra[b as usize]).collect(),
                    cells,
                }
            })
            .collect();
        let chunks: Vec<Vec<[u32; REFINE_CHOICES]>> = points
            .par_chunks(BUILD_CHUNK)
            .map_init(BuildScratch::default, |s, xs| {
                // (chosen cell, point) pairs, sorted: a cell's points in a run, in point order.
                self.upper_nearness(t, xs, &mut s.upper);
                s.pairs.clear();
                for (i, &x) in xs.iter().enumerate() {
                    let near = self.route_nearness(x);
                    let upper = &s.upper;
                    let score = |u: usize, cells: &[u32], out: &mut [f32]| {
                        let m = &upper[u];
                        if m.is_empty() {
                            near(u, cells, out);
                        } else {
                            let row = &m[i * self.tiers[u].cells.len()..];
                            for (o, &c) in out.iter_mut().zip(cells) {
                                *o = row[c as usize];
                            }
                        }
                    };
                    self.choose(t, &|_| BUILD_COVER, &score, &mut s.descent);
                    s.pairs.extend(s.descent.chosen.iter().map(|&c| (c as u64) << 32 | i as u64));
                }
                s.pairs.sort_unstable();
                let mut best = vec![[(f32::NEG_INFINITY, NONE); REFINE_CHOICES]; xs.len()];
                for run in s.pairs.chunk_by(|a, b| a >> 32 == b >> 32) {
                    let b = &below[(run[0] >> 32) as usize];
                    let nb = b.cells.len();
                    if nb == 0 {
                        continue;
                    }
                    s.slots.clear();
                    s.slots.extend(run.iter().map(|&p| xs[p as u32 as usize]));
                    s.dots.resize(s.slots.len() * nb, 0.0);
                    simd::dot_cross_cols(d, &self.keys, &s.slots, &b.routes, b.stride, nb, &mut s.dots);
                    for ((&p, &x), row) in run.iter().zip(&s.slots).zip(s.dots.chunks_exact_mut(nb)) {
                        self.terms(x).nearness_row(row, &b.sq, &b.extra);
                        let best = &mut best[p as u32 as usize];
                        for (&score, &c) in row.iter().zip(&b.cells) {
                            insert_best(best, (score, c));
                        }
                    }
                }
                best.iter().map(|b| b.map(|(_, c)| c)).collect()
            })
            .collect();
        chunks.concat()
    }

    /// For `build_near`: the nearness of each of `xs` to every cell of each tier that `choose`
    /// scores (above `t + 1`, below the top), as a `[xs, cells]` matrix per tier, when the tier
    /// has at most `DENSE_CELLS` cells (else left empty: points score their candidates alone).
    /// Upper tiers are small, and one tiled product for a chunk of points costs less than each
    /// point gathering the routes it meets on the way down.
    fn upper_nearness(&self, t: usize, xs: &[u32], upper: &mut Vec<Vec<f32>>) {
        let d = self.cfg.dim;
        upper.resize_with(self.tiers.len(), Vec::new);
        for (u, m) in upper.iter_mut().enumerate() {
            m.clear();
            let tier = &self.tiers[u];
            let nc = tier.cells.len();
            if u <= t || u + 1 >= self.tiers.len() || nc > DENSE_CELLS {
                continue;
            }
            m.resize(xs.len() * nc, 0.0);
            simd::dot_cross(d, &self.keys, xs, &tier.routes, m);
            for (row, &x) in m.chunks_exact_mut(nc).zip(xs) {
                self.terms(x).nearness_row(row, &tier.route_sq, &tier.route_extra);
            }
        }
    }

    /// The tier-`t` cell a new member `x` joins: of the cells nearest to it, the one whose
    /// owner is nearest (cells stay the regions of their owners, as a build makes them, so
    /// that a descent that reaches the owner reaches the members).
    fn parent_cell(&self, t: usize, x: u32, buf: &mut Descent) -> u32 {
        let near = self.near_cells(t, x, STEAL_CELLS, INSERT_COVER, buf);
        let owner = |c: u32| self.tiers[t].cells[c as usize].owner;
        near.iter()
            .map(|&(_, c)| (self.point_dist(x, owner(c)), c))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map_or(NONE, |b| b.1)
    }

    fn nearest_cell(&self, t: usize, slot: u32, cover: usize, buf: &mut Descent) -> u32 {
        self.descend(t, |_| cover, self.route_nearness(slot), buf);
        buf.cand.iter().max_by(|a, b| a.0.total_cmp(&b.0)).map(|x| x.1).unwrap_or(NONE)
    }

    // ---------------------------------------------------------------- build

    /// Bulk build over `keys` (`[n, dim]`, which the index keeps, with whatever room they
    /// have for inserts) into an empty index;
    /// parallel where it pays.
    pub(super) fn build(&mut self, keys: Vec<f32>, ids: &[i64]) {
        let d = self.cfg.dim;
        let nd = self.cfg.num_dirs();
        let n = ids.len();
        self.keys = keys;
        let keys = &self.keys[..];
        // The directions without their extra component, contiguous, for blocked dot products.
        let dirs: Vec<f32> = self.dirs.chunks_exact(d + 1).flat_map(|u| &u[..d]).copied().collect();
        // Squared norms, projections and the mean in one pass over the keys, a block of rows at
        // a time (each block's sum apart, added in block order: the same mean on any thread count).
        let mut sq_norms = vec![0f32; n];
        let mut proj = vec![0f32; n * nd];
        let sums: Vec<Vec<f64>> = sq_norms
            .par_chunks_mut(PREP_ROWS)
            .zip(proj.par_chunks_mut(PREP_ROWS * nd))
            .zip(keys.par_chunks(PREP_ROWS * d))
            .map(|((sq, p), rows)| {
                let mut sum = vec![0f64; d];
                for ((s, p), k) in sq.iter_mut().zip(p.chunks_exact_mut(nd)).zip(rows.chunks_exact(d)) {
                    *s = simd::dot(k, k);
                    simd::dot_rows(k, &dirs, p);
                    simd::add_widened(&mut sum, k);
                }
                sum
            })
            .collect();
        let mut total = vec![0f64; d];
        for s in &sums {
            total.iter_mut().zip(s).for_each(|(t, x)| *t += x);
        }
        self.code_center = total.iter().map(|&s| (s / n as f64) as f32).collect();
        self.sq_norms = sq_norms;
        self.proj = proj;
        self.ids = ids.to_vec();
        self.id_map = ids.iter().enumerate().map(|(s, &id)| (id, s as u32)).collect();
        self.free_slots.clear();
        self.len = n;
        if self.cfg.metric == Metric::InnerProduct {
            let max_sq = self.sq_norms.iter().fold(0f32, |m, &x| m.max(x));
            // Headroom from the start: keys a little larger than the built ones (common in
            // decode) then leave `c` alone.
            self.c = if max_sq > 0.0 { max_sq.sqrt() * C_HEADROOM } else { 1.0 };
        }
        self.level = (0..n).map(|_| self.draw_level() as u8).collect();
        let top = *self.level.iter().max().unwrap() as usize;
        self.tiers = (0..=top).map(|_| Tier::new(n)).collect();

        self.root = self.new_cell(top, NONE);
        for s in 0..n as u32 {
            if self.level[s as usize] as usize == top {
                self.cell_push(top, self.root, s, false);
            }
        }
        self.update_route(top, self.root);

        for t in (0..top).rev() {
            let owners: Vec<u32> = (0..n as u32).filter(|&s| self.level[s as usize] as usize > t).collect();
            for &o in &owners {
                let c = self.new_cell(t, o);
                self.cell_push(t, c, o, false);
                self.update_route(t, c);
            }
            self.assign_tier(t);
        }
        self.built = n;
        self.upper_built = self.upper_points();
        for (s, &l) in self.level.iter().enumerate() {
            debug_assert!(self.tiers[..=l as usize].iter().all(|t| t.member_cell[s] != NONE));
        }
        self.reindex_leaves();
    }

    /// Assigns the points of level `t` to the tier-`t` cells, which hold their owners only (the
    /// tiers above are complete): to the nearest owner, then once more to the nearest centroid
    /// (one Lloyd step: tighter cells, so fewer of them cover a query's neighbours). The second
    /// round only compares the few cells the first one found nearest.
    fn assign_tier(&mut self, t: usize) {
        let others: Vec<u32> = (0..self.level.len() as u32).filter(|&s| self.level[s as usize] as usize == t).collect();
        let near = self.build_near(t, &others);
        let first: Vec<u32> = near.iter().map(|cs| cs[0]).collect();
        self.push_members(t, &others, &first);
        self.update_routes(t);
        let this = &*self;
        let refined: Vec<u32> = others
            .par_iter()
            .zip(&near)
            .map(|(&x, cs)| {
                let cs = &cs[..cs.iter().position(|&c| c == NONE).unwrap_or(REFINE_CHOICES)];
                let mut score = [0f32; REFINE_CHOICES];
                this.route_nearness(x)(t, cs, &mut score[..cs.len()]);
                // The first of the nearest, as the round before ranked them.
                let best = (1..cs.len()).fold(0, |b, i| if score[i] > score[b] { i } else { b });
                cs[best]
            })
            .collect();
        self.reset_tier_to_owners(t);
        self.push_members(t, &others, &refined);
        self.update_routes(t);
    }

    /// `cell_push(t, cells[i], points[i], false)` for each `i` in order (routes not updated), in
    /// bulk: the points grouped by cell with a counting sort, then each cell's members extended
    /// at once. The key sums read the keys in point order (a cell's members read cell by cell
    /// are scattered over the keys, and each read waited on memory), a range of cells per task:
    /// every cell's sum adds its points in the same order as before, so to the same bits.
    fn push_members(&mut self, t: usize, points: &[u32], cells: &[u32]) {
        let num_cells = self.tiers[t].cells.len();
        let mut start = vec![0usize; num_cells + 1];
        for &c in cells {
            start[c as usize + 1] += 1;
        }
        for i in 0..num_cells {
            start[i + 1] += start[i];
        }
        let mut grouped = vec![0u32; points.len()];
        let mut next = start.clone();
        for (&x, &c) in points.iter().zip(cells) {
            grouped[next[c as usize]] = x;
            next[c as usize] += 1;
        }
        let mut tier_cells = std::mem::take(&mut self.tiers[t].cells);
        let this = &*self;
        let per_task = num_cells.div_ceil(rayon::current_num_threads()).max(SUM_CELLS);
        tier_cells.par_chunks_mut(per_task).enumerate().for_each(|(i, part)| {
            let lo = i * per_task;
            for (&x, &c) in points.iter().zip(cells) {
                if let Some(cell) = (c as usize).checked_sub(lo).and_then(|c| part.get_mut(c)) {
                    simd::add_widened(&mut cell.sum, this.key(x));
                    cell.sum_extra += this.extra(x) as f64;
                }
            }
            for (c, cell) in (lo..).zip(part.iter_mut()) {
                cell.members.extend_from_slice(&grouped[start[c]..start[c + 1]]);
            }
        });
        let tier = &mut self.tiers[t];
        for (c, cell) in tier_cells.iter().enumerate() {
            let group = &grouped[start[c]..start[c + 1]];
            let first = cell.members.len() - group.len();
            for (i, &x) in group.iter().enumerate() {
                tier.member_cell[x as usize] = c as u32;
                tier.member_pos[x as usize] = (first + i) as u32;
            }
        }
        tier.num_members += points.len();
        tier.cells = tier_cells;
    }

    /// Rebuilds tiers `lowest..top` as a bulk build makes them, top-down, with every point
    /// keeping its level (so every cell its owner): each tier is emptied to its owners and its
    /// other points assigned again.
    pub(super) fn rebuild_tiers(&mut self, lowest: usize) {
        let top = self.tiers.len() - 1;
        for t in (lowest..top).rev() {
            self.reset_tier_to_owners(t);
            self.update_routes(t);
            self.assign_tier(t);
        }
        if lowest == 0 {
            self.code_center = self.live_mean();
            self.reindex_leaves();
            self.built = self.len;
        }
        self.upper_built = self.upper_points();
    }

    /// Mean of the keys in the index.
    fn live_mean(&self) -> Vec<f32> {
        let d = self.cfg.dim;
        let mut sum = vec![0f64; d];
        for (k, _) in self.keys.chunks_exact(d).zip(&self.level).filter(|(_, &l)| l != FREE) {
            sum.iter_mut().zip(k).for_each(|(s, &x)| *s += x as f64);
        }
        sum.into_iter().map(|s| (s / self.len.max(1) as f64) as f32).collect()
    }

    /// Empties every tier-`t` cell down to its owner (used between build rounds).
    fn reset_tier_to_owners(&mut self, t: usize) {
        let d = self.cfg.dim;
        for cell in 0..self.tiers[t].cells.len() {
            if !self.tiers[t].cells[cell].live {
                continue;
            }
            let owner = self.tiers[t].cells[cell].owner;
            let extra = self.extra(owner) as f64;
            let key: Vec<f64> = self.key(owner).iter().map(|&x| x as f64).collect();
            let tier = &mut self.tiers[t];
            for &m in &tier.cells[cell].members {
                tier.member_cell[m as usize] = NONE;
                tier.member_pos[m as usize] = NONE;
            }
            tier.num_members -= tier.cells[cell].members.len() - 1;
            let c = &mut tier.cells[cell];
            c.members.clear();
            c.members.push(owner);
            c.sum.copy_from_slice(&key);
            c.sum_extra = extra;
            tier.member_cell[owner as usize] = cell as u32;
            tier.member_pos[owner as usize] = 0;
            debug_assert_eq!(key.len(), d);
        }
    }

    // ---------------------------------------------------------------- insert

    /// Inserts one key: draws its level, attaches it to the nearest parent, and, if promoted,
    /// gives it its own cells that take over nearby members now closer to it.
    pub(super) fn insert(&mut self, key: &[f32], id: i64) {
        if self.cfg.metric == Metric::InnerProduct {
            let norm = simd::dot(key, key).sqrt();
            if norm > self.c {
                self.c = norm * C_HEADROOM;
                self.refresh_transform();
            }
        }
        let slot = self.alloc_slot(key, id);
        let drawn = self.draw_level();
        self.place(slot, drawn);
        self.regrow();
    }

    /// Inserts place points one at a time, each in a tree shaped by the points before it; a
    /// build sees them all, and an index grown from a few points would drift far from what a
    /// build makes. So the tree is rebuilt (levels kept, random promotion as drawn) when it
    /// has doubled since it was last built, and the small upper tiers, which drift fastest,
    /// whenever their points have grown by 1 / `UPPER_REGROW`. Both cost a constant share of
    /// the inserts' work: the rebuilds form a geometric series.
    fn regrow(&mut self) {
        if self.len >= (2 * self.built).max(REGROW_MIN) {
            self.rebuild_tiers(0);
        } else if self.upper_points() >= (self.upper_built + self.upper_built / UPPER_REGROW).max(REGROW_MIN / 32) {
            self.rebuild_tiers(1);
        }
    }

    /// Points of level >= 1 (the members of tier 1).
    pub(super) fn upper_points(&self) -> usize {
        self.tiers.get(1).map_or(0, |t| t.num_members)
    }

    fn place(&mut self, x: u32, drawn: usize) {
        let mut buf = Descent::default();
        if self.tiers.is_empty() {
            self.tiers.push(Tier::new(self.level.len()));
            self.root = self.new_cell(0, NONE);
            self.level[x as usize] = 0;
            self.cell_add(0, self.root, x);
            return;
        }
        let top = self.tiers.len() - 1;
        // At most one new level per insert: a new top tier whose root holds only `x`.
        let lam = drawn.min(top + 1);
        self.level[x as usize] = lam as u8;
        if lam > top {
            self.tiers.push(Tier::new(self.level.len()));
            let old_root = self.root;
            self.root = self.new_cell(lam, NONE);
            self.cell_add(lam, self.root, x);
            self.tiers[top].cells[old_root as usize].owner = x;
            self.tiers[top].owned_cell[x as usize] = old_root;
            self.cell_add(top, old_root, x);
            for t in (0..top).rev() {
                self.open_cell(t, x, &mut buf);
            }
        } else {
            let parent = if lam == top { self.root } else { self.parent_cell(lam, x, &mut buf) };
            self.cell_add(lam, parent, x);
            for t in (0..lam).rev() {
                self.open_cell(t, x, &mut buf);
            }
        }
    }

    /// Gives `x` its own tier-`t` cell and re-clusters its neighbourhood as a bulk build would:
    /// the members of the nearest cells go to their nearest owner among those cells and `x`,
    /// then to the nearest centroid of that assignment (one Lloyd step). A new cell then takes
    /// its share of the region (stealing only members nearer to `x` than to their centroid,
    /// as before, left most new cells with `x` alone: a centroid is nearer than any one point).
    fn open_cell(&mut self, t: usize, x: u32, buf: &mut Descent) {
        let mut cells = [NONE; STEAL_CELLS + 1];
        for (n, &(_, c)) in cells[1..].iter_mut().zip(self.near_cells(t, x, STEAL_CELLS, INSERT_COVER, buf)) {
            *n = c;
        }
        let own = self.new_cell(t, x);
        self.cell_add(t, own, x);
        cells[0] = own;
        let k = 1 + cells[1..].iter().take_while(|&&c| c != NONE).count();
        let cells = &cells[..k];
        let owners: Vec<u32> = cells.iter().map(|&c| self.tiers[t].cells[c as usize].owner).collect();
        let tier = &self.tiers[t];
        let movers: Vec<(u32, usize)> = cells[1..]
            .iter()
            .enumerate()
            .flat_map(|(i, &c)| {
                let c = &tier.cells[c as usize];
                c.members.iter().filter(move |&&m| m != c.owner).map(move |&m| (m, i + 1))
            })
            .collect();
        if movers.is_empty() {
            return;
        }
        // Nearest owner, then the centroids of that assignment (owners included).
        let d = self.cfg.dim;
        let nearest_owner = |m: u32| {
            (0..k).map(|i| (self.point_dist(m, owners[i]), i)).min_by(|a, b| a.0.total_cmp(&b.0)).map_or(0, |b| b.1)
        };
        let first: Vec<usize> = movers.iter().map(|&(m, _)| nearest_owner(m)).collect();
        let mut sums = vec![0f64; k * d];
        let mut extras = vec![0f64; k];
        let mut counts = vec![0usize; k];
        let mut add = |i: usize, m: u32| {
            sums[i * d..(i + 1) * d].iter_mut().zip(self.key(m)).for_each(|(s, &v)| *s += v as f64);
            extras[i] += self.extra(m) as f64;
            counts[i] += 1;
        };
        for (i, &o) in owners.iter().enumerate() {
            add(i, o);
        }
        for (&(m, _), &i) in movers.iter().zip(&first) {
            add(i, m);
        }
        let means: Vec<f32> = (0..k * d).map(|j| (sums[j] / counts[j / d] as f64) as f32).collect();
        let mean_sq: Vec<f32> = means.chunks_exact(d).map(|r| simd::dot(r, r)).collect();
        let mean_extra: Vec<f32> = (0..k).map(|i| (extras[i] / counts[i] as f64) as f32).collect();
        let mut dots = vec![0f32; k];
        for (m, from) in movers {
            simd::dot_rows(self.key(m), &means, &mut dots);
            let terms = self.terms(m);
            let to = (0..k)
                .map(|i| (terms.nearness(dots[i], mean_sq[i], mean_extra[i]), i))
                .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)))
                .map_or(from, |b| b.1);
            if to != from {
                self.cell_remove(t, cells[from], m);
                self.cell_push(t, cells[to], m, t == 0);
            }
        }
        for &c in cells {
            self.update_route(t, c);
        }
    }

    // ---------------------------------------------------------------- delete

    /// Removes slot `x` from the tree; members of cells it owned move to their nearest cells.
    pub(super) fn delete(&mut self, x: u32) {
        let mut buf = Descent::default();
        let mut lam = self.level[x as usize] as usize;
        // While `x` is the root's only member, the tier below becomes the top.
        while self.tiers.len() > 1
            && lam == self.tiers.len() - 1
            && self.tiers[lam].cells[self.root as usize].members == [x]
        {
            let below = self.tiers[lam - 1].owned_cell[x as usize];
            self.tiers.pop();
            self.tiers[lam - 1].owned_cell[x as usize] = NONE;
            self.tiers[lam - 1].cells[below as usize].owner = NONE;
            self.root = below;
            lam -= 1;
        }
        let owned: Vec<(usize, u32)> = (0..lam).map(|t| (t, self.tiers[t].owned_cell[x as usize])).collect();
        for t in 0..=lam {
            let c = self.tiers[t].member_cell[x as usize];
            self.cell_remove(t, c, x);
        }
        for &(t, c) in &owned {
            self.tiers[t].owned_cell[x as usize] = NONE;
            self.tiers[t].cells[c as usize].owner = NONE;
        }
        // Orphaned cells are unreachable now; re-home their members top-down so every tier
        // below is complete again when its turn comes.
        for &(t, c) in owned.iter().rev() {
            let members = self.tiers[t].cells[c as usize].members.clone();
            for m in members {
                self.cell_remove(t, c, m);
                let nc = self.nearest_cell(t, m, INSERT_COVER, &mut buf);
                self.cell_add(t, nc, m);
            }
            self.free_cell(t, c);
        }
        self.level[x as usize] = FREE;
        self.id_map.remove(&self.ids[x as usize]);
        self.free_slots.push(x);
        self.len -= 1;
        if self.len == 0 {
            self.tiers.clear();
            self.root = NONE;
        }
    }
}
