//! One KV head's semantic pages and the tree that ranks them (docs/ARCHITECTURE.md, section
//! Pages).
//!
//! A head keeps each key once: as the int8 K row of its page, in the caller's 8-bit K store or,
//! when the stores hold 16-bit rows, in a code store of its own (`own`). Everything else is
//! small:
//! - **leaf cells**: sets of whole pages. A bulk build makes them as the leaf cells of an M-DCI
//!   tree over the keys, refined by a few k-means steps (`cells`), each cut into pages;
//!   decode-time keys join the cell nearest them;
//! - **the tree**: an M-DCI index ([`DciIndex`]) over the cells, cell `i` its point `i`, at
//!   the mean of its keys in `T_K` space: `[r / c, e]` with `r` the keys' centroid and `e` their
//!   mean extra coordinate `sqrt(1 - |k|² / c²)`. A query `[q, 0]` ranks cells by `q · r`; a new
//!   key asks with `T_K(k)` for the cells nearest it;
//! - per page its token positions and cell, per position its page.
//!
//! A cell's point moves when its keys have grown by an eighth since it was placed (recomputed
//! from the codes), a cell that grows past `CELL_SPLIT` times the build's mean splits its pages
//! in two, and a larger `c` recomputes every point: so the tree follows inserts without a
//! float32 copy of any key.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;

use super::cells::{refine_cells, REFINE_STEPS};
use super::int8::{self, PageCodes};
use super::split::{split_pages, SplitScratch};
use super::{Elem, Format, Store};
use crate::error::Result;
use crate::index::{field_of_view, Config, DciIndex, Scratch, C_HEADROOM};
use crate::input::KeyData;
use crate::simd::{self, QueryI8};

/// Cells a new key chooses among (the tree's best for `T_K(k)`); it joins the nearest.
const JOIN_CHOICES: usize = 4;
/// A cell's point is placed again when its keys have grown by 1 / this since.
const REPLACE_SHARE: usize = 8;
/// A cell whose keys outgrow this many times the build's mean cell splits in two: on SmolLM2
/// forests grown by inserts, larger cells (2, 3, 4 times) lost attention recall that this
/// keeps (benches/RESULTS.md, section "Each key once").
const CELL_SPLIT: f32 = 1.5;
/// An unused page slot.
const EMPTY: u32 = u32::MAX;

/// A leaf cell: whole pages of keys near one another.
pub(crate) struct Cell {
    pub pages: Vec<u32>,
    /// Keys in its pages.
    pub len: usize,
    /// Keys when its point was last placed in the tree.
    placed: usize,
}

/// The pages of one KV head and the tree that ranks them. See the module docs.
pub(crate) struct HeadPages {
    tree: DciIndex,
    pub cells: Vec<Cell>,
    /// Token positions of page `p`: `slots[p * page_size..][..page_len[p]]`.
    slots: Vec<u32>,
    page_len: Vec<u8>,
    page_cell: Vec<u32>,
    /// The page of each token position.
    token_page: Vec<u32>,
    page_size: usize,
    dim: usize,
    /// The transform's `c >= max |k|`.
    bound: f32,
    /// Cells of more keys than this split.
    split_at: usize,
    /// P(a new key opens a cell of its own): the first promotion ratio, as in a build.
    promotion: f64,
    /// The default search effort (the configured one, or a calibration's).
    pub effort: f32,
    rng: Xoshiro256PlusPlus,
    /// The int8 K rows in page layout, when the caller's stores do not hold them.
    pub own: Option<Vec<u8>>,
}

/// A cell's point in the tree, from its keys: `[r / c, e]` (module docs), summed in f64.
struct PointSum {
    sum: Vec<f64>,
    extra: f64,
    n: usize,
}

impl PointSum {
    fn new(dim: usize) -> PointSum {
        PointSum { sum: vec![0.0; dim], extra: 0.0, n: 0 }
    }

    fn add(&mut self, key: &[f32], bound: f32) {
        simd::add_widened(&mut self.sum, key);
        self.extra += extra(simd::dot(key, key), bound) as f64;
        self.n += 1;
    }

    /// Writes the point (`dim + 1` floats) into `out`.
    fn point(&self, bound: f32, out: &mut [f32]) {
        let n = self.n.max(1) as f64;
        for (o, s) in out.iter_mut().zip(&self.sum) {
            *o = (s / n / bound as f64) as f32;
        }
        out[self.sum.len()] = (self.extra / n) as f32;
    }
}

