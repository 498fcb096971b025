//! Semantic pages (docs/ARCHITECTURE.md, section Pages): one tree per KV head of one layer of
//! one sequence; the leaf cells of an M-DCI tree over the keys (keys near one parent), split
//! into runs of at most `page_size` keys that are near each other, are the physical pages of the
//! CPU KV store, and each key is kept once, as its page's int8 K row ([`head`]).
//!
//! Page stores are `[H_kv, P, page_size, d]` arrays (K and V apart) in the tokens' element type,
//! or, for 8-bit pages, `[H_kv, P, int8::page_bytes(page_size, d)]` bytes (see [`int8`]), or 8-bit
//! K pages beside 4-bit V pages (`[H_kv, P, value4::page_bytes(page_size, d)]` bytes, see
//! [`value4`]); owned by the caller, this module writes them but never allocates them.

mod cells;
mod fingerprint;
mod head;
pub mod int8;
mod split;
pub mod value4;

use std::ops::RangeInclusive;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{ensure, Error, Result};
use crate::index::{check_search, search_effort, Calibration, Config, Metric, Scratch};
use crate::input::{check_rows, KeyData};
pub(crate) use head::HeadPages;

/// Allowed page sizes.
pub const PAGE_SIZES: std::ops::RangeInclusive<usize> = 8..=64;

/// An element of K/V tokens: f32, f16, or bf16 carried as its u16 bits.
pub trait Elem: bytemuck::Pod + Default + Send + Sync {
    /// The exponent bits: all set in NaN and infinities only.
    const EXP_MASK: u32;
    fn keys(s: &[Self]) -> KeyData<'_>;
    fn to_f32(self) -> f32;
    fn bits(self) -> u32;
}

impl Elem for f32 {
    const EXP_MASK: u32 = 0x7f80_0000;
    fn keys(s: &[f32]) -> KeyData<'_> {
        KeyData::F32(s)
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl Elem for f16 {
    const EXP_MASK: u32 = 0x7c00;
    fn keys(s: &[f16]) -> KeyData<'_> {
        KeyData::F16(s)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

impl Elem for u16 {
    const EXP_MASK: u32 = 0x7f80;
    fn keys(s: &[u16]) -> KeyData<'_> {
        KeyData::Bf16(half::slice::HalfBitsSliceExt::reinterpret_cast::<bf16>(s))
    }
    fn to_f32(self) -> f32 {
        bf16::from_bits(self).to_f32()
    }
    fn bits(self) -> u32 {
        self as u32
    }
}

/// The key sum (`fingerprint`) of `keys` at positions `start..`, in their own element type.
fn key_sum_of(keys: KeyData<'_>, d: usize, start: usize) -> Option<u64> {
    match keys {
        KeyData::F32(s) => fingerprint::key_sum(s, d, start),
        KeyData::F16(s) => fingerprint::key_sum(s, d, start),
        KeyData::Bf16(s) => fingerprint::key_sum(half::slice::HalfFloatSliceExt::reinterpret_cast(s), d, start),
    }
}

/// How a layer's page stores hold K and V rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageFormat {
    /// In the tokens' element type: `[H_kv, P, page_size, d]`.
    Native,
    /// int8 codes and an f32 scale per row: `[H_kv, P, int8::page_bytes(page_size, d)]` bytes.
    Int8,
    /// K as in `Int8`; V as 4-bit codes in groups with a step and minimum each:
    /// `[H_kv, P, value4::page_bytes(page_size, d)]` bytes.
    K8V4,
}

