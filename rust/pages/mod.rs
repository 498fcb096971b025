//! Semantic pages (docs/ARCHITECTURE.md, section Pages): one M-DCI tree per KV head of one layer of one sequence; the
//! members of each leaf cell (keys near one parent), split into runs of at most `page_size` keys
//! that are near each other, are the physical pages of the CPU KV store.
//!
//! Page stores are `[H_kv, P, page_size, d]` arrays (K and V apart) in the tokens' element type,
//! or, for 8-bit pages, `[H_kv, P, int8::page_bytes(page_size, d)]` bytes (see [`int8`]); owned
//! by the caller, this module writes them but never allocates them.

pub mod int8;
mod split;

use std::collections::HashMap;
use std::ops::RangeInclusive;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{ensure, Error, Result};
use crate::index::{build_room, Calibration, Config, DciIndex, Metric};
use crate::input::{check_rows, KeyData};
use split::{split_pages, SplitScratch};

/// Allowed page sizes.
pub const PAGE_SIZES: std::ops::RangeInclusive<usize> = 8..=64;

/// An element of K/V tokens: f32, f16, or bf16 carried as its u16 bits.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    fn keys(s: &[Self]) -> KeyData<'_>;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    fn keys(s: &[f32]) -> KeyData<'_> {
        KeyData::F32(s)
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    fn keys(s: &[f16]) -> KeyData<'_> {
        KeyData::F16(s)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Elem for u16 {
    fn keys(s: &[u16]) -> KeyData<'_> {
        KeyData::Bf16(half::slice::HalfBitsSliceExt::reinterpret_cast::<bf16>(s))
    }
    fn to_f32(self) -> f32 {
        bf16::from_bits(self).to_f32()
    }
}

/// How a layer's page stores hold K and V rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageFormat {
    /// In the tokens' element type: `[H_kv, P, page_size, d]`.
    Native,
    /// int8 codes and an f32 scale per row: `[H_kv, P, int8::page_bytes(page_size, d)]` bytes.
    Int8,
}

impl PageFormat {
    /// Bytes of one page of `page_size` rows of `dim` elements of `elem_size` bytes.
    pub fn page_bytes(self, page_size: usize, dim: usize, elem_size: usize) -> usize {
        match self {
            PageFormat::Native => page_size * dim * elem_size,
            PageFormat::Int8 => int8::page_bytes(page_size, dim),
        }
    }
}

/// How page stores hold rows of `T`: each page is `page_len(s, d)` cells.
pub(crate) trait Format<T: Elem> {
    type Cell: Copy + Default + Send + Sync;
    /// Only finite rows can be stored.
    const FINITE: bool;
    fn page_len(s: usize, d: usize) -> usize;
    /// The expected store shape, for errors.
    fn shape(h: usize, s: usize, d: usize) -> String;
    /// Writes `row` into slot `slot` of `page`.
    fn put(page: &mut [Self::Cell], slot: usize, row: &[T], s: usize);
    /// Copies row `from` of page `src` into row `to` of page `dst`.
    fn copy(src: &[Self::Cell], from: usize, dst: &mut [Self::Cell], to: usize, s: usize, d: usize);
    /// Empties rows `from..s` of `page`.
    fn clear_from(page: &mut [Self::Cell], from: usize, s: usize, d: usize);
}

/// Stores in the tokens' own element type: `[H_kv, P, page_size, d]`.
pub(crate) struct Native;

impl<T: Elem> Format<T> for Native {
    type Cell = T;
    const FINITE: bool = false;
    fn page_len(s: usize, d: usize) -> usize {
        s * d
    }
    fn shape(h: usize, s: usize, d: usize) -> String {
        format!("[{h}, P, {s}, {d}]")
    }
    fn put(page: &mut [T], slot: usize, row: &[T], _s: usize) {
        let d = row.len();
        page[slot * d..(slot + 1) * d].copy_from_slice(row);
    }
    fn copy(src: &[T], from: usize, dst: &mut [T], to: usize, _s: usize, d: usize) {
        dst[to * d..(to + 1) * d].copy_from_slice(&src[from * d..(from + 1) * d]);
    }
    fn clear_from(page: &mut [T], from: usize, _s: usize, d: usize) {
        page[from * d..].fill(T::default());
    }
}

/// 8-bit stores: `[H_kv, P, int8::page_bytes(page_size, d)]` bytes (see [`int8`]).
pub(crate) struct Int8;

