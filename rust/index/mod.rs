//! The M-DCI index over one set of keys (docs/ARCHITECTURE.md, sections The method and Index).
//!
//! Structure, in the paper's terms:
//! - every point draws a level by random promotion (`Config::promotion`);
//! - the tree is nested: a point of level `l` sits in one **cell** of every tier `t ≤ l`. A cell of
//!   tier `t` is owned by a point of level `≥ t + 1` (its parent) and holds that parent and the
//!   level-`≥ t` points nearest to it in transformed space. The top tier has one root cell;
//! - each cell keeps a **route**: the centroid of its members' transformed keys, maintained as
//!   members come and go. Queries rank cells by the route and descend with a beam (the field of
//!   view); assignment to a parent is by nearest route;
//! - tier-0 cells are the leaves: they store their members' int8 codes contiguously (a fast first
//!   pass that streams like a scan) and P-DCI sorted projections (for large cells). Survivors of
//!   the first pass are re-ranked with exact f32 scores.
//!
//! Inner-product search uses `T_K(k) = [k / c, sqrt(1 - |k|²/c²)]`, `T_Q(q) = [q / |q|, 0]`: the
//! query side ranks by the raw `q · k`, so returned rankings never depend on `c`; `c` only shapes
//! the tree. When a key arrives with `|k| > c`, `c` grows with headroom and every derived value
//! that depends on it (route extras, P-DCI projections) is recomputed at once.
//!
//! Modules: `cells` (tiers of cells, the storage), `descent` (the beam descent), `rank` (packed
//! scores, best-k), `tree` (build, insert, delete), `search` (queries), `calibrate` (the effort
//! that reaches a target recall), `pdci` (P-DCI inside a large leaf cell), `persist` (save
//! files), `check` (structural checks of loaded files, and the invariants tests assert). `tree` and `search` share `cells`, `descent` and `rank` and do
//! not use each other.

mod calibrate;
mod cells;
mod check;
mod descent;
mod pdci;
mod persist;
mod rank;
mod search;
mod tree;

use std::collections::{HashMap, HashSet};

use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

use crate::error::{ensure, Error, Result};
use crate::input::{check_rows, KeyData};
use calibrate::Tuning;
pub(crate) use calibrate::{check_search, search_effort};
pub use calibrate::{Calibration, AUTO_MIN_EFFORT, AUTO_SAMPLE, AUTO_TARGET, DEFAULT_MAX_EFFORT, DEFAULT_MIN_EFFORT};
use cells::{Tier, NONE};
pub(crate) use search::field_of_view;
pub use search::Scratch;

/// Largest supported key dimension.
pub const MAX_DIM: usize = 4096;
/// Most levels a tree may have (the promotion list is at most this long minus one).
pub const MAX_LEVELS: usize = 16;
/// Room (in values) that `add`'s bulk build of `n` keys of `dim` keeps in its key copy for
/// inserts after it, an eighth more rows, so that the first inserts do not pay for a regrowth.
/// The copy is made with it, so the build does not reallocate.
const fn build_room(n: usize, dim: usize) -> usize {
    (n / 8) * dim
}

/// Headroom applied to `c` when a larger key arrives, so that growth re-derivations stay rare.
pub(crate) const C_HEADROOM: f32 = 1.05;

/// How keys are compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Metric {
    /// Maximum inner product (scores: `q · k`, larger first).
    InnerProduct,
    /// Euclidean (scores: `|q - k|²`, smaller first).
    L2,
}

impl Metric {
    pub fn parse(s: &str) -> Result<Metric> {
        match s {
            "ip" => Ok(Metric::InnerProduct),
            "l2" => Ok(Metric::L2),
            other => Err(Error::Invalid(format!("metric must be \"ip\" or \"l2\", not {other:?}"))),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Metric::InnerProduct => "ip",
            Metric::L2 => "l2",
        }
    }
}