/// A head's int8 K rows: its own (16-bit stores), else the 8-bit K store's.
fn rows_in<'a>(own: Option<&'a [u8]>, store: Option<&'a [u8]>, page_size: usize, dim: usize) -> PageCodes<'a> {
    let bytes = own.or(store).expect("a head without its own rows has an 8-bit K store");
    PageCodes { bytes, page_size, dim }
}

/// `rows_in` for a head being changed (its own rows taken out of it meanwhile).
fn store_codes<'a, T: Elem, K: Format<T>, V: Format<T>>(
    own: &'a Option<Vec<u8>>,
    store: &'a Store<'_, T, K, V>,
) -> PageCodes<'a> {
    rows_in(own.as_deref(), K::codes(store.k), store.s, store.d)
}

/// `sqrt(1 - |k|² / c²)`, the coordinate that lifts a key onto the unit sphere.
fn extra(sq_norm: f32, bound: f32) -> f32 {
    (1.0 - sq_norm / (bound * bound)).max(0.0).sqrt()
}

/// The tree's configuration for a forest configured as `cfg`: over points of `dim + 1`, with the
/// promotion ratios above the leaves (a cell's point is a leaf cell's owner one tier up).
fn tree_config(cfg: &Config) -> Config {
    let mut t = cfg.clone();
    t.dim = cfg.dim + 1;
    t.promotion = cfg.promotion.get(1..).unwrap_or_default().to_vec();
    t.effort = 1.0;
    t.seed = cfg.seed.map(|s| s ^ 0x7ee5_7ee5_7ee5_7ee5);
    t
}

/// Fewer part-filled pages: a cell's part-filled last page (a split leaves at most one) that
/// holds at most half a page moves whole into the part-filled last page of the nearest cell,
/// among `2 * JOIN_CHOICES` near its centroid (`near`'s points are the cells'), that has room
/// for it; smallest first, and a cell that received gives nothing. A cell keeps at least one
/// page. `split`: per cell its pages' tokens, the part-filled page last. On SmolLM2's keys a
/// build's pages then hold 97.8% of their slots instead of 93.2%, and attention recall moved
/// by +0.000..+0.001 (benches/RESULTS.md): less memory, and more attention per charged slot.
fn fill_tails<'k>(
    split: &mut [Vec<Vec<u32>>],
    near: &DciIndex,
    key: &impl Fn(u32) -> &'k [f32],
    d: usize,
    page_size: usize,
    bound: f32,
) {
    let mut donors: Vec<(usize, usize)> = split
        .iter()
        .enumerate()
        .filter(|(_, g)| g.len() > 1 && g.last().is_some_and(|t| t.len() <= page_size / 2))
        .map(|(c, g)| (g.last().map_or(0, |t| t.len()), c))
        .collect();
    donors.sort_unstable();
    let mut received = vec![false; split.len()];
    let (mut s, mut found) = (Scratch::default(), Vec::new());
    let mut tk = vec![0f32; d + 1];
    for (r, c) in donors {
        if received[c] {
            continue;
        }
        let mut sum = PointSum::new(d);
        split[c].last().into_iter().flatten().for_each(|&t| sum.add(key(t), bound));
        sum.point(bound, &mut tk);
        found.clear();
        near.search_into(&tk, (2 * JOIN_CHOICES).min(near.len()), 1.0, &mut s, &mut found);
        let mut best: Option<(f32, usize)> = None;
        for &(cand, _) in &found {
            let cand = cand as usize;
            let room = split[cand].last().map_or(0, |t| page_size - t.len());
            if cand != c && room >= r {
                let dist = simd::sq_dist(&tk, near.key_of_id(cand as i64));
                if best.is_none_or(|(b, _)| dist < b) {
                    best = Some((dist, cand));
                }
            }
        }
        if let Some((_, to)) = best {
            let tail = split[c].pop().expect("a donor has a part-filled page");
            split[to].last_mut().expect("a receiver has a part-filled page").extend(tail);
            received[to] = true;
        }
    }
}

