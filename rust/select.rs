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
use crate::pages::HeadForest;
use crate::simd;

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

impl HeadForest {
    /// Selects pages for `queries` `[H_q, d]`; returns `pages` `[H_kv, max_pages]` (ranked, -1
    /// past the count) and `counts` `[H_kv]`.
    pub fn select(&self, queries: &[f32], p: SelectParams) -> Result<(Vec<i32>, Vec<i32>)> {
        let h = self.num_heads();
        let d = self.dim();
        let hq = check_rows(queries, d, "queries")?;
        ensure!(hq >= h && hq % h == 0, "queries: {hq} query heads are not a multiple of {h} KV heads");
        ensure!(p.max_pages >= 1, "max_pages must be at least 1, got {}", p.max_pages);
        ensure!(p.scale.is_finite() && p.scale > 0.0, "scale must be a positive number, got {}", p.scale);
        if let Some(e) = p.effort {
            ensure!(e.is_finite() && e > 0.0, "effort must be a positive number, got {e}");
        }
        let group = hq / h;
        // The search must look at no fewer keys than the pages could hold (or than there are).
        let pool = p.max_pages.saturating_mul(self.page_size()).min(self.len());
        // Sized by the caller's max_pages, so allocated fallibly, before any work.
        let n = h.saturating_mul(p.max_pages);
        let mut pages = try_filled(n, -1i32, "the page table [H_kv, max_pages]")?;
        // One task per KV head: its group's queries one after the other, so that the cells
        // they share are read from cache (and, with `group_view`, scanned once).
        let sums: Vec<Vec<f32>> = queries
            .par_chunks_exact(group * d)
            .zip(&self.heads)
            .map_init(
                || (Scratch::default(), Vec::new(), Vec::new(), Vec::new(), Vec::new()),
                |(scratch, scored, logits, w, top), (qs, hp)| {
                    scored.resize_with(group, Vec::new);
                    scored.iter_mut().for_each(|s: &mut Vec<_>| s.clear());
                    let effort = p.effort.unwrap_or(hp.index.config().effort);
                    if p.group_view && !p.exact {
                        hp.index.scan_group_scores(qs, pool, effort, scratch, scored);
                    } else {
                        for (q, out) in qs.chunks_exact(d).zip(scored.iter_mut()) {
                            hp.index.scan_scores(q, pool, effort, p.exact, scratch, out);
                        }
                    }
                    let mut sum = vec![0f32; hp.pages.len()];
                    for scored in scored.iter() {
                        logits.clear();
                        logits.extend(scored.iter().map(|s| s.score * p.scale));
                        let total = simd::softmax_numerators(logits);
                        w.clear();
                        w.resize(hp.pages.len(), 0f32);
                        for (s, &x) in scored.iter().zip(logits.iter()) {
                            w[s.tag as usize] += x / total;
                        }
                        if p.successors > 0 {
                            let n = p.successors.min(scored.len());
                            top.clear();
                            top.extend(0..scored.len());
                            if n < top.len() {
                                top.select_nth_unstable_by(n - 1, |&a: &usize, &b: &usize| {
                                    logits[b].total_cmp(&logits[a])
                                });
                            }
                            for &i in &top[..n] {
                                let next = hp.index.slot_id(scored[i].slot) as usize + 1;
                                if let Some(&(page, _)) = hp.token_page.get(next) {
                                    w[page as usize] += logits[i] / total;
                                }
                            }
                        }
                        sum.iter_mut().zip(w.iter()).for_each(|(a, b)| *a += b);
                    }
                    sum
                },
            )
            .collect();
        let mut counts = vec![0i32; h];
        pages.par_chunks_mut(p.max_pages).zip(counts.par_iter_mut()).zip(sums).for_each(|((out, count), sum)| {
            let mut ranked: Vec<(f32, u32)> =
                sum.iter().enumerate().filter(|(_, &w)| w > 0.0).map(|(i, &w)| (w, i as u32)).collect();
            let best_first = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
            if ranked.len() > p.max_pages {
                ranked.select_nth_unstable_by(p.max_pages - 1, best_first);
                ranked.truncate(p.max_pages);
            }
            ranked.sort_unstable_by(best_first);
            for (o, &(_, page)) in out.iter_mut().zip(&ranked) {
                *o = page as i32;
            }
            *count = ranked.len() as i32;
        });
        Ok((pages, counts))
    }
}
