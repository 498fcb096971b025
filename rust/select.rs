//! Page selection for one decode step (FIND-PAGE-INDEX with a GQA union; docs/ARCHITECTURE.md,
//! section Select).
//!
//! Each query head searches its KV head's tree (with `group_view`, the query heads of a group
//! search one shared field of view, so the group's keys are read once); the keys a head scores
//! (int8 estimates of `q · k`, or exact scores in exact mode) become softmax weights over that
//! head's middle tokens, and a page's score is the weight of all its scored keys (not just its
//! best key). The query heads of a group share one selection: their normalised page weights
//! are summed, so each head counts equally, and pages are ranked by the sum.

use rayon::prelude::*;

use crate::error::{ensure, try_filled, Result};
use crate::index::Scratch;
use crate::input::check_rows;
use crate::pages::int8::PageCodes;
use crate::pages::{HeadForest, HeadPages};
use crate::simd::{self, QueryI8};

/// Options of one selection.
#[derive(Clone, Copy, Debug)]
pub struct SelectParams {
    /// Most pages per KV head.
    pub max_pages: usize,
    /// Softmax scale (usually `1 / sqrt(d)`).
    pub scale: f32,
    /// Search effort (field of view multiplier); `None`: each head's own default (see
    /// `HeadForest::calibrate`).
    pub effort: Option<f32>,
    /// Score every key exactly instead of searching.
    pub exact: bool,
    /// The weight of each query head's `successors` heaviest keys also goes to the page of
    /// the next position: attention that moves on by one token (a head copying text from the
    /// context) finds that page selected already. 0: off.
    pub successors: usize,
    /// The query heads of a GQA group search one shared field of view (the cells each ranks
    /// best, taken in turn) instead of one each: the group's keys are read once, not once per
    /// query head. Ignored with `exact`.
    pub group_view: bool,
}

/// Most query heads per KV head (a bit each in `Buffers::heads_of`).
const MAX_GROUP: usize = 128;

/// Buffers of one KV head's selection, reused by the heads one worker runs.
#[derive(Default)]
struct Buffers {
    search: Scratch,
    /// The quantised queries of the group, `[G, d]`, and their scales.
    qcode: Vec<i8>,
    qscale: Vec<f32>,
    /// Per query head: its view (cells, best first), the int8 estimates of `q · k` of the keys
    /// it scored (in scan order), and per scanned page where its keys start in that list.
    views: Vec<Vec<(i64, f32)>>,
    scores: Vec<Vec<f32>>,
    spans: Vec<Vec<Span>>,
    /// The cells to read, and per cell the query heads whose view holds it (a bit each; all
    /// zero between calls).
    shared: Vec<u32>,
    heads_of: Vec<u128>,
    tq: Vec<f32>,
    dots: Vec<i32>,
    logits: Vec<f32>,
    /// Per page, one head's mass (zero between heads), and the pages it was given to.
    weights: Vec<f32>,
    touched: Vec<u32>,
    /// A head's `successors` heaviest keys, and `top_n`'s scratch.
    next: Vec<u32>,
    /// The position after each of `next`'s keys.
    after: Vec<u32>,
    top_chunks: Vec<(f32, u32)>,
    top: Vec<(f32, u32)>,
}

/// A scanned page of one query head: its keys' estimates start at `start` in the head's list.
#[derive(Clone, Copy)]
struct Span {
    page: u32,
    start: u32,
}