impl HeadPages {
    /// Builds a head over `keys` (`[n, dim]`, positions `0..n`); `own`: keep the int8 K rows
    /// (the stores will hold 16-bit rows). The build's tree over the keys exists only here.
    pub fn build(keys: Vec<f32>, cfg: &Config, page_size: usize, own: bool) -> Result<HeadPages> {
        let d = cfg.dim;
        let n = keys.len() / d;
        let tree = DciIndex::new(tree_config(cfg))?;
        let mut index = DciIndex::new(cfg.clone())?;
        index.build_positions(keys);
        let keys = index.built_keys();
        let key = |t: u32| &keys[t as usize * d..(t as usize + 1) * d];
        // After `build_positions` a slot is its position.
        let mut leaves: Vec<Vec<u32>> = index.leaf_cells().map(|(_, members)| members.to_vec()).collect();
        refine_cells(&mut leaves, &key, d, REFINE_STEPS)?;
        let mut split: Vec<Vec<Vec<u32>>> = leaves
            .par_iter()
            .map_init(SplitScratch::default, |scratch, members| {
                let mut tokens = members.clone();
                let (mut groups, mut sums) = (Vec::new(), Vec::new());
                split_pages(&mut tokens, &key, d, page_size, &mut groups, &mut sums, scratch);
                groups
            })
            .collect();
        let max_sq = keys.par_chunks_exact(d).map(|k| simd::dot(k, k)).reduce(|| 0.0, f32::max);
        let bound = if max_sq > 0.0 { max_sq.sqrt() * C_HEADROOM } else { 1.0 };
        let points_of = |split: &[Vec<Vec<u32>>]| {
            let mut points = vec![0f32; split.len() * (d + 1)];
            points.par_chunks_exact_mut(d + 1).zip(split).for_each(|(out, groups)| {
                let mut sum = PointSum::new(d);
                groups.iter().flatten().for_each(|&t| sum.add(key(t), bound));
                sum.point(bound, out);
            });
            points
        };
        let ids: Vec<i64> = (0..leaves.len() as i64).collect();
        let mut points = points_of(&split);
        // Fewer part-filled pages, found with a tree over the cells as split.
        let mut near = DciIndex::new(tree.config().clone())?;
        near.add(KeyData::F32(&points), Some(&ids))?;
        fill_tails(&mut split, &near, &key, d, page_size, bound);
        drop(near);
        points = points_of(&split);
        let mut hp = HeadPages {
            tree,
            cells: Vec::with_capacity(leaves.len()),
            slots: Vec::new(),
            page_len: Vec::new(),
            page_cell: Vec::new(),
            token_page: vec![EMPTY; n],
            page_size,
            dim: d,
            bound,
            split_at: (CELL_SPLIT * n.div_ceil(leaves.len()) as f32) as usize,
            promotion: cfg.promotion.first().copied().unwrap_or(0.0),
            effort: cfg.effort,
            rng: Xoshiro256PlusPlus::seed_from_u64(cfg.seed.map_or_else(|| rand::thread_rng().gen(), |s| !s)),
            own: None,
        };
        for groups in &split {
            let cell = hp.new_cell();
            for tokens in groups {
                let page = hp.new_page(cell);
                for &t in tokens {
                    hp.push(page, t);
                }
            }
        }
        hp.cells.iter_mut().for_each(|c| c.placed = c.len);
        hp.tree.add(KeyData::F32(&points), Some(&ids))?;
        if own {
            let pb = int8::page_bytes(page_size, d);
            let mut codes = vec![0u8; hp.num_pages() * pb];
            codes.par_chunks_exact_mut(pb).enumerate().for_each(|(p, page)| {
                for (slot, &t) in hp.page_tokens(p as u32).iter().enumerate() {
                    int8::put_row(page, slot, key(t), page_size);
                }
            });
            hp.own = Some(codes);
        }
        Ok(hp)
    }

    pub fn len(&self) -> usize {
        self.token_page.len()
    }

    pub fn num_pages(&self) -> usize {
        self.page_len.len()
    }

    /// Token positions of `page`, in slot order.
    pub fn page_tokens(&self, page: u32) -> &[u32] {
        let at = page as usize * self.page_size;
        &self.slots[at..at + self.page_len[page as usize] as usize]
    }

    /// Tokens in `page`.
    pub fn page_len(&self, page: u32) -> usize {
        self.page_len[page as usize] as usize
    }

    /// The page of token position `t`, if there is one.
    pub fn page_of(&self, t: usize) -> Option<u32> {
        self.token_page.get(t).copied()
    }

    /// The codes of this head: its own, or `store`'s (an 8-bit K store of this head).
    pub fn codes<'a>(&'a self, store: Option<&'a [u8]>) -> PageCodes<'a> {
        rows_in(self.own.as_deref(), store, self.page_size, self.dim)
    }