impl PageFormat {
    /// `"native"` or `"int8"`, as `IceCacheConfig.page_format` names them.
    pub fn parse(s: &str) -> Result<PageFormat> {
        match s {
            "native" => Ok(PageFormat::Native),
            "int8" => Ok(PageFormat::Int8),
            "k8v4" => Ok(PageFormat::K8V4),
            other => {
                Err(Error::Invalid(format!("page_format must be \"native\", \"int8\" or \"k8v4\", not {other:?}")))
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PageFormat::Native => "native",
            PageFormat::Int8 => "int8",
            PageFormat::K8V4 => "k8v4",
        }
    }

    /// Bytes of one K page of `page_size` rows of `dim` elements of `elem_size` bytes.
    pub fn k_page_bytes(self, page_size: usize, dim: usize, elem_size: usize) -> usize {
        match self {
            PageFormat::Native => page_size * dim * elem_size,
            PageFormat::Int8 | PageFormat::K8V4 => int8::page_bytes(page_size, dim),
        }
    }

    /// Bytes of one V page (as `k_page_bytes`).
    pub fn v_page_bytes(self, page_size: usize, dim: usize, elem_size: usize) -> usize {
        match self {
            PageFormat::K8V4 => value4::page_bytes(page_size, dim),
            other => other.k_page_bytes(page_size, dim, elem_size),
        }
    }

    /// Whether the K store holds the keys' int8 rows (the index reads them there).
    pub fn k_is_int8(self) -> bool {
        self != PageFormat::Native
    }
}

/// A forest's K and V page stores (module docs), in one of the [`PageFormat`]s.
pub enum Stores<'a, T> {
    /// `[H_kv, P, page_size, d]` elements of the tokens' type.
    Native(&'a mut [T], &'a mut [T]),
    /// `[H_kv, P, int8::page_bytes(page_size, d)]` bytes.
    Int8(&'a mut [u8], &'a mut [u8]),
    /// K as in `Int8`; V `[H_kv, P, value4::page_bytes(page_size, d)]` bytes.
    K8V4(&'a mut [u8], &'a mut [u8]),
}

impl<T: Elem> Stores<'_, T> {
    pub fn format(&self) -> PageFormat {
        match self {
            Stores::Native(..) => PageFormat::Native,
            Stores::Int8(..) => PageFormat::Int8,
            Stores::K8V4(..) => PageFormat::K8V4,
        }
    }

    /// Rewrites page `at` (counted over every head's pages: `head · P + page`) of both stores
    /// from `rows`, the K and V rows of its tokens in slot order; the slots past them are
    /// zeroed. 8-bit stores quantise the rows, which must be finite.
    pub fn rewrite_page(&mut self, at: usize, rows: &[(&[T], &[T])], page_size: usize, dim: usize) -> Result<()> {
        fn rewrite<T: Elem, K: Format<T>, V: Format<T>>(
            k: &mut [K::Cell],
            v: &mut [V::Cell],
            at: usize,
            rows: &[(&[T], &[T])],
            (s, d): (usize, usize),
        ) -> Result<()> {
            let (kl, vl) = (K::page_len(s, d), V::page_len(s, d));
            ensure!(k.len() / kl == v.len() / vl && (at + 1) * kl <= k.len(), "page {at} beyond the stores");
            ensure!(rows.len() <= s, "a page holds at most {s} tokens, not {}", rows.len());
            ensure!(rows.iter().all(|(kr, vr)| kr.len() == d && vr.len() == d), "rows must have {d} elements");
            let finite = |row: &[T]| row.iter().all(|x| x.to_f32().is_finite());
            let ok = rows.iter().all(|(kr, vr)| (!K::FINITE || finite(kr)) && (!V::FINITE || finite(vr)));
            ensure!(ok, "quantised pages hold finite values only");
            let (kp, vp) = (&mut k[at * kl..(at + 1) * kl], &mut v[at * vl..(at + 1) * vl]);
            K::clear_from(kp, 0, s, d);
            V::clear_from(vp, 0, s, d);
            for (slot, (kr, vr)) in rows.iter().enumerate() {
                K::put(kp, slot, kr, s);
                V::put(vp, slot, vr, s);
            }
            Ok(())
        }
        match self {
            Stores::Native(k, v) => rewrite::<T, Native, Native>(k, v, at, rows, (page_size, dim)),
            Stores::Int8(k, v) => rewrite::<T, Int8, Int8>(k, v, at, rows, (page_size, dim)),
            Stores::K8V4(k, v) => rewrite::<T, Int8, Value4>(k, v, at, rows, (page_size, dim)),
        }
    }
}