impl<T: Elem> Format<T> for Int8 {
    type Cell = u8;
    const FINITE: bool = true;
    fn page_len(s: usize, d: usize) -> usize {
        int8::page_bytes(s, d)
    }
    fn shape(h: usize, s: usize, d: usize) -> String {
        format!("[{h}, P, {}] bytes", int8::page_bytes(s, d))
    }
    fn put(page: &mut [u8], slot: usize, row: &[T], s: usize) {
        // Widened on the stack (head dims are at most a few hundred).
        let mut stack = [0f32; 512];
        let mut heap = Vec::new();
        let wide = if row.len() <= stack.len() {
            &mut stack[..row.len()]
        } else {
            heap.resize(row.len(), 0.0);
            &mut heap[..]
        };
        wide.iter_mut().zip(row).for_each(|(w, x)| *w = x.to_f32());
        int8::put_row(page, slot, wide, s);
    }
    fn copy(src: &[u8], from: usize, dst: &mut [u8], to: usize, s: usize, d: usize) {
        int8::copy_row(src, from, dst, to, s, d);
    }
    fn clear_from(page: &mut [u8], from: usize, s: usize, d: usize) {
        page[from * d..s * d].fill(0);
        page[s * d + from * int8::SCALE_BYTES..].fill(0);
    }
}

/// `Err` unless every element of `rows` is finite (what 8-bit pages can hold).
fn check_finite<T: Elem>(rows: &[T], what: &str) -> Result<()> {
    ensure!(rows.iter().all(|x| x.to_f32().is_finite()), "{what}: 8-bit pages hold finite values only");
    Ok(())
}

/// The pages of one KV head and the tree that ranks them.
pub(crate) struct HeadPages {
    pub index: DciIndex,
    /// Token positions of each page, in slot order.
    pub pages: Vec<Vec<u32>>,
    /// `(page, slot)` of each token position.
    pub token_page: Vec<(u32, u32)>,
    /// Sum of each page's keys (`dim` floats per page): where an inserted key fits best.
    page_sum: Vec<f32>,
    /// Pages of each leaf cell (where they were born, or, after the index rebuilt its leaves,
    /// where most of their tokens are): an inserted key joins one of its cell's pages.
    cell_pages: HashMap<u32, Vec<u32>>,
    /// The index's leaf rebuilds that `cell_pages` reflects.
    leaf_rebuilds: u64,
}

/// One M-DCI tree and page layout per KV head. See the module docs.
pub struct HeadForest {
    pub(crate) heads: Vec<HeadPages>,
    page_size: usize,
    dim: usize,
    len: usize,
}

impl HeadForest {
    /// The default index configuration of a forest: inner product, and leaf cells of about a
    /// hundred keys (first promotion ratio 1/100), cut into full pages. Larger cells than
    /// `DCIIndex`'s leave fewer part-filled pages (measured by `icecache eval recall`).
    pub fn default_config(dim: usize) -> Config {
        let mut cfg = Config::new(dim, Metric::InnerProduct);
        cfg.promotion = vec![0.01, 1.0 / 16.0, 1.0 / 16.0];
        cfg
    }