    /// The cells in `q`'s field of view (enough cells for `pool` keys, `effort` scaling it),
    /// best first by `q · r`, as `(cell, score)` into `out`. `tq` and `s` are scratch.
    pub fn view(
        &self,
        q: &[f32],
        pool: usize,
        effort: f32,
        tq: &mut Vec<f32>,
        s: &mut Scratch,
        out: &mut Vec<(i64, f32)>,
    ) {
        let fov = field_of_view(self.cells.len(), self.len(), pool, effort);
        tq.clear();
        tq.extend_from_slice(q);
        tq.push(0.0);
        out.clear();
        self.tree.search_into(tq, fov, 1.0, s, out);
    }

    /// int8 estimates of `q · k` for the keys of `page`, for each quantised query of `qs` (with
    /// its scale in `qscales`; each row read once for all of them, `simd::dot_rows_i8_group`):
    /// query `j`'s are appended to `outs[j]`, in slot order. `dots` is scratch.
    pub fn score_page(
        &self,
        codes: PageCodes<'_>,
        page: u32,
        (qs, qscales): (&[QueryI8<'_>], &[f32]),
        dots: &mut Vec<i32>,
        outs: &mut [Vec<f32>],
    ) {
        let len = self.page_len[page as usize] as usize;
        dots.resize(qs.len() * len, 0);
        simd::dot_rows_i8_group(qs, codes.rows(page, len), dots);
        for ((d, &qscale), out) in dots.chunks_exact(len.max(1)).zip(qscales).zip(outs) {
            out.extend(d.iter().zip(codes.scales(page, len)).map(|(&dot, scale)| dot as f32 * qscale * scale));
        }
    }

    /// For calibration: the cells holding the `k` best keys of each query of `queries`
    /// (`[nq, d]`), by their int8 estimates over every key.
    pub fn best_keys(&self, codes: PageCodes<'_>, queries: &[f32], k: usize) -> Vec<Vec<u32>> {
        queries
            .par_chunks_exact(self.dim)
            .map(|q| {
                let mut qcode = vec![0i8; self.dim];
                let qscale = simd::quantize_i8(q, &mut qcode);
                let qi8 = QueryI8::new(&qcode);
                let (mut dots, mut scores, mut scored) = (Vec::new(), [Vec::new()], Vec::with_capacity(self.len()));
                for page in 0..self.num_pages() as u32 {
                    let cell = self.page_cell[page as usize];
                    scores[0].clear();
                    self.score_page(codes, page, (std::slice::from_ref(&qi8), &[qscale]), &mut dots, &mut scores);
                    scored.extend(scores[0].iter().map(|&v| (v, cell)));
                }
                scored.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
                scored[..k].iter().map(|&(_, cell)| cell).collect()
            })
            .collect()
    }

    /// For calibration: each query's share of its best keys (`truth`, their cells, from
    /// `best_keys`) in its field of view for `pool` keys at `effort`.
    pub fn view_recall(&self, queries: &[f32], truth: &[Vec<u32>], pool: usize, effort: f32) -> Vec<f64> {
        queries
            .par_chunks_exact(self.dim)
            .zip(truth)
            .map_init(
                || (Vec::new(), Scratch::default(), Vec::new(), vec![false; self.cells.len()]),
                |(tq, s, view, in_view), (q, best)| {
                    self.view(q, pool, effort, tq, s, view);
                    view.iter().for_each(|&(c, _)| in_view[c as usize] = true);
                    let found = best.iter().filter(|&&c| in_view[c as usize]).count();
                    view.iter().for_each(|&(c, _)| in_view[c as usize] = false);
                    found as f64 / best.len() as f64
                },
            )
            .collect()
    }

    fn new_cell(&mut self) -> u32 {
        self.cells.push(Cell { pages: Vec::new(), len: 0, placed: 0 });
        (self.cells.len() - 1) as u32
    }

    /// A new, empty page of `cell`.
    fn new_page(&mut self, cell: u32) -> u32 {
        let page = self.num_pages() as u32;
        self.slots.resize(self.slots.len() + self.page_size, EMPTY);
        self.page_len.push(0);
        self.page_cell.push(cell);
        self.cells[cell as usize].pages.push(page);
        page
    }

    /// Appends token `t` to `page` (which has room) and counts it in the page's cell.
    fn push(&mut self, page: u32, t: u32) {
        let len = self.page_len[page as usize] as usize;
        self.slots[page as usize * self.page_size + len] = t;
        self.page_len[page as usize] += 1;
        if t as usize == self.token_page.len() {
            self.token_page.push(page);
        } else {
            self.token_page[t as usize] = page;
        }
        self.cells[self.page_cell[page as usize] as usize].len += 1;
    }

    /// Makes `page` hold exactly `tokens` (in slot order), which are already counted in its cell.
    fn set_page(&mut self, page: u32, tokens: &[u32]) {
        let at = page as usize * self.page_size;
        self.slots[at..at + self.page_size].fill(EMPTY);
        self.slots[at..at + tokens.len()].copy_from_slice(tokens);
        self.page_len[page as usize] = tokens.len() as u8;
        for &t in tokens {
            self.token_page[t as usize] = page;
        }
    }

    /// The centroid of `page`'s keys from `codes`, into `out`.
    fn page_mean(&self, codes: PageCodes<'_>, page: u32, row: &mut [f32], out: &mut [f32]) {
        out.fill(0.0);
        let len = self.page_len[page as usize] as usize;
        for slot in 0..len {
            codes.row(page, slot, row);
            out.iter_mut().zip(row.iter()).for_each(|(o, x)| *o += x);
        }
        out.iter_mut().for_each(|o| *o /= len.max(1) as f32);
    }

    /// `cell`'s point from its keys' codes, into `out`.
    fn cell_point(&self, codes: PageCodes<'_>, cell: u32, out: &mut [f32]) {
        let mut sum = PointSum::new(self.dim);
        let mut row = vec![0f32; self.dim];
        for &page in &self.cells[cell as usize].pages {
            for slot in 0..self.page_len[page as usize] as usize {
                codes.row(page, slot, &mut row);
                sum.add(&row, self.bound);
            }
        }
        sum.point(self.bound, out);
    }

    /// Places `cell`'s point in the tree again, from its keys now.
    fn replace_point(&mut self, codes: PageCodes<'_>, cell: u32) -> Result<()> {
        let mut point = vec![0f32; self.dim + 1];
        self.cell_point(codes, cell, &mut point);
        if self.tree.contains(cell as i64) {
            self.tree.remove(&[cell as i64])?;
        }
        self.tree.add(KeyData::F32(&point), Some(&[cell as i64]))?;
        let c = &mut self.cells[cell as usize];
        c.placed = c.len;
        Ok(())
    }

    /// After `c` grew: every cell's point again, in a new tree.
    fn replace_all(&mut self, codes: PageCodes<'_>) -> Result<()> {
        let d1 = self.dim + 1;
        let mut points = vec![0f32; self.cells.len() * d1];
        points.par_chunks_exact_mut(d1).enumerate().for_each(|(c, out)| self.cell_point(codes, c as u32, out));
        let mut tree = DciIndex::new(self.tree.config().clone())?;
        let ids: Vec<i64> = (0..self.cells.len() as i64).collect();
        tree.add(KeyData::F32(&points), Some(&ids))?;
        self.tree = tree;
        self.cells.iter_mut().for_each(|c| c.placed = c.len);
        Ok(())
    }

    /// The cell a new key `key` joins: of the tree's best `JOIN_CHOICES` for `T_K(key)`, the
    /// nearest in `T_K` space.
    fn nearest_cell(&self, key: &[f32], s: &mut Scratch) -> u32 {
        let mut tk: Vec<f32> = key.iter().map(|x| x / self.bound).collect();
        tk.push(extra(simd::dot(key, key), self.bound));
        let mut near = Vec::with_capacity(JOIN_CHOICES);
        self.tree.search_into(&tk, JOIN_CHOICES.min(self.tree.len()), 1.0, s, &mut near);
        near.iter()
            .map(|&(cell, _)| (simd::sq_dist(&tk, self.tree.key_of_id(cell)), cell))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map_or(0, |(_, cell)| cell as u32)
    }

    /// Adds token `pos` (its key `key`, its K/V rows `kv`) to the tree, a page of its cell and
    /// the stores (and to this head's own codes); appends the pages whose contents changed to
    /// `changed`. A new key opens a cell of its own with the build's first promotion ratio;
    /// otherwise it joins the nearest page with room of its cell (by centroid), or, when they
    /// are full, the nearest page splits in two with it.
    pub fn insert<T: Elem, K: Format<T>, V: Format<T>>(
        &mut self,
        pos: u32,
        key: &[f32],
        kv: (&[T], &[T]),
        store: &mut Store<'_, T, K, V>,
        s: &mut Scratch,
        changed: &mut Vec<u32>,
    ) -> Result<()> {
        debug_assert_eq!(pos as usize, self.len());
        let mut own = self.own.take();
        let result = (|| {
            let norm = simd::dot(key, key).sqrt();
            if norm > self.bound {
                self.bound = norm * C_HEADROOM;
                self.replace_all(store_codes(&own, store))?;
            }
            let cell = if self.rng.gen::<f64>() < self.promotion { self.new_cell() } else { self.nearest_cell(key, s) };
            let page = self.place(cell, pos, key, kv, store, &mut own, changed)?;
            debug_assert_eq!(self.page_cell[page as usize], cell);
            let c = &self.cells[cell as usize];
            if c.len > self.split_at && c.pages.len() > 1 {
                self.split_cell(store_codes(&own, store), cell)?;
            } else if c.placed == 0 || c.len >= c.placed + (c.placed / REPLACE_SHARE).max(self.page_size) {
                self.replace_point(store_codes(&own, store), cell)?;
            }
            Ok(())
        })();
        self.own = own;
        result
    }

    /// `insert`'s page work: token `pos` into a page of `cell`; returns the page.
    #[allow(clippy::too_many_arguments)]
    fn place<T: Elem, K: Format<T>, V: Format<T>>(
        &mut self,
        cell: u32,
        pos: u32,
        key: &[f32],
        kv: (&[T], &[T]),
        store: &mut Store<'_, T, K, V>,
        own: &mut Option<Vec<u8>>,
        changed: &mut Vec<u32>,
    ) -> Result<u32> {
        let (d, ps) = (self.dim, self.page_size);
        let pb = int8::page_bytes(ps, d);
        // The nearest of the cell's pages by centroid, preferring pages with room.
        let (mut row, mut mean) = (vec![0f32; d], vec![0f32; d]);
        let (mut room, mut full) = (None::<(f32, u32)>, None::<(f32, u32)>);
        let c = store_codes(own, store);
        for &p in &self.cells[cell as usize].pages {
            self.page_mean(c, p, &mut row, &mut mean);
            let dist = simd::sq_dist(&mean, key);
            let best = if (self.page_len[p as usize] as usize) < ps { &mut room } else { &mut full };
            if best.is_none_or(|(b, _)| dist < b) {
                *best = Some((dist, p));
            }
        }
        let write = |store: &mut Store<'_, T, K, V>, own: &mut Option<Vec<u8>>, page: u32, slot: usize| {
            store.write(page, slot as u32, kv.0, kv.1);
            if let Some(own) = own {
                int8::put_row(&mut own[page as usize * pb..(page as usize + 1) * pb], slot, key, ps);
            }
        };
        let new_page = |this: &mut Self, store: &mut Store<'_, T, K, V>, own: &mut Option<Vec<u8>>| {
            let page = this.new_page(cell);
            store.clear_page(page);
            if let Some(own) = own {
                own.resize((page as usize + 1) * pb, 0);
            }
            page
        };
        if let Some((_, page)) = room {
            let slot = self.page_len[page as usize] as usize;
            self.push(page, pos);
            write(store, own, page, slot);
            changed.push(page);
            return Ok(page);
        }
        let Some((_, old)) = full else {
            // A new cell: its first page.
            let page = new_page(self, store, own);
            self.push(page, pos);
            write(store, own, page, 0);
            changed.push(page);
            return Ok(page);
        };
        // Split the full page and the new token into two tight pages; rows move as they are.
        let mut tokens = self.page_tokens(old).to_vec();
        let mut rows = vec![0f32; (tokens.len() + 1) * d];
        for (slot, r) in rows.chunks_exact_mut(d).enumerate().take(tokens.len()) {
            c.row(old, slot, r);
        }
        rows[tokens.len() * d..].copy_from_slice(key);
        // A token's row in `rows` and in the old page: its slot there, or (the new token) last.
        let before = tokens.clone();
        let old_slot = |t: u32| before.iter().position(|&x| x == t);
        tokens.push(pos);
        let row_of = |t: u32| old_slot(t).unwrap_or(before.len());
        let key_of = |t: u32| &rows[row_of(t) * d..(row_of(t) + 1) * d];
        let (mut groups, mut sums) = (Vec::new(), Vec::new());
        let half = tokens.len().div_ceil(2);
        split_pages(&mut tokens, &key_of, d, half, &mut groups, &mut sums, &mut SplitScratch::default());
        debug_assert_eq!(groups.len(), 2);
        let old_rows = store.read_page(old);
        let own_old = own.as_ref().map(|o| o[old as usize * pb..(old as usize + 1) * pb].to_vec());
        // The new token is counted in the cell now; `set_page` lays out both halves.
        self.token_page.push(old);
        self.cells[cell as usize].len += 1;
        let new = new_page(self, store, own);
        for (page, group) in [(old, &groups[0]), (new, &groups[1])] {
            self.set_page(page, group);
            store.clear_page(page);
            if let Some(own) = own.as_mut() {
                own[page as usize * pb..(page as usize + 1) * pb].fill(0);
            }
            for (slot, &t) in group.iter().enumerate() {
                match old_slot(t) {
                    Some(from) => {
                        store.move_row(&old_rows, from, page, slot);
                        if let (Some(own), Some(src)) = (own.as_mut(), &own_old) {
                            int8::copy_row(
                                src,
                                from,
                                &mut own[page as usize * pb..(page as usize + 1) * pb],
                                slot,
                                ps,
                                d,
                            );
                        }
                    }
                    None => write(store, own, page, slot),
                }
            }
            changed.push(page);
        }
        Ok(self.token_page[pos as usize])
    }