/// How page stores hold rows of `T`: each page is `page_len(s, d)` cells.
pub(crate) trait Format<T: Elem> {
    type Cell: bytemuck::Pod + Default + Send + Sync;
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
    /// The store as int8 K rows, when it holds them (8-bit stores).
    fn codes(store: &[Self::Cell]) -> Option<&[u8]>;
}

/// Calls `f` with `row` widened to f32, on the stack (head dims are at most a few hundred).
fn widened<T: Elem>(row: &[T], f: impl FnOnce(&[f32])) {
    let mut stack = [0f32; 512];
    let mut heap = Vec::new();
    let wide = if row.len() <= stack.len() {
        &mut stack[..row.len()]
    } else {
        heap.resize(row.len(), 0.0);
        &mut heap[..]
    };
    wide.iter_mut().zip(row).for_each(|(w, x)| *w = x.to_f32());
    f(wide)
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
    fn codes(_store: &[T]) -> Option<&[u8]> {
        None
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
        widened(row, |wide| int8::put_row(page, slot, wide, s));
    }
    fn copy(src: &[u8], from: usize, dst: &mut [u8], to: usize, s: usize, d: usize) {
        int8::copy_row(src, from, dst, to, s, d);
    }
    fn clear_from(page: &mut [u8], from: usize, s: usize, d: usize) {
        page[from * d..s * d].fill(0);
        page[s * d + from * int8::SCALE_BYTES..].fill(0);
    }
    fn codes(store: &[u8]) -> Option<&[u8]> {
        Some(store)
    }
}

/// 4-bit V stores: `[H_kv, P, value4::page_bytes(page_size, d)]` bytes (see [`value4`]).
pub(crate) struct Value4;

impl<T: Elem> Format<T> for Value4 {
    type Cell = u8;
    const FINITE: bool = true;
    fn page_len(s: usize, d: usize) -> usize {
        value4::page_bytes(s, d)
    }
    fn shape(h: usize, s: usize, d: usize) -> String {
        format!("[{h}, P, {}] bytes", value4::page_bytes(s, d))
    }
    fn put(page: &mut [u8], slot: usize, row: &[T], s: usize) {
        widened(row, |wide| value4::put_row(page, slot, wide, s));
    }
    fn copy(src: &[u8], from: usize, dst: &mut [u8], to: usize, s: usize, d: usize) {
        value4::copy_row(src, from, dst, to, s, d);
    }
    fn clear_from(page: &mut [u8], from: usize, s: usize, d: usize) {
        value4::clear_from(page, from, s, d);
    }
    fn codes(_store: &[u8]) -> Option<&[u8]> {
        None
    }
}

/// `Err` unless every element of `rows` is finite (what 8-bit pages can hold).
fn check_finite<T: Elem>(rows: &[T], what: &str) -> Result<()> {
    ensure!(rows.iter().all(|x| x.to_f32().is_finite()), "{what}: 8-bit pages hold finite values only");
    Ok(())
}

/// One tree and page layout per KV head. See the module docs.
pub struct HeadForest {
    pub(crate) heads: Vec<HeadPages>,
    page_size: usize,
    dim: usize,
    len: usize,
    format: PageFormat,
    /// `Config::rerank`: calibration measures the field of view of `rerank · k` tokens.
    rerank: usize,
    /// Per head, the key sum of its keys (`fingerprint`).
    key_sums: Vec<u64>,
    /// Per head, the mark of the K store that holds this forest's keys (`fingerprint`); `None`
    /// until `write_pages` has written them.
    store_marks: Mutex<Option<Vec<u32>>>,
}