/// Scores `page` for the query heads `qs` (their quantised queries and scales), each row read
/// once for all of them: appends the int8 estimates of `q · k` of the page's keys to each head's
/// `scores`, and the page to its `spans`. `dots` is scratch.
fn scan(
    hp: &HeadPages,
    codes: PageCodes<'_>,
    page: u32,
    qs: (&[QueryI8<'_>], &[f32]),
    scores: &mut [Vec<f32>],
    spans: &mut [Vec<Span>],
    dots: &mut Vec<i32>,
) {
    for (spans, scores) in spans.iter_mut().zip(scores.iter()) {
        spans.push(Span { page, start: scores.len() as u32 });
    }
    hp.score_page(codes, page, qs, dots, scores);
}

/// Orders `(value, index)` pairs largest value first, ties by the lower index.
fn best_first(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Values per chunk of `top_n`'s first pass.
const CHUNK: usize = 16;

/// The indices of the `n` largest of `x` (ties: the earlier), in increasing order, into `out`.
/// Two passes: the chunks' maxima, whose `n`-th largest is a floor (`n` values reach it), then
/// the values at or above it in the chunks that reach it, a few times `n` of them. `chunks`
/// and `cand` are scratch.
fn top_n(x: &[f32], n: usize, chunks: &mut Vec<(f32, u32)>, cand: &mut Vec<(f32, u32)>, out: &mut Vec<u32>) {
    out.clear();
    if n == 0 {
        return;
    }
    chunks.clear();
    chunks.extend(x.chunks(CHUNK).zip(0..).map(|(c, i)| (c.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)), i)));
    let floor = if chunks.len() > n {
        chunks.select_nth_unstable_by(n - 1, best_first);
        chunks[n - 1].0
    } else {
        f32::NEG_INFINITY
    };
    cand.clear();
    for &(_, c) in chunks.iter().filter(|&&(max, _)| max >= floor) {
        let at = c as usize * CHUNK;
        let chunk = &x[at..(at + CHUNK).min(x.len())];
        cand.extend(chunk.iter().zip(at as u32..).filter(|&(&v, _)| v >= floor).map(|(&v, i)| (v, i)));
    }
    if cand.len() > n {
        cand.select_nth_unstable_by(n - 1, best_first);
        cand.truncate(n);
    }
    out.extend(cand.iter().map(|&(_, i)| i));
    out.sort_unstable();
}

impl Buffers {
    /// Quantises the group's queries `qs` (`[G, d]`) and empties what each head scored.
    fn quantize(&mut self, qs: &[f32], d: usize) {
        let group = qs.len() / d;
        self.qcode.resize(group * d, 0);
        self.qscale.clear();
        for (q, code) in qs.chunks_exact(d).zip(self.qcode.chunks_exact_mut(d)) {
            self.qscale.push(simd::quantize_i8(q, code));
        }
        self.scores.resize_with(group, Vec::new);
        self.scores.iter_mut().for_each(Vec::clear);
        self.spans.resize_with(group, Vec::new);
        self.spans.iter_mut().for_each(Vec::clear);
        self.views.resize_with(group, Vec::new);
    }

    /// Exact mode: every query head scores every key of `hp`.
    fn scan_every_page(&mut self, hp: &HeadPages, codes: PageCodes<'_>, d: usize) {
        let Buffers { qcode, qscale, scores, spans, dots, .. } = self;
        let prepared: Vec<QueryI8> = qcode.chunks_exact(d).map(QueryI8::new).collect();
        for page in 0..hp.num_pages() as u32 {
            scan(hp, codes, page, (&prepared, qscale), scores, spans, dots);
        }
    }

    /// Each query head's field of view of `pool` keys at `effort`.
    fn views(&mut self, hp: &HeadPages, qs: &[f32], d: usize, pool: usize, effort: f32) {
        for (q, view) in qs.chunks_exact(d).zip(self.views.iter_mut()) {
            hp.view(q, pool, effort, &mut self.tq, &mut self.search, view);
        }
    }

    /// The cells to read, each once: every head's best, then every head's second best, and so
    /// on. With `group_view` the first `fov` of them (as many as one head's own view), scored
    /// by every head; otherwise all of them, each scored by the heads whose own view holds it
    /// (what each head scores is its own view's keys, read once for the group).
    fn shared_cells(&mut self, cells: usize, group_view: bool) {
        let fov = self.views.iter().map(|v| v.len()).max().unwrap_or(0);
        self.heads_of.resize(cells, 0);
        self.shared.clear();
        'fill: for rank in 0..fov {
            for (j, view) in self.views.iter().enumerate() {
                if let Some(&(cell, _)) = view.get(rank) {
                    let heads = &mut self.heads_of[cell as usize];
                    if *heads == 0 {
                        self.shared.push(cell as u32);
                    }
                    *heads |= 1 << j;
                    if group_view && self.shared.len() == fov {
                        break 'fill;
                    }
                }
            }
        }
    }

    /// Scans the shared cells (`shared_cells`) for the heads each is read for.
    fn scan_cells(&mut self, hp: &HeadPages, codes: PageCodes<'_>, d: usize, group_view: bool) {
        let Buffers { qcode, qscale, scores, spans, dots, shared, heads_of, .. } = self;
        let prepared: Vec<QueryI8> = qcode.chunks_exact(d).map(QueryI8::new).collect();
        let group = prepared.len();
        for (i, &cell) in shared.iter().enumerate() {
            // The next cell's rows come from memory while this one is scanned (the cells are
            // scattered over the store: a scan waits on memory otherwise).
            if let Some(&next) = shared.get(i + 1) {
                for &page in &hp.cells[next as usize].pages {
                    codes.prefetch(page, hp.page_len(page));
                }
            }
            let heads = std::mem::take(&mut heads_of[cell as usize]);
            let every = group_view || heads.count_ones() as usize == group;
            for &page in &hp.cells[cell as usize].pages {
                if every {
                    scan(hp, codes, page, (&prepared, qscale), scores, spans, dots);
                    continue;
                }
                for j in (0..group).filter(|&j| heads & 1 << j != 0) {
                    let head = (std::slice::from_ref(&prepared[j]), &qscale[j..j + 1]);
                    scan(hp, codes, page, head, &mut scores[j..j + 1], &mut spans[j..j + 1], dots);
                }
            }
        }
    }

    /// Per page of `hp`, the group's attention mass over the keys its heads scored: each
    /// head's softmax (at `p.scale`) summed into pages, plus the weight of each head's
    /// `p.successors` heaviest keys on the page of the next position.
    fn page_weights(&mut self, hp: &HeadPages, p: &SelectParams) -> Vec<f32> {
        let np = hp.num_pages();
        let mut sum = vec![0f32; np];
        self.weights.resize(np, 0f32);
        for (scores, spans) in self.scores.iter().zip(&self.spans) {
            self.logits.clear();
            self.logits.extend(scores.iter().map(|&s| s * p.scale));
            let total = simd::softmax_numerators(&mut self.logits);
            top_n(
                &self.logits,
                p.successors.min(self.logits.len()),
                &mut self.top_chunks,
                &mut self.top,
                &mut self.next,
            );
            // Each key's weight, divided in one vectorised pass (not one by one as summed).
            self.logits.iter_mut().for_each(|x| *x /= total);
            let weights = &self.logits;
            self.touched.clear();
            for (k, span) in spans.iter().enumerate() {
                let end = spans.get(k + 1).map_or(weights.len(), |s| s.start as usize);
                let mass = weights[span.start as usize..end].iter().fold(0f32, |a, &w| a + w);
                self.weights[span.page as usize] += mass;
                self.touched.push(span.page);
            }
            // The position after each of those keys, then its page: `next` is in increasing
            // order, as the spans are, so one walk finds each key's span, and the two lookups
            // (scattered over the head's maps) are made for all keys before any is used, so
            // that their cache misses overlap.
            self.after.clear();
            let mut k = 0;
            for &i in &self.next {
                while spans.get(k + 1).is_some_and(|s| s.start <= i) {
                    k += 1;
                }
                let slot = (i - spans[k].start) as usize;
                self.after.push(hp.page_tokens(spans[k].page)[slot] + 1);
            }
            for (&i, &after) in self.next.iter().zip(&self.after) {
                if let Some(page) = hp.page_of(after as usize) {
                    self.weights[page as usize] += weights[i as usize];
                    self.touched.push(page);
                }
            }
            // A page given mass twice is added once: the second take finds zero.
            for &page in &self.touched {
                sum[page as usize] += std::mem::take(&mut self.weights[page as usize]);
            }
        }
        sum
    }
}