    /// Splits `cell`'s pages in two along the principal axis of their centroids (no row moves),
    /// and places both halves' points.
    fn split_cell(&mut self, codes: PageCodes<'_>, cell: u32) -> Result<()> {
        let d = self.dim;
        let mut pages = self.cells[cell as usize].pages.clone();
        let mut means = vec![0f32; pages.len() * d];
        let mut row = vec![0f32; d];
        for (p, mean) in pages.iter().zip(means.chunks_exact_mut(d)) {
            self.page_mean(codes, *p, &mut row, mean);
        }
        let by_page: Vec<u32> = pages.clone();
        let mean_of = |p: u32| {
            let i = by_page.iter().position(|&x| x == p).expect("a page of the cell");
            &means[i * d..(i + 1) * d]
        };
        let (mut groups, mut sums) = (Vec::new(), Vec::new());
        let half = pages.len().div_ceil(2);
        split_pages(&mut pages, &mean_of, d, half, &mut groups, &mut sums, &mut SplitScratch::default());
        let new = self.new_cell();
        let len = |this: &Self, g: &[u32]| g.iter().map(|&p| this.page_len[p as usize] as usize).sum::<usize>();
        let second = groups.pop().expect("two halves");
        let first = groups.pop().expect("two halves");
        self.cells[cell as usize].len = len(self, &first);
        self.cells[cell as usize].pages = first;
        self.cells[new as usize].len = len(self, &second);
        for &p in &second {
            self.page_cell[p as usize] = new;
        }
        self.cells[new as usize].pages = second;
        self.replace_point(codes, cell)?;
        self.replace_point(codes, new)
    }