/// Hands the memory a build freed back to the OS. Each head's build frees a float32 copy of its
/// keys and a tree over them in the arena of the pool thread that built it, and glibc keeps
/// such memory in the process: after 4 forests of 8 heads x 32k keys at `d = 128` it held 0.70x
/// their bf16 K+V instead of 0.60x (benches/RESULTS.md, section "The staging copy"). About 3 ms
/// there.
fn release_free_memory() {
    // SAFETY: `malloc_trim` only returns free memory to the OS and may be called from any
    // thread at any time.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::malloc_trim(0);
    }
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

    /// Builds the trees (in parallel, one per head) and pages over `keys` `[num_heads, n, dim]`
    /// for page stores of `format`. `cfg.metric` must be inner product (attention); `cfg.seed`
    /// seeds head `h` with `seed + h`. With 16-bit stores (`Native`) each head keeps its keys'
    /// int8 rows itself; with 8-bit stores the K store holds them, and the forest reads them
    /// there once `write_pages` has written it.
    pub fn build(
        keys: KeyData<'_>,
        num_heads: usize,
        cfg: Config,
        page_size: usize,
        format: PageFormat,
    ) -> Result<HeadForest> {
        ensure!(PAGE_SIZES.contains(&page_size), "page_size must be in {PAGE_SIZES:?}, got {page_size}");
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
        // Each head's keys are widened once, into the build that reads them, and checked there:
        // one pass over the layer's keys instead of a copy of the whole layer first.
        let heads = (0..num_heads)
            .into_par_iter()
            .map(|h| {
                let part = keys.part(h * n * d..(h + 1) * n * d);
                let head_keys = part.to_f32_vec();
                check_rows(&head_keys, d, "keys").map_err(|e| match e {
                    Error::Invalid(why) => Error::Invalid(format!("{why} (head {h})")),
                    other => other,
                })?;
                // Finite: checked just above.
                let key_sum = key_sum_of(part, d, 0).unwrap_or_default();
                let mut c = cfg.clone();
                c.seed = cfg.seed.map(|s| s.wrapping_add(h as u64));
                Ok((HeadPages::build(head_keys, &c, page_size, format == PageFormat::Native)?, key_sum))
            })
            .collect::<Result<Vec<_>>>();
        release_free_memory();
        let (heads, key_sums) = heads?.into_iter().unzip();
        Ok(HeadForest {
            heads,
            page_size,
            dim: d,
            len: n,
            format,
            rerank: cfg.rerank,
            key_sums,
            store_marks: Mutex::new(None),
        })
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

    /// The format of the page stores this forest writes (and, for `Int8`, reads its keys from).
    pub fn format(&self) -> PageFormat {
        self.format
    }

    /// Tokens per head.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn num_pages(&self, head: usize) -> Result<usize> {
        Ok(self.head(head)?.num_pages())
    }

    /// Each head's default search effort (the configured one, or its calibration's).
    pub fn efforts(&self) -> Vec<f32> {
        self.heads.iter().map(|h| h.effort).collect()
    }

    /// Each head's int8 K rows: its own (16-bit stores, `k_store` `None`), or the 8-bit
    /// `k_store`'s (`[H_kv, P, page bytes]`, the store `write_pages` wrote).
    pub(crate) fn codes<'a>(&'a self, k_store: Option<&'a [u8]>) -> Result<Vec<int8::PageCodes<'a>>> {
        match (self.format, k_store) {
            (PageFormat::Native, None) => Ok(self.heads.iter().map(|hp| hp.codes(None)).collect()),
            (PageFormat::Native, Some(_)) => {
                Err(Error::Invalid("a forest of 16-bit pages keeps its own codes: pass no k_store".into()))
            }
            (_, None) => {
                Err(Error::Invalid("a forest of 8-bit K pages reads its keys from the K store: pass k_store".into()))
            }
            (_, Some(store)) => {
                let p = self.store_pages::<f32, Int8>(store.len(), "k_store", self.max_pages())?;
                self.check_own_store(store, p, int8::page_bytes(self.page_size, self.dim))?;
                let per_head = p * int8::page_bytes(self.page_size, self.dim);
                Ok(self.heads.iter().zip(store.chunks_exact(per_head)).map(|(hp, s)| hp.codes(Some(s))).collect())
            }
        }
    }

    /// Calibrates each head's default effort on the queries of its GQA group: `queries` is
    /// `[q_heads, n, d]` (the runtime's last prompt queries of this layer, say), and query head
    /// `j` belongs to KV head `j / (q_heads / H_kv)`. A query's recall@`k` is the share of its
    /// `k` best keys (scored from their stored int8 rows, as selection scores them) in the
    /// field of view of a selection of `rerank · k` tokens (`Config::rerank`, 2: the pool of a
    /// `k`-query) at that effort; efforts are searched as `DciIndex::calibrate` does. `k_store`
    /// as for `select`. Every head is measured (in parallel) before any changes: on error
    /// nothing changes.
    pub fn calibrate(
        &mut self,
        queries: &[f32],
        q_heads: usize,
        k: usize,
        target: f64,
        efforts: RangeInclusive<f32>,
        k_store: Option<&[u8]>,
    ) -> Result<Vec<Calibration>> {
        let t0 = Instant::now();
        let h = self.heads.len();
        let rows = check_rows(queries, self.dim, "queries")?;
        ensure!(
            q_heads >= h && q_heads.is_multiple_of(h),
            "queries: {q_heads} query heads are not a multiple of {h} KV heads"
        );
        ensure!(rows.is_multiple_of(q_heads) && rows > 0, "queries must be [{q_heads}, n, {}] with n >= 1", self.dim);
        ensure!(k >= 1, "k must be at least 1, got {k}");
        ensure!(k <= self.len, "k = {k} is larger than the number of tokens per head ({})", self.len);
        check_search(target, &efforts)?;
        let codes = self.codes(k_store)?;
        let pool = self.rerank.saturating_mul(k);
        // A KV head's group of query heads is contiguous in `[q_heads, n, d]`.
        let found = self
            .heads
            .par_iter()
            .zip(&codes)
            .zip(queries.par_chunks_exact(rows / h * self.dim))
            .map(|((hp, codes), q)| {
                let truth = hp.best_keys(*codes, q, k);
                search_effort(target, efforts.clone(), k, truth.len(), t0, |effort| {
                    Ok(hp.view_recall(q, &truth, pool, effort))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for (hp, c) in self.heads.iter_mut().zip(&found) {
            hp.effort = c.effort;
        }
        Ok(found)
    }

    /// Approximate heap bytes of the trees and page layouts (and, for 16-bit stores, each head's
    /// int8 K rows). The page stores are the caller's and not counted.
    pub fn nbytes(&self) -> usize {
        self.heads.iter().map(|hp| hp.nbytes()).sum()
    }

    pub fn max_pages(&self) -> usize {
        self.heads.iter().map(|h| h.num_pages()).max().unwrap_or(0)
    }

    pub fn page_tokens(&self, head: usize, page: usize) -> Result<&[u32]> {
        let h = self.head(head)?;
        ensure!(page < h.num_pages(), "page {page} out of range: head {head} has {} pages", h.num_pages());
        Ok(h.page_tokens(page as u32))
    }

    /// `(page, slot)` of every token position of `head`.
    pub fn token_map(&self, head: usize) -> Result<Vec<(u32, u32)>> {
        let h = self.head(head)?;
        let mut map = vec![(0, 0); h.len()];
        for p in 0..h.num_pages() as u32 {
            for (slot, &t) in h.page_tokens(p).iter().enumerate() {
                map[t as usize] = (p, slot as u32);
            }
        }
        Ok(map)
    }

    /// Checks each head's invariants (`HeadPages::validate`); `Err` names the first one
    /// broken. Meant for tests: it walks everything.
    pub fn validate(&self) -> std::result::Result<(), String> {
        for (h, hp) in self.heads.iter().enumerate() {
            hp.validate().map_err(|e| format!("head {h}: {e}"))?;
            if hp.len() != self.len {
                return Err(format!("head {h} holds {} tokens, the forest {}", hp.len(), self.len));
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

    /// Checks a pair of stores (`K`, `V`) of the same number of pages, at least `min_pages`;
    /// returns that number.
    fn store_pair<T: Elem, K: Format<T>, V: Format<T>>(
        &self,
        k_len: usize,
        v_len: usize,
        min_pages: usize,
    ) -> Result<usize> {
        let p = self.store_pages::<T, K>(k_len, "k_store", min_pages)?;
        let (h, s, d) = (self.heads.len(), self.page_size, self.dim);
        ensure!(
            v_len == p * h * V::page_len(s, d),
            "v_store must hold as many pages as k_store: {}",
            V::shape(h, s, d)
        );
        Ok(p)
    }

    fn marks(&self) -> MutexGuard<'_, Option<Vec<u32>>> {
        // Nothing panics while holding it; a poisoned lock still guards a consistent value.
        self.store_marks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Err` unless `k_store` (`[H_kv, p]` pages of `page_len` cells) holds this forest's keys:
    /// it is the K store `write_pages` wrote them to (and inserts went to), or a copy of it.
    fn check_own_store<C: bytemuck::Pod>(&self, k_store: &[C], p: usize, page_len: usize) -> Result<()> {
        match &*self.marks() {
            None => Err(Error::Invalid("the page stores have not been written yet (write_pages first)".into())),
            Some(marks) => {
                ensure!(
                    *marks == store_marks(k_store, p, page_len),
                    "k_store does not hold this forest's pages: pass the K store write_pages wrote (or a copy)"
                );
                Ok(())
            }
        }
    }

    /// `Err` unless `stores` are of this forest's format.
    fn check_format<T: Elem>(&self, stores: &Stores<'_, T>) -> Result<()> {
        ensure!(
            stores.format() == self.format,
            "this forest was built for {} page stores, not {}",
            self.format.name(),
            stores.format().name()
        );
        Ok(())
    }

    /// Writes K and V of every token (`[H_kv, n, d]`, position order) into the page stores;
    /// slots of the forest's pages that no token fills are zeroed, pages past them (the
    /// stores' room for inserts) are left as they are. The stores must be of the forest's
    /// format; 8-bit stores quantise each row to int8 codes and a scale (values must be
    /// finite), and the forest reads its keys from this K store from then on.
    ///
    /// `k_src` must be finite and the forest's own keys (its key sums, `fingerprint`): those
    /// stores become the forest's. Other keys only go into other stores once the forest's own
    /// were written: a layer that reuses this layout writes its own keys into its own stores.
    pub fn write_pages<T: Elem>(&self, k_src: &[T], v_src: &[T], stores: Stores<'_, T>) -> Result<()> {
        self.check_format(&stores)?;
        match stores {
            Stores::Native(k_store, v_store) => {
                self.write_pages_as::<T, Native, Native>(k_src, v_src, k_store, v_store)
            }
            Stores::Int8(k_store, v_store) => self.write_pages_as::<T, Int8, Int8>(k_src, v_src, k_store, v_store),
            Stores::K8V4(k_store, v_store) => self.write_pages_as::<T, Int8, Value4>(k_src, v_src, k_store, v_store),
        }
    }

    fn write_pages_as<T: Elem, K: Format<T>, V: Format<T>>(
        &self,
        k_src: &[T],
        v_src: &[T],
        k_store: &mut [K::Cell],
        v_store: &mut [V::Cell],
    ) -> Result<()> {
        let (d, s, h) = (self.dim, self.page_size, self.heads.len());
        for (src, what) in [(k_src, "k_src"), (v_src, "v_src")] {
            ensure!(src.len() == h * self.len * d, "{what} must be [{h}, {}, {d}]", self.len);
            if K::FINITE || V::FINITE {
                check_finite(src, what)?;
            }
        }
        let need = self.max_pages();
        let p = self.store_pair::<T, K, V>(k_store.len(), v_store.len(), need)?;
        let (n, pl) = (self.len, K::page_len(s, d));
        let sums = k_src.par_chunks(n * d).map(|head| fingerprint::key_sum(head, d, 0)).collect::<Option<Vec<_>>>();
        let Some(sums) = sums else {
            return Err(Error::Invalid("k_src: keys must be finite (no NaN or infinity)".into()));
        };
        let own_keys = sums == self.key_sums;
        if !own_keys {
            // Another layer's keys, in this forest's layout, go into that layer's stores only.
            let marks = self.marks();
            ensure!(
                marks.as_ref().is_some_and(|m| *m != store_marks(k_store, p, pl)),
                "k_src holds other keys than this forest was built on: only the stores of a layer that \
                 reuses its page layout take other keys, after this forest's own were written"
            );
        }
        self.write_store::<T, K>(k_src, k_store, p);
        self.write_store::<T, V>(v_src, v_store, p);
        if own_keys {
            *self.marks() = Some(store_marks(k_store, p, pl));
        }
        Ok(())
    }

    /// `write_pages` for one store of `p` pages per head, in format `F`.
    fn write_store<T: Elem, F: Format<T>>(&self, src: &[T], store: &mut [F::Cell], p: usize) {
        let (d, s, n) = (self.dim, self.page_size, self.len);
        let pl = F::page_len(s, d);
        store.par_chunks_mut(p * pl).zip(src.par_chunks(n * d)).zip(&self.heads).for_each(|((st, sr), hp)| {
            st[..hp.num_pages() * pl].par_chunks_mut(pl).enumerate().for_each(|(page, block)| {
                let tokens = hp.page_tokens(page as u32);
                for (slot, &t) in tokens.iter().enumerate() {
                    F::put(block, slot, &sr[t as usize * d..(t as usize + 1) * d], s);
                }
                F::clear_from(block, tokens.len(), s, d);
            })
        });
    }

    /// Appends `m` tokens per head (`keys`/`values` `[H_kv, m, d]`) at positions `len..len + m`:
    /// each joins the tree and a page of its cell (`HeadPages::insert`). Writes their K/V, and
    /// those of tokens a split moves, into the stores (`P >= max_pages() + m`, the forest's
    /// format, the ones `write_pages` wrote the forest's keys to or a copy; 8-bit stores: new
    /// tokens are quantised, tokens a split moves keep their codes and scales, values must be
    /// finite). Returns the changed pages per head.
    pub fn insert<T: Elem>(&mut self, keys: &[T], values: &[T], stores: Stores<'_, T>) -> Result<Vec<Vec<u32>>> {
        self.check_format(&stores)?;
        match stores {
            Stores::Native(k_store, v_store) => self.insert_as::<T, Native, Native>(keys, values, k_store, v_store),
            Stores::Int8(k_store, v_store) => self.insert_as::<T, Int8, Int8>(keys, values, k_store, v_store),
            Stores::K8V4(k_store, v_store) => self.insert_as::<T, Int8, Value4>(keys, values, k_store, v_store),
        }
    }

    fn insert_as<T: Elem, K: Format<T>, V: Format<T>>(
        &mut self,
        keys: &[T],
        values: &[T],
        k_store: &mut [K::Cell],
        v_store: &mut [V::Cell],
    ) -> Result<Vec<Vec<u32>>> {
        let (d, s, h) = (self.dim, self.page_size, self.heads.len());
        ensure!(keys.len().is_multiple_of(h * d) && !keys.is_empty(), "keys must be [{h}, m, {d}] with m >= 1");
        ensure!(values.len() == keys.len(), "values must have the shape of keys");
        let m = keys.len() / (h * d);
        let p = self.store_pair::<T, K, V>(k_store.len(), v_store.len(), self.max_pages() + m)?;
        let f32_keys = T::keys(keys).to_f32_vec();
        check_rows(&f32_keys, d, "keys")?;
        if V::FINITE {
            check_finite(values, "values")?;
        }
        let (pl, vl) = (K::page_len(s, d), V::page_len(s, d));
        self.check_own_store(k_store, p, pl)?;
        let start = self.len;
        let inserted = self
            .heads
            .par_iter_mut()
            .zip(k_store.par_chunks_mut(p * pl))
            .zip(v_store.par_chunks_mut(p * vl))
            .enumerate()
            .map(|(hi, ((hp, ks), vs))| {
                let mut changed = Vec::new();
                let mut scratch = Scratch::default();
                let mut store = Store::<T, K, V> { k: ks, v: vs, d, s, kind: std::marker::PhantomData };
                for i in 0..m {
                    let row = (hi * m + i) * d;
                    hp.insert(
                        (start + i) as u32,
                        &f32_keys[row..row + d],
                        (&keys[row..row + d], &values[row..row + d]),
                        &mut store,
                        &mut scratch,
                        &mut changed,
                    )?;
                }
                changed.sort_unstable();
                changed.dedup();
                // Finite: `check_rows` above.
                Ok((changed, fingerprint::key_sum(&keys[hi * m * d..(hi + 1) * m * d], d, start).unwrap_or_default()))
            })
            .collect::<Result<Vec<_>>>()?;
        self.len += m;
        let (changed, sums): (Vec<_>, Vec<_>) = inserted.into_iter().unzip();
        for (sum, new) in self.key_sums.iter_mut().zip(sums) {
            *sum = sum.wrapping_add(new);
        }
        // The inserts (or the splits they made) may have changed page 0.
        *self.store_marks.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(store_marks(k_store, p, pl));
        Ok(changed)
    }
}

/// Each head's mark of `k_store` (`[H_kv, p]` pages of `page_len` cells): its page 0's.
fn store_marks<C: bytemuck::Pod>(k_store: &[C], p: usize, page_len: usize) -> Vec<u32> {
    k_store
        .chunks_exact(p * page_len)
        .map(|head| fingerprint::page_mark(bytemuck::cast_slice(&head[..page_len])))
        .collect()
}

/// One head's K and V page stores, in formats `K` and `V`.
pub(crate) struct Store<'a, T: Elem, K: Format<T>, V: Format<T>> {
    k: &'a mut [K::Cell],
    v: &'a mut [V::Cell],
    d: usize,
    s: usize,
    kind: std::marker::PhantomData<(T, K, V)>,
}

/// Copies of one page's K and V blocks.
type PageCopy<T, K, V> = (Vec<<K as Format<T>>::Cell>, Vec<<V as Format<T>>::Cell>);

impl<T: Elem, K: Format<T>, V: Format<T>> Store<'_, T, K, V> {
    fn pages_at(&self, page: u32) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (kl, vl, p) = (K::page_len(self.s, self.d), V::page_len(self.s, self.d), page as usize);
        (p * kl..(p + 1) * kl, p * vl..(p + 1) * vl)
    }

    fn write(&mut self, page: u32, slot: u32, k: &[T], v: &[T]) {
        let (ka, va) = self.pages_at(page);
        K::put(&mut self.k[ka], slot as usize, k, self.s);
        V::put(&mut self.v[va], slot as usize, v, self.s);
    }

    fn read_page(&self, page: u32) -> PageCopy<T, K, V> {
        let (ka, va) = self.pages_at(page);
        (self.k[ka].to_vec(), self.v[va].to_vec())
    }

    /// Row `from` of the page copies `old` into slot `slot` of `page`.
    fn move_row(&mut self, old: &PageCopy<T, K, V>, from: usize, page: u32, slot: usize) {
        let (ka, va) = self.pages_at(page);
        K::copy(&old.0, from, &mut self.k[ka], slot, self.s, self.d);
        V::copy(&old.1, from, &mut self.v[va], slot, self.s, self.d);
    }

    fn clear_page(&mut self, page: u32) {
        let (ka, va) = self.pages_at(page);
        K::clear_from(&mut self.k[ka], 0, self.s, self.d);
        V::clear_from(&mut self.v[va], 0, self.s, self.d);
    }
}