/// Index parameters. `Default` gives the tuned defaults for a `dim`-agnostic index.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Config {
    pub dim: usize,
    pub metric: Metric,
    /// P-DCI simple indices per composite index (m).
    pub num_simple: usize,
    /// P-DCI composite indices (L).
    pub num_composite: usize,
    /// `promotion[0]` = P(level ≥ 1); `promotion[i]` = P(level ≥ i + 1 | level ≥ i).
    pub promotion: Vec<f64>,
    /// Seed for directions and level draws; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Default query effort: scales the field of view (1.0 = the tuned default).
    pub effort: f32,
    /// Tier-0 cells with at least this many members are searched with P-DCI instead of a scan.
    /// At head dimensions 64–128 the int8 scan wins by 20x or more (benches/RESULTS.md), so the
    /// default only sends cells far larger than the default tree makes to P-DCI.
    pub pdci_min_cell: usize,
    /// First-pass survivors re-ranked exactly, as a multiple of `k`.
    pub rerank: usize,
}

impl Config {
    pub fn new(dim: usize, metric: Metric) -> Config {
        Config {
            dim,
            metric,
            num_simple: 4,
            num_composite: 2,
            promotion: vec![1.0 / 32.0, 1.0 / 16.0, 1.0 / 16.0],
            seed: None,
            effort: 1.0,
            pdci_min_cell: 1024,
            rerank: 2,
        }
    }

    pub fn validate(&self) -> Result<()> {
        ensure!(self.dim >= 1 && self.dim <= MAX_DIM, "dim must be in 1..={MAX_DIM}, got {}", self.dim);
        ensure!((1..=64).contains(&self.num_simple), "num_simple must be in 1..=64, got {}", self.num_simple);
        ensure!((1..=16).contains(&self.num_composite), "num_composite must be in 1..=16, got {}", self.num_composite);
        ensure!(
            self.promotion.len() < MAX_LEVELS,
            "promotion has {} levels; at most {} are supported",
            self.promotion.len(),
            MAX_LEVELS - 1
        );
        for &p in &self.promotion {
            ensure!(p > 0.0 && p < 1.0, "every promotion ratio must be in (0, 1), got {p}");
        }
        check_effort(self.effort)?;
        ensure!(self.pdci_min_cell >= 1, "pdci_min_cell must be at least 1");
        ensure!((1..=64).contains(&self.rerank), "rerank must be in 1..=64, got {}", self.rerank);
        Ok(())
    }

    fn num_dirs(&self) -> usize {
        self.num_simple * self.num_composite
    }
}

fn check_effort(effort: f32) -> Result<()> {
    ensure!(effort.is_finite() && effort > 0.0, "effort must be a positive number, got {effort}");
    Ok(())
}

/// Shape of the tree, for `stats()`.
#[derive(Clone, Debug)]
pub struct Stats {
    pub len: usize,
    /// Points whose level is exactly `l`, for each level.
    pub points_per_level: Vec<usize>,
    /// Live cells per tier (tier 0 = leaf cells).
    pub cells_per_tier: Vec<usize>,
    /// Mean and largest member count of tier-0 cells.
    pub mean_leaf_cell: f64,
    pub max_leaf_cell: usize,
    /// The inner-product transform bound `c` (0 for L2).
    pub c: f32,
    /// Approximate heap bytes held by the index.
    pub bytes: usize,
}

/// A multi-level DCI index. See the module docs for the structure.
#[derive(Serialize, Deserialize)]
pub struct DciIndex {
    cfg: Config,
    /// Unit directions, `num_dirs × (dim + 1)`; the last component pairs with the transform's
    /// extra coordinate (inner product only).
    dirs: Vec<f32>,
    // Per slot (a slot is a point's internal number; freed slots are reused).
    keys: Vec<f32>,
    sq_norms: Vec<f32>,
    /// Raw projections `k · u[..dim]`, `num_dirs` per slot.
    proj: Vec<f32>,
    ids: Vec<i64>,
    /// Level of each slot; `FREE` for an unused slot.
    level: Vec<u8>,
    free_slots: Vec<u32>,
    #[serde(skip)]
    id_map: HashMap<i64, u32>,
    len: usize,
    /// Inner-product transform bound (`c ≥ max |k|`); 0 while empty or for L2.
    c: f32,
    /// L2 only: subtracted from keys and queries on the way in (the mean of the build batch).
    /// Distances do not change, and scores stay well-conditioned for data far from the origin.
    shift: Vec<f32>,
    /// int8 codes quantise `k - code_center` (the mean of the built keys): attention keys share
    /// a large common component, and removing it leaves the codes' range for what differs.
    code_center: Vec<f32>,
    tiers: Vec<Tier>,
    /// The single cell of the top tier.
    root: u32,
    rng: Xoshiro256PlusPlus,
    next_id: i64,
    /// Points, and points of level >= 1, when the tree and the tiers above the leaves were last
    /// built: inserts rebuild them as they grow (`DciIndex::regrow`). Not saved: a load counts
    /// from the loaded size.
    #[serde(skip)]
    built: usize,
    #[serde(skip)]
    upper_built: usize,
    /// A pending `effort="auto"` and the last calibration (`calibrate`); saved after the index
    /// in its own section, so that files of format 1 (without it) still load.
    #[serde(skip)]
    tuning: Tuning,
}