    /// Approximate heap bytes: the tree, the cells, the page and position maps, own codes.
    pub fn nbytes(&self) -> usize {
        let cells: usize = self.cells.iter().map(|c| c.pages.capacity() * 4).sum::<usize>()
            + self.cells.capacity() * std::mem::size_of::<Cell>();
        self.tree.stats().bytes
            + cells
            + (self.slots.capacity() + self.page_cell.capacity() + self.token_page.capacity()) * 4
            + self.page_len.capacity()
            + self.own.as_ref().map_or(0, |o| o.capacity())
    }

    /// Checks the head's invariants (`Err` names the first one broken): every position in
    /// exactly one page, the maps agreeing, every page in exactly one cell, the cells' counts,
    /// the tree sound and holding exactly one point per cell, own codes sized to the pages.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let (n, np, ps) = (self.len(), self.num_pages(), self.page_size);
        if self.slots.len() != np * ps || self.page_cell.len() != np {
            return Err("page arrays disagree in length".into());
        }
        let mut seen = vec![false; n];
        for p in 0..np as u32 {
            let tokens = self.page_tokens(p);
            if tokens.is_empty() || tokens.len() > ps {
                return Err(format!("page {p} holds {} tokens", tokens.len()));
            }
            for &t in tokens {
                if t as usize >= n || std::mem::replace(&mut seen[t as usize], true) {
                    return Err(format!("token {t} is out of range or in two pages"));
                }
                if self.token_page[t as usize] != p {
                    return Err(format!("token {t} lives in page {p} but maps to {}", self.token_page[t as usize]));
                }
            }
        }
        if seen.iter().any(|&s| !s) {
            return Err("a token is in no page".into());
        }
        let mut listed = vec![false; np];
        for (c, cell) in self.cells.iter().enumerate() {
            let mut len = 0;
            for &p in &cell.pages {
                if std::mem::replace(&mut listed[p as usize], true) || self.page_cell[p as usize] != c as u32 {
                    return Err(format!("page {p} of cell {c} is listed twice or maps elsewhere"));
                }
                len += self.page_len[p as usize] as usize;
            }
            if cell.pages.is_empty() || cell.len != len {
                return Err(format!("cell {c} holds {} pages and counts {} of {len} keys", cell.pages.len(), cell.len));
            }
            if !self.tree.contains(c as i64) {
                return Err(format!("cell {c} has no point in the tree"));
            }
        }
        if listed.iter().any(|&l| !l) {
            return Err("a page is in no cell".into());
        }
        if self.tree.len() != self.cells.len() {
            return Err(format!("the tree holds {} points for {} cells", self.tree.len(), self.cells.len()));
        }
        if let Some(own) = &self.own {
            ensure_len(own.len(), np * int8::page_bytes(ps, self.dim))?;
        }
        self.tree.validate().map_err(|e| format!("the tree: {e}"))
    }
}