/// The pages of one KV head with weight, heaviest first (ties: lower page first), at most
/// `out.len()` of them, into `out`; returns how many.
fn rank_pages(weights: &[f32], out: &mut [i32]) -> i32 {
    let max_pages = out.len();
    let mut ranked: Vec<(f32, u32)> =
        weights.iter().enumerate().filter(|(_, &w)| w > 0.0).map(|(i, &w)| (w, i as u32)).collect();
    if ranked.len() > max_pages {
        ranked.select_nth_unstable_by(max_pages - 1, best_first);
        ranked.truncate(max_pages);
    }
    ranked.sort_unstable_by(best_first);
    for (o, &(_, page)) in out.iter_mut().zip(&ranked) {
        *o = page as i32;
    }
    ranked.len() as i32
}

impl HeadForest {
    /// Selects pages for `queries` `[H_q, d]`; returns `pages` `[H_kv, max_pages]` (ranked, -1
    /// past the count) and `counts` `[H_kv]`. `k_store`: for a forest of 8-bit stores, the K
    /// store its keys live in (`None` for 16-bit stores, whose forest keeps them).
    pub fn select(&self, queries: &[f32], p: SelectParams, k_store: Option<&[u8]>) -> Result<(Vec<i32>, Vec<i32>)> {
        let h = self.num_heads();
        let d = self.dim();
        let hq = check_rows(queries, d, "queries")?;
        ensure!(hq >= h && hq % h == 0, "queries: {hq} query heads are not a multiple of {h} KV heads");
        ensure!(p.max_pages >= 1, "max_pages must be at least 1, got {}", p.max_pages);
        ensure!(p.scale.is_finite() && p.scale > 0.0, "scale must be a positive number, got {}", p.scale);
        if let Some(e) = p.effort {
            ensure!(e.is_finite() && e > 0.0, "effort must be a positive number, got {e}");
        }
        let codes = self.codes(k_store)?;
        let group = hq / h;
        ensure!(group <= MAX_GROUP, "{group} query heads per KV head; at most {MAX_GROUP} are supported");
        // The search must look at no fewer keys than the pages could hold (or than there are).
        let pool = p.max_pages.saturating_mul(self.page_size()).min(self.len());
        // Sized by the caller's max_pages, so allocated fallibly, before any work.
        let n = h.saturating_mul(p.max_pages);
        let mut pages = try_filled(n, -1i32, "the page table [H_kv, max_pages]")?;
        // One task per KV head: its group's query heads together, so that a cell several of
        // them look at is read once.
        let weights: Vec<Vec<f32>> = queries
            .par_chunks_exact(group * d)
            .zip(&self.heads)
            .zip(&codes)
            .map_init(Buffers::default, |b, ((qs, hp), &codes)| {
                b.quantize(qs, d);
                if p.exact {
                    b.scan_every_page(hp, codes, d);
                } else {
                    b.views(hp, qs, d, pool, p.effort.unwrap_or(hp.effort));
                    b.shared_cells(hp.cells.len(), p.group_view);
                    b.scan_cells(hp, codes, d, p.group_view);
                }
                b.page_weights(hp, &p)
            })
            .collect();
        let mut counts = vec![0i32; h];
        pages
            .par_chunks_mut(p.max_pages)
            .zip(counts.par_iter_mut())
            .zip(weights)
            .for_each(|((out, count), w)| *count = rank_pages(&w, out));
        Ok((pages, counts))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::top_n;

    proptest! {
        /// Small integers: many ties, which go to the earlier index.
        #[test]
        fn top_n_keeps_the_n_largest_in_index_order(x in prop::collection::vec(-8i8..8, 0..300), n in 0usize..80) {
            let x: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let n = n.min(x.len());
            let mut want: Vec<u32> = (0..x.len() as u32).collect();
            want.sort_by(|&a, &b| x[b as usize].total_cmp(&x[a as usize]).then(a.cmp(&b)));
            want.truncate(n);
            want.sort_unstable();
            let (mut chunks, mut cand, mut out) = (Vec::new(), Vec::new(), vec![7]);
            top_n(&x, n, &mut chunks, &mut cand, &mut out);
            prop_assert_eq!(out, want);
        }
    }
}