const FREE: u8 = u8::MAX;

impl DciIndex {
    /// An empty index.
    pub fn new(cfg: Config) -> Result<DciIndex> {
        cfg.validate()?;
        let seed = cfg.seed.unwrap_or_else(|| rand::thread_rng().gen());
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let width = cfg.dim + 1;
        let mut dirs = vec![0f32; cfg.num_dirs() * width];
        for u in dirs.chunks_exact_mut(width) {
            loop {
                for x in u.iter_mut() {
                    *x = rng.sample::<f32, _>(StandardNormal);
                }
                let norm = u.iter().map(|x| x * x).sum::<f32>().sqrt();
                if norm > 1e-6 {
                    u.iter_mut().for_each(|x| *x /= norm);
                    break;
                }
            }
        }
        Ok(DciIndex {
            cfg,
            dirs,
            keys: Vec::new(),
            sq_norms: Vec::new(),
            proj: Vec::new(),
            ids: Vec::new(),
            level: Vec::new(),
            free_slots: Vec::new(),
            id_map: HashMap::new(),
            len: 0,
            c: 0.0,
            shift: Vec::new(),
            code_center: Vec::new(),
            tiers: Vec::new(),
            root: NONE,
            rng,
            next_id: 0,
            built: 0,
            upper_built: 0,
            tuning: Tuning::default(),
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn dim(&self) -> usize {
        self.cfg.dim
    }

    pub fn metric(&self) -> Metric {
        self.cfg.metric
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, id: i64) -> bool {
        self.id_map.contains_key(&id)
    }

    /// Adds `keys` (`[n, dim]` row-major) under `ids` (fresh ids when `None`) and returns the ids.
    /// Into an empty index this is a parallel bulk build (rayon); otherwise each key is inserted
    /// incrementally. All input is validated before anything changes.
    pub fn add(&mut self, keys: KeyData<'_>, ids: Option<&[i64]>) -> Result<Vec<i64>> {
        let room = if self.len == 0 { build_room(keys.len() / self.cfg.dim, self.cfg.dim) } else { 0 };
        let keys = keys.to_f32_vec_with_room(room);
        let n = check_rows(&keys, self.cfg.dim, "keys")?;
        let ids = self.check_new_ids(n, ids)?;
        if n == 0 {
            return Ok(ids);
        }
        if self.len == 0 && self.cfg.metric == Metric::L2 {
            self.shift = mean_row(&keys, self.cfg.dim);
        }
        let keys = self.shift_rows(keys);
        if self.len == 0 {
            self.build(keys, &ids);
        } else {
            for (row, &id) in keys.chunks_exact(self.cfg.dim).zip(&ids) {
                self.insert(row, id);
            }
        }
        if let Some(&max) = ids.iter().max() {
            self.next_id = self.next_id.max(max.saturating_add(1));
        }
        Ok(ids)
    }

    /// Removes the points with these ids. Every id must be present (and appear once); otherwise
    /// nothing is removed.
    pub fn remove(&mut self, ids: &[i64]) -> Result<()> {
        let mut seen = HashSet::with_capacity(ids.len());
        for &id in ids {
            if !self.id_map.contains_key(&id) {
                return Err(Error::UnknownId(id));
            }
            ensure!(seen.insert(id), "id {id} appears more than once in ids");
        }
        for &id in ids {
            let slot = self.id_map[&id];
            self.delete(slot);
        }
        Ok(())
    }

    /// Top-`k` of each query row (`[nq, dim]`): ids and scores, best first, `nq × k` each.
    /// Scores are `q · k` (inner product) or `|q - k|²` (L2). `effort` scales the field of view
    /// (`None`: the configured default); `exact` scans every key.
    pub fn query(
        &self,
        queries: KeyData<'_>,
        k: usize,
        effort: Option<f32>,
        exact: bool,
    ) -> Result<(Vec<i64>, Vec<f32>)> {
        let queries = queries.to_f32_vec();
        let nq = check_rows(&queries, self.cfg.dim, "queries")?;
        let queries = self.shift_rows(queries);
        ensure!(self.len > 0, "the index is empty");
        ensure!(k >= 1, "k must be at least 1, got {k}");
        ensure!(k <= self.len, "k = {k} is larger than the number of points in the index ({})", self.len);
        let effort = effort.unwrap_or(self.cfg.effort);
        check_effort(effort)?;
        self.query_batch(&queries, nq, k, effort, exact)
    }

    /// Checks every structural invariant of the tree; `Err` names the first one broken.
    /// Meant for tests and debugging: it walks the whole index.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.check_structure()?;
        self.check_tree()
    }

    pub fn stats(&self) -> Stats {
        let mut points_per_level = vec![0usize; self.tiers.len().max(1)];
        for &l in &self.level {
            if l != FREE {
                points_per_level[l as usize] += 1;
            }
        }
        if self.len == 0 {
            points_per_level.clear();
        }
        let cells_per_tier = self.tiers.iter().map(|t| t.live_cells()).collect();
        let (mut sum, mut max, mut cnt) = (0usize, 0usize, 0usize);
        if let Some(t0) = self.tiers.first() {
            for c in t0.cells.iter().filter(|c| c.live) {
                sum += c.members.len();
                max = max.max(c.members.len());
                cnt += 1;
            }
        }
        let f = std::mem::size_of::<f32>();
        // Capacities, not lengths: the memory held (a bulk build reserves room for inserts).
        let mut bytes = (self.keys.capacity() + self.sq_norms.capacity() + self.proj.capacity() + self.dirs.capacity())
            * f
            + self.ids.capacity() * 8
            + self.level.capacity()
            + self.id_map.capacity() * 16;
        bytes += self.tiers.iter().map(|t| t.bytes()).sum::<usize>();
        Stats {
            len: self.len,
            points_per_level,
            cells_per_tier,
            mean_leaf_cell: if cnt > 0 { sum as f64 / cnt as f64 } else { 0.0 },
            max_leaf_cell: max,
            c: self.c,
            bytes,
        }
    }

    /// Validates `ids` for `n` new points, or draws fresh ones.
    fn check_new_ids(&self, n: usize, ids: Option<&[i64]>) -> Result<Vec<i64>> {
        let Some(ids) = ids else {
            ensure!(self.next_id.checked_add(n as i64).is_some(), "no fresh ids left after {}", self.next_id);
            return Ok((self.next_id..self.next_id + n as i64).collect());
        };
        ensure!(ids.len() == n, "got {} ids for {n} keys", ids.len());
        let mut seen = HashSet::with_capacity(n);
        for &id in ids {
            ensure!(id >= 0, "ids must be non-negative, got {id}");
            ensure!(seen.insert(id), "id {id} appears more than once in ids");
            ensure!(!self.id_map.contains_key(&id), "id {id} is already in the index");
        }
        Ok(ids.to_vec())
    }

    /// Applies `shift` (L2) to rows arriving from the caller.
    fn shift_rows(&self, mut rows: Vec<f32>) -> Vec<f32> {
        if !self.shift.is_empty() {
            for r in rows.chunks_exact_mut(self.cfg.dim) {
                r.iter_mut().zip(&self.shift).for_each(|(x, s)| *x -= s);
            }
        }
        rows
    }

    // ---- views for the page layer ----

    /// Bulk build of an empty inner-product index under ids `0..n`, for keys the caller has
    /// validated already (`check_rows`): the checks of `add` would only repeat its work. The
    /// index keeps `keys` as its copy (with no room for inserts: a `HeadForest` reads the
    /// build and drops it); point `i` is slot `i` (`built_keys`).
    pub(crate) fn build_positions(&mut self, keys: Vec<f32>) {
        debug_assert!(self.len == 0 && self.cfg.metric == Metric::InnerProduct && !keys.is_empty());
        let ids: Vec<i64> = (0..(keys.len() / self.cfg.dim) as i64).collect();
        self.build(keys, &ids);
        self.next_id = ids.len() as i64;
    }

    /// The keys of every slot, `[slots, dim]`; after `build_positions`, row `i` is point `i`.
    pub(crate) fn built_keys(&self) -> &[f32] {
        &self.keys
    }

    /// Live leaf (tier-0) cells: `(cell id, member slots)`.
    pub(crate) fn leaf_cells(&self) -> impl Iterator<Item = (u32, &[u32])> + '_ {
        self.tiers
            .first()
            .into_iter()
            .flat_map(|t| t.cells.iter().enumerate().filter(|(_, c)| c.live).map(|(i, c)| (i as u32, &c.members[..])))
    }

    /// The key stored under `id` (which must exist), as the index holds it.
    pub(crate) fn key_of_id(&self, id: i64) -> &[f32] {
        self.key(self.id_map[&id])
    }

    // ---- per-slot helpers shared by tree, search and pdci ----

    /// int8 code of a slot's key (relative to `code_center`) into `code`; returns its scale.
    fn code_of(&self, slot: u32, code: &mut [i8]) -> f32 {
        crate::simd::quantize_i8_centred(self.key(slot), &self.code_center, code)
    }

    fn key(&self, slot: u32) -> &[f32] {
        let d = self.cfg.dim;
        &self.keys[slot as usize * d..(slot as usize + 1) * d]
    }

    /// The transform's extra coordinate `sqrt(1 - |k|²/c²)` (0 for L2).
    fn extra(&self, slot: u32) -> f32 {
        extra_coord(self.cfg.metric, self.sq_norms[slot as usize], self.c)
    }

    /// Projection of the transformed key onto direction `j` (what P-DCI sorts by).
    fn key_proj(&self, slot: u32, j: usize) -> f32 {
        let nd = self.cfg.num_dirs();
        let raw = self.proj[slot as usize * nd + j];
        match self.cfg.metric {
            Metric::L2 => raw,
            Metric::InnerProduct => raw / self.c + self.extra(slot) * self.dirs[j * (self.cfg.dim + 1) + self.cfg.dim],
        }
    }

    /// Writes a new point into slot storage (no tree work) and returns its slot.
    fn alloc_slot(&mut self, key: &[f32], id: i64) -> u32 {
        let d = self.cfg.dim;
        let nd = self.cfg.num_dirs();
        let sq = crate::simd::dot(key, key);
        let mut p = vec![0f32; nd];
        for (j, pj) in p.iter_mut().enumerate() {
            *pj = crate::simd::dot(key, &self.dirs[j * (d + 1)..j * (d + 1) + d]);
        }
        let slot = if let Some(s) = self.free_slots.pop() {
            let i = s as usize;
            self.keys[i * d..(i + 1) * d].copy_from_slice(key);
            self.sq_norms[i] = sq;
            self.proj[i * nd..(i + 1) * nd].copy_from_slice(&p);
            self.ids[i] = id;
            s
        } else {
            self.keys.extend_from_slice(key);
            self.sq_norms.push(sq);
            self.proj.extend_from_slice(&p);
            self.ids.push(id);
            self.level.push(FREE);
            for t in &mut self.tiers {
                t.grow_slots(self.level.len());
            }
            (self.level.len() - 1) as u32
        };
        self.id_map.insert(id, slot);
        self.len += 1;
        slot
    }

    fn draw_level(&mut self) -> usize {
        let mut l = 0;
        while l < self.cfg.promotion.len() && self.rng.gen::<f64>() < self.cfg.promotion[l] {
            l += 1;
        }
        l
    }
}

/// Mean of `[n, dim]` rows, accumulated in f64.
fn mean_row(rows: &[f32], dim: usize) -> Vec<f32> {
    let mut sum = vec![0f64; dim];
    for r in rows.chunks_exact(dim) {
        sum.iter_mut().zip(r).for_each(|(s, x)| *s += *x as f64);
    }
    let n = (rows.len() / dim).max(1) as f64;
    sum.into_iter().map(|s| (s / n) as f32).collect()
}

/// `sqrt(1 - |k|²/c²)`, the coordinate that lifts a key onto the sphere of radius 1.
fn extra_coord(metric: Metric, sq_norm: f32, c: f32) -> f32 {
    match metric {
        Metric::L2 => 0.0,
        Metric::InnerProduct => (1.0 - sq_norm / (c * c)).max(0.0).sqrt(),
    }
}