fn ensure_len(got: usize, want: usize) -> std::result::Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("own codes hold {got} bytes, the pages {want}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Metric;
    use crate::pages::Native;
    use rand::rngs::StdRng;
    use rand_distr::StandardNormal;

    /// `[n, dim]` keys around a few centres.
    fn keys(n: usize, dim: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        let centres: Vec<f32> = (0..12 * dim).map(|_| 2.0 * rng.sample::<f32, _>(StandardNormal)).collect();
        (0..n)
            .flat_map(|_| {
                let c = rng.gen_range(0..12);
                (0..dim).map(|j| centres[c * dim + j] + rng.sample::<f32, _>(StandardNormal)).collect::<Vec<f32>>()
            })
            .collect()
    }

    fn config(dim: usize) -> Config {
        let mut cfg = Config::new(dim, Metric::InnerProduct);
        cfg.seed = Some(7);
        cfg.promotion = vec![0.02, 0.2];
        cfg
    }

    #[test]
    fn a_build_leaves_few_part_filled_pages() {
        let (n, d, s) = (6000, 16, 16);
        let hp = HeadPages::build(keys(n, d, 1), &config(d), s, true).unwrap();
        hp.validate().unwrap();
        for (c, cell) in hp.cells.iter().enumerate() {
            let part = cell.pages.iter().filter(|&&p| (hp.page_len[p as usize] as usize) < s).count();
            assert!(part <= 1, "cell {c} has {part} part-filled pages");
        }
        // Without moving tails a part-filled page per cell holds half a page on average: the
        // cells here hold ~50 keys, so that would fill about 86% of the slots.
        let fill = n as f64 / (hp.num_pages() * s) as f64;
        assert!(fill > 0.93, "pages hold {fill:.3} of their slots");
    }

    #[test]
    fn inserts_split_cells_open_cells_and_follow_a_larger_c() {
        let (n, m, d, s) = (400, 4000, 16, 8);
        let all = keys(n + m, d, 2);
        let mut hp = HeadPages::build(all[..n * d].to_vec(), &config(d), s, true).unwrap();
        let cells = hp.cells.len();
        let pages = hp.num_pages() + m + 1;
        let (mut ks, mut vs) = (vec![0f32; pages * s * d], vec![0f32; pages * s * d]);
        let mut store = Store::<f32, Native, Native> { k: &mut ks, v: &mut vs, d, s, kind: std::marker::PhantomData };
        let (mut scratch, mut changed) = (Scratch::default(), Vec::new());
        for t in n..n + m {
            let key = &all[t * d..(t + 1) * d];
            hp.insert(t as u32, key, (key, key), &mut store, &mut scratch, &mut changed).unwrap();
        }
        hp.validate().unwrap();
        assert!(hp.cells.len() > cells + m / 100, "{} cells from {cells}: no cell opened or split", hp.cells.len());
        assert!(hp.cells.iter().all(|c| c.len <= hp.split_at + s), "a cell outgrew the split size");
        // A key far larger than any: `c` grows and every point is placed again.
        let before = hp.bound;
        let big: Vec<f32> = all[..d].iter().map(|x| 50.0 * x).collect();
        hp.insert((n + m) as u32, &big, (&big, &big), &mut store, &mut scratch, &mut changed).unwrap();
        assert!(hp.bound > before && hp.bound >= simd::dot(&big, &big).sqrt());
        hp.validate().unwrap();
        // Its own direction finds its cell first.
        let (mut tq, mut view) = (Vec::new(), Vec::new());
        hp.view(&big, 1, 1.0, &mut tq, &mut scratch, &mut view);
        let page = hp.page_of(n + m).unwrap();
        assert_eq!(view[0].0 as u32, hp.page_cell[page as usize]);
    }
}