    /// Builds the trees (in parallel, one per head) and pages over `keys` `[num_heads, n, dim]`.
    /// `cfg.metric` must be inner product (attention); `cfg.seed` seeds head `h` with `seed + h`.
    pub fn build(keys: KeyData<'_>, num_heads: usize, cfg: Config, page_size: usize) -> Result<HeadForest> {
        ensure!(PAGE_SIZES.contains(&page_size), "page_size must be in 8..=64, got {page_size}");
        ensure!(cfg.metric == Metric::InnerProduct, "a HeadForest ranks by inner product (metric \"ip\")");
        ensure!(num_heads >= 1, "keys must have at least one head");
        cfg.validate()?;
        let d = cfg.dim;
        ensure!(keys.len().is_multiple_of(d), "keys: {} values are not a whole number of rows of dim {d}", keys.len());
        let rows = keys.len() / d;
        ensure!(rows.is_multiple_of(num_heads), "keys: {rows} rows do not split into {num_heads} heads");
        let n = rows / num_heads;
        ensure!(n >= 1, "keys must hold at least one token per head");
        ensure!(n < u32::MAX as usize / 2, "too many tokens per head: {n}");
        // Each head's keys are copied (widened) once, into the tree that keeps them, and checked
        // there: one pass over the layer's keys instead of a copy of the whole layer first.
        let heads = (0..num_heads)
            .into_par_iter()
            .map(|h| {
                let head_keys = keys.part(h * n * d..(h + 1) * n * d).to_f32_vec_with_room(build_room(n, d));
                check_rows(&head_keys, d, "keys").map_err(|e| match e {
                    Error::Invalid(why) => Error::Invalid(format!("{why} (head {h})")),
                    other => other,
                })?;
                let mut c = cfg.clone();
                c.seed = cfg.seed.map(|s| s.wrapping_add(h as u64));
                HeadPages::build(head_keys, c, page_size)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(HeadForest { heads, page_size, dim: d, len: n })
    }

    pub fn num_heads(&self) -> usize {
        self.heads.len()
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Tokens per head.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn num_pages(&self, head: usize) -> Result<usize> {
        Ok(self.head(head)?.pages.len())
    }

    /// Each head's default search effort (the configured one, or its calibration's).
    pub fn efforts(&self) -> Vec<f32> {
        self.heads.iter().map(|h| h.index.config().effort).collect()
    }

    /// Calibrates each head's default effort (`DciIndex::calibrate`) on the queries of its GQA
    /// group: `queries` is `[q_heads, n, d]` (the runtime's last prompt queries of this layer,
    /// say), and query head `j` belongs to KV head `j / (q_heads / H_kv)`. Recall@`k` counts
    /// against each head's exact scan. Selection scores every key of its field of view, which
    /// holds that of a `k`-query at the same effort when its pool is at least as large
    /// (`max_pages * page_size >= rerank * k * max(effort, 1)`): it then scores at least the
    /// calibrated share of each query's true top-`k` keys. Every head is measured (in parallel) before any changes: on error
    /// nothing changes.
    pub fn calibrate(
        &mut self,
        queries: &[f32],
        q_heads: usize,
        k: usize,
        target: f64,
        efforts: RangeInclusive<f32>,
    ) -> Result<Vec<Calibration>> {
        let h = self.heads.len();
        let rows = check_rows(queries, self.dim, "queries")?;
        ensure!(
            q_heads >= h && q_heads.is_multiple_of(h),
            "queries: {q_heads} query heads are not a multiple of {h} KV heads"
        );
        ensure!(rows.is_multiple_of(q_heads) && rows > 0, "queries must be [{q_heads}, n, {}] with n >= 1", self.dim);
        // A KV head's group of query heads is contiguous in `[q_heads, n, d]`.
        let found = self
            .heads
            .par_iter()
            .zip(queries.par_chunks_exact(rows / h * self.dim))
            .map(|(hp, q)| hp.index.find_effort(KeyData::F32(q), k, target, efforts.clone()))
            .collect::<Result<Vec<_>>>()?;
        for (hp, c) in self.heads.iter_mut().zip(&found) {
            hp.index.apply_calibration(c.clone());
        }
        Ok(found)
    }

    /// Approximate heap bytes of the trees and page layouts (the index's key copy, codes,
    /// projections and cells; each page's token list and key sum; the position map). The page
    /// stores are the caller's and not counted.
    pub fn nbytes(&self) -> usize {
        self.heads
            .iter()
            .map(|hp| {
                let pages: usize = hp.pages.iter().map(|p| p.capacity() * 4 + std::mem::size_of::<Vec<u32>>()).sum();
                let cells: usize =
                    hp.cell_pages.values().map(|p| p.capacity() * 4 + std::mem::size_of::<(u32, Vec<u32>)>()).sum();
                hp.index.stats().bytes
                    + pages
                    + cells
                    + hp.token_page.capacity() * std::mem::size_of::<(u32, u32)>()
                    + hp.page_sum.capacity() * 4
            })
            .sum()
    }

    pub fn max_pages(&self) -> usize {
        self.heads.iter().map(|h| h.pages.len()).max().unwrap_or(0)
    }

    pub fn page_tokens(&self, head: usize, page: usize) -> Result<&[u32]> {
        let h = self.head(head)?;
        ensure!(page < h.pages.len(), "page {page} out of range: head {head} has {} pages", h.pages.len());
        Ok(&h.pages[page])
    }

    /// `(page, slot)` of every token position of `head`.
    pub fn token_map(&self, head: usize) -> Result<&[(u32, u32)]> {
        Ok(&self.head(head)?.token_page)
    }

    /// Checks each head's tree invariants and that every key is tagged with its page (what
    /// selection reads); `Err` names the first one broken. Meant for tests: it walks everything.
    pub fn validate(&self) -> std::result::Result<(), String> {
        for (h, hp) in self.heads.iter().enumerate() {
            hp.index.validate().map_err(|e| format!("head {h}: {e}"))?;
            for (t, &(page, _)) in hp.token_page.iter().enumerate() {
                let tag = hp.index.tag_of(t as i64);
                if tag != page {
                    return Err(format!("head {h}: token {t} lives in page {page} but is tagged {tag}"));
                }
            }
            let mut listed: Vec<u32> = hp.cell_pages.values().flatten().copied().collect();
            listed.sort_unstable();
            if listed != (0..hp.pages.len() as u32).collect::<Vec<_>>() {
                return Err(format!("head {h}: the pages of the leaf cells are not every page once"));
            }
        }
        Ok(())
    }

    fn head(&self, head: usize) -> Result<&HeadPages> {
        self.heads.get(head).ok_or_else(|| {
            Error::Invalid(format!("head {head} out of range: the forest has {} heads", self.heads.len()))
        })
    }

    /// Checks a store's size: `[H_kv, P]` pages of format `F` with `P >= min_pages`; returns `P`.
    fn store_pages<T: Elem, F: Format<T>>(&self, len: usize, what: &str, min_pages: usize) -> Result<usize> {
        let (h, s, d) = (self.heads.len(), self.page_size, self.dim);
        let per_page = F::page_len(s, d);
        ensure!(len.is_multiple_of(h * per_page), "{what} must be {}", F::shape(h, s, d));
        let p = len / (h * per_page);
        ensure!(p >= min_pages, "{what} holds {p} pages per head, needs at least {min_pages}");
        Ok(p)
    }

    /// Writes K and V of every token (`[H_kv, n, d]`, position order) into the page stores;
    /// slots no token fills are zeroed.
    pub fn write_pages<T: Elem>(&self, k_src: &[T], v_src: &[T], k_store: &mut [T], v_store: &mut [T]) -> Result<()> {
        self.write_pages_as::<T, Native>(k_src, v_src, k_store, v_store)
    }

    /// [`HeadForest::write_pages`] into 8-bit stores (`[H_kv, P, int8::page_bytes(page_size,
    /// d)]` bytes): each row quantised to int8 codes and a scale. Values must be finite.
    pub fn write_pages_int8<T: Elem>(
        &self,
        k_src: &[T],
        v_src: &[T],
        k_store: &mut [u8],
        v_store: &mut [u8],
    ) -> Result<()> {
        self.write_pages_as::<T, Int8>(k_src, v_src, k_store, v_store)
    }

    fn write_pages_as<T: Elem, F: Format<T>>(
        &self,
        k_src: &[T],
        v_src: &[T],
        k_store: &mut [F::Cell],
        v_store: &mut [F::Cell],
    ) -> Result<()> {
        let (d, s, h) = (self.dim, self.page_size, self.heads.len());
        for (src, what) in [(k_src, "k_src"), (v_src, "v_src")] {
            ensure!(src.len() == h * self.len * d, "{what} must be [{h}, {}, {d}]", self.len);
            if F::FINITE {
                check_finite(src, what)?;
            }
        }
        let need = self.max_pages();
        let p = self.store_pages::<T, F>(k_store.len(), "k_store", need)?;
        ensure!(v_store.len() == k_store.len(), "v_store must have the shape of k_store");
        let (n, pl) = (self.len, F::page_len(s, d));
        for (src, store) in [(k_src, &mut *k_store), (v_src, &mut *v_store)] {
            store.par_chunks_mut(p * pl).zip(src.par_chunks(n * d)).zip(&self.heads).for_each(|((st, sr), hp)| {
                st.par_chunks_mut(pl).enumerate().for_each(|(page, block)| {
                    let tokens: &[u32] = hp.pages.get(page).map_or(&[], |t| &t[..]);
                    for (slot, &t) in tokens.iter().enumerate() {
                        F::put(block, slot, &sr[t as usize * d..(t as usize + 1) * d], s);
                    }
                    F::clear_from(block, tokens.len(), s, d);
                })
            });
        }
        Ok(())
    }

    /// Appends `m` tokens per head (`keys`/`values` `[H_kv, m, d]`) at positions `len..len + m`:
    /// each joins the tree (parent and level drawn as for any insert) and a page of its leaf cell
    /// (the nearest with room; a full one splits in two). Writes their K/V, and those of tokens a
    /// split moves, into the stores (`P >= max_pages() + m`). Returns the changed pages per head.
    pub fn insert<T: Elem>(
        &mut self,
        keys: &[T],
        values: &[T],
        k_store: &mut [T],
        v_store: &mut [T],
    ) -> Result<Vec<Vec<u32>>> {
        self.insert_as::<T, Native>(keys, values, k_store, v_store)
    }

    /// [`HeadForest::insert`] into 8-bit stores (see [`HeadForest::write_pages_int8`]): new
    /// tokens are quantised; tokens a split moves keep their codes and scales. Values must be
    /// finite.
    pub fn insert_int8<T: Elem>(
        &mut self,
        keys: &[T],
        values: &[T],
        k_store: &mut [u8],
        v_store: &mut [u8],
    ) -> Result<Vec<Vec<u32>>> {
        self.insert_as::<T, Int8>(keys, values, k_store, v_store)
    }

    fn insert_as<T: Elem, F: Format<T>>(
        &mut self,
        keys: &[T],
        values: &[T],
        k_store: &mut [F::Cell],
        v_store: &mut [F::Cell],
    ) -> Result<Vec<Vec<u32>>> {
        let (d, s, h) = (self.dim, self.page_size, self.heads.len());
        ensure!(keys.len().is_multiple_of(h * d) && !keys.is_empty(), "keys must be [{h}, m, {d}] with m >= 1");
        ensure!(values.len() == keys.len(), "values must have the shape of keys");
        let m = keys.len() / (h * d);
        let p = self.store_pages::<T, F>(k_store.len(), "k_store", self.max_pages() + m)?;
        ensure!(v_store.len() == k_store.len(), "v_store must have the shape of k_store");
        let f32_keys = T::keys(keys).to_f32_vec();
        check_rows(&f32_keys, d, "keys")?;
        if F::FINITE {
            check_finite(values, "values")?;
        }
        let start = self.len;
        let pl = F::page_len(s, d);
        let changed = self
            .heads
            .par_iter_mut()
            .zip(k_store.par_chunks_mut(p * pl))
            .zip(v_store.par_chunks_mut(p * pl))
            .enumerate()
            .map(|(hi, ((hp, ks), vs))| {
                let mut changed = Vec::new();
                for i in 0..m {
                    let row = (hi * m + i) * d;
                    let store = Store::<T, F> { k: &mut *ks, v: &mut *vs, d, s, kind: std::marker::PhantomData };
                    hp.insert_one(
                        (start + i) as u32,
                        &f32_keys[row..row + d],
                        (&keys[row..row + d], &values[row..row + d]),
                        store,
                        &mut changed,
                    )?;
                }
                changed.sort_unstable();
                changed.dedup();
                Ok(changed)
            })
            .collect::<Result<Vec<_>>>()?;
        self.len += m;
        Ok(changed)
    }
}

/// One head's K and V page stores, in format `F`.
struct Store<'a, T: Elem, F: Format<T>> {
    k: &'a mut [F::Cell],
    v: &'a mut [F::Cell],
    d: usize,
    s: usize,
    kind: std::marker::PhantomData<(T, F)>,
}

impl<T: Elem, F: Format<T>> Store<'_, T, F> {
    fn page_at(&self, page: u32) -> std::ops::Range<usize> {
        let n = F::page_len(self.s, self.d);
        page as usize * n..(page as usize + 1) * n
    }

    fn write(&mut self, page: u32, slot: u32, k: &[T], v: &[T]) {
        let at = self.page_at(page);
        F::put(&mut self.k[at.clone()], slot as usize, k, self.s);
        F::put(&mut self.v[at], slot as usize, v, self.s);
    }

    /// Copies of one page's K and V blocks.
    fn read_page(&self, page: u32) -> (Vec<F::Cell>, Vec<F::Cell>) {
        let at = self.page_at(page);
        (self.k[at.clone()].to_vec(), self.v[at].to_vec())
    }

    /// Row `from` of the page copies `old` into slot `slot` of `page`.
    fn move_row(&mut self, old: &(Vec<F::Cell>, Vec<F::Cell>), from: usize, page: u32, slot: usize) {
        let at = self.page_at(page);
        F::copy(&old.0, from, &mut self.k[at.clone()], slot, self.s, self.d);
        F::copy(&old.1, from, &mut self.v[at], slot, self.s, self.d);
    }

    fn clear_page(&mut self, page: u32) {
        let at = self.page_at(page);
        F::clear_from(&mut self.k[at.clone()], 0, self.s, self.d);
        F::clear_from(&mut self.v[at], 0, self.s, self.d);
    }
}

impl HeadPages {
    fn build(keys: Vec<f32>, cfg: Config, page_size: usize) -> Result<HeadPages> {
        let d = cfg.dim;
        let n = keys.len() / d;
        let mut index = DciIndex::new(cfg)?;
        index.build_positions(keys);
        let mut hp = HeadPages {
            pages: Vec::new(),
            token_page: vec![(u32::MAX, 0); n],
            page_sum: Vec::new(),
            cell_pages: HashMap::new(),
            leaf_rebuilds: 0,
            index,
        };
        let keys = hp.index.built_keys();
        let key = |t: u32| &keys[t as usize * d..(t as usize + 1) * d];
        let cells: Vec<(u32, &[u32])> = hp.index.leaf_cells().collect();
        let split: Vec<(u32, Vec<Vec<u32>>, Vec<f32>)> = cells
            .par_iter()
            .map_init(SplitScratch::default, |scratch, &(cell, members)| {
                let mut tokens: Vec<u32> = members.iter().map(|&m| hp.index.slot_id(m) as u32).collect();
                let (mut groups, mut sums) = (Vec::new(), Vec::new());
                split_pages(&mut tokens, &key, d, page_size, &mut groups, &mut sums, scratch);
                (cell, groups, sums)
            })
            .collect();
        drop(cells);
        // The page sums are those the split made from the keys it gathered.
        for (cell, groups, sums) in split {
            for (tokens, sum) in groups.into_iter().zip(sums.chunks_exact(d)) {
                hp.push_page(cell, tokens, sum);
            }
        }
        let token_page = &hp.token_page;
        hp.index.set_tags(|id| token_page[id as usize].0);
        hp.leaf_rebuilds = hp.index.leaf_rebuilds();
        Ok(hp)
    }

    /// After the index rebuilt its leaves (an insert can make it, as it grows): each page
    /// belongs to the leaf cell that holds most of its tokens now. Pages keep their tokens (the
    /// stores and what the device holds stay valid); only where new keys look changes.
    fn follow_leaf_rebuild(&mut self) {
        self.cell_pages.clear();
        let mut count: HashMap<u32, usize> = HashMap::new();
        for (p, tokens) in self.pages.iter().enumerate() {
            count.clear();
            for &t in tokens {
                *count.entry(self.index.leaf_cell_of(t as i64)).or_default() += 1;
            }
            let cell = count.iter().max_by_key(|&(&c, &n)| (n, std::cmp::Reverse(c))).map(|(&c, _)| c);
            if let Some(cell) = cell {
                self.cell_pages.entry(cell).or_default().push(p as u32);
            }
        }
        self.leaf_rebuilds = self.index.leaf_rebuilds();
    }

    /// Registers a new page of `cell` holding `tokens`; returns its id.
    fn add_page<'k>(&mut self, cell: u32, tokens: Vec<u32>, key: &impl Fn(u32) -> &'k [f32]) -> u32 {
        let mut sum = vec![0f32; self.index.dim()];
        for &t in &tokens {
            sum.iter_mut().zip(key(t)).for_each(|(a, b)| *a += b);
        }
        self.push_page(cell, tokens, &sum)
    }

    /// Registers a new page of `cell` holding `tokens` (in slot order), whose keys sum to
    /// `sum`; returns its id.
    fn push_page(&mut self, cell: u32, tokens: Vec<u32>, sum: &[f32]) -> u32 {
        let id = self.pages.len() as u32;
        for (slot, &t) in tokens.iter().enumerate() {
            self.token_page[t as usize] = (id, slot as u32);
        }
        self.pages.push(tokens);
        self.page_sum.extend_from_slice(sum);
        self.cell_pages.entry(cell).or_default().push(id);
        id
    }

    /// Makes page `id` hold exactly `tokens` (in slot order), updating the maps and its sum.
    fn set_page<'k>(&mut self, id: u32, tokens: Vec<u32>, key: &impl Fn(u32) -> &'k [f32]) {
        let d = self.index.dim();
        let sum = &mut self.page_sum[id as usize * d..(id as usize + 1) * d];
        sum.fill(0.0);
        for (slot, &t) in tokens.iter().enumerate() {
            self.token_page[t as usize] = (id, slot as u32);
            sum.iter_mut().zip(key(t)).for_each(|(a, b)| *a += b);
        }
        if (id as usize) < self.pages.len() {
            self.pages[id as usize] = tokens;
        } else {
            self.pages.push(tokens);
        }
    }

    /// Tags each token of `page` with it in the index: selection reads pages off its scans.
    fn tag_page(&mut self, page: u32) {
        for &t in &self.pages[page as usize] {
            self.index.set_tag(t as i64, page);
        }
    }

    fn insert_one<T: Elem, F: Format<T>>(
        &mut self,
        pos: u32,
        key: &[f32],
        kv: (&[T], &[T]),
        mut store: Store<'_, T, F>,
        changed: &mut Vec<u32>,
    ) -> Result<()> {
        let (d, s) = (store.d, store.s);
        self.index.add(KeyData::F32(key), Some(&[pos as i64]))?;
        self.token_page.push((u32::MAX, 0));
        if self.index.leaf_rebuilds() != self.leaf_rebuilds {
            self.follow_leaf_rebuild();
        }
        let cell = self.index.leaf_cell_of(pos as i64);
        // The nearest of the cell's pages by centroid, preferring pages with room.
        let dist = |p: u32| {
            let n = self.pages[p as usize].len() as f32;
            let c = &self.page_sum[p as usize * d..(p as usize + 1) * d];
            c.iter().zip(key).map(|(a, b)| (a / n - b) * (a / n - b)).sum::<f32>()
        };
        let pages = self.cell_pages.get(&cell).map_or(&[][..], |v| &v[..]);
        let best = |room: bool| {
            pages
                .iter()
                .copied()
                .filter(|&p| !room || self.pages[p as usize].len() < s)
                .min_by(|&a, &b| dist(a).total_cmp(&dist(b)))
        };
        match (best(true), best(false)) {
            (Some(p), _) => {
                let slot = self.pages[p as usize].len() as u32;
                self.pages[p as usize].push(pos);
                self.token_page[pos as usize] = (p, slot);
                self.index.set_tag(pos as i64, p);
                self.page_sum[p as usize * d..(p as usize + 1) * d].iter_mut().zip(key).for_each(|(a, b)| *a += b);
                store.write(p, slot, kv.0, kv.1);
                changed.push(p);
            }
            (None, Some(full)) => {
                // Split the full page and the new token into two tight pages.
                let old = store.read_page(full);
                let mut tokens = self.pages[full as usize].clone();
                let old_slot: HashMap<u32, usize> = tokens.iter().enumerate().map(|(i, &t)| (t, i)).collect();
                tokens.push(pos);
                // The new token is in the index already. Copies, because the page maps are
                // updated below while the keys are still read.
                let owned: HashMap<u32, Vec<f32>> =
                    tokens.iter().map(|&t| (t, self.index.key_of_id(t as i64).to_vec())).collect();
                let key_ref = |t: u32| &owned[&t][..];
                let mut groups = Vec::new();
                let half = tokens.len().div_ceil(2);
                let mut sums = Vec::new(); // `set_page` sums the pages itself
                split_pages(&mut tokens, &key_ref, d, half, &mut groups, &mut sums, &mut SplitScratch::default());
                debug_assert_eq!(groups.len(), 2);
                let second = groups.pop().unwrap();
                let first = groups.pop().unwrap();
                self.set_page(full, first, &key_ref);
                let new = self.add_page(cell, second, &key_ref);
                for page in [full, new] {
                    self.tag_page(page);
                    store.clear_page(page);
                    for (slot, &t) in self.pages[page as usize].iter().enumerate() {
                        match old_slot.get(&t) {
                            Some(&o) => store.move_row(&old, o, page, slot),
                            None => store.write(page, slot as u32, kv.0, kv.1),
                        }
                    }
                    changed.push(page);
                }
            }
            (None, None) => {
                let p = self.add_page(cell, vec![pos], &|_| key);
                self.index.set_tag(pos as i64, p);
                store.write(p, 0, kv.0, kv.1);
                changed.push(p);
            }
        }
        Ok(())
    }
}
