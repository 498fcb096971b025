//! Calibrated search: the smallest query effort (field of view) that reaches a target
//! recall@k on sample queries, measured against the index's own exact scan.
//!
//! How much of the tree a query must look at to find its true top-k depends on the keys and
//! queries (on SmolLM2's keys, effort 1 gives recall@100 from 0.77 to 1.0 depending on the
//! layer and head; benches/RESULTS.md). Like hnswlib's `ef` or faiss's parameter-space tuning, `calibrate`
//! measures instead of guessing: it scans every key once per sample query for the exact
//! top-k, then searches efforts (halving or doubling from 1, then bisection in log space) for
//! the smallest one whose recall on the sample, less two standard errors of its mean, reaches
//! the target. The margin keeps the recall of other queries from the same distribution at the
//! target: the sample's mean alone would put half of them below it.
//!
//! `effort="auto"` (`DciIndex::set_auto_effort`) defers this to the first query that runs at
//! the default effort: it calibrates on (a sample of) that call's queries, at its `k`, for
//! `AUTO_TARGET` (stricter than the 0.95 it aims at for later queries) and at efforts from
//! `AUTO_MIN_EFFORT`, then answers them. What is pending and the last calibration are saved
//! with the index (`Tuning`).

use std::ops::RangeInclusive;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::DciIndex;
use crate::error::{ensure, Result};
use crate::input::{check_rows, KeyData};

/// The search starts here (the tuned default), then halves or doubles within the range given.
const START_EFFORT: f32 = 1.0;
/// Smallest effort tried by default.
pub const DEFAULT_MIN_EFFORT: f32 = 1.0 / 16.0;
/// Bisection stops when the bracket's ends are within this ratio of each other.
const RESOLUTION: f32 = 1.1;
/// Standard errors of the mean recall subtracted before comparing with the target.
const MARGIN_SE: f64 = 2.0;
/// Largest effort tried by default: far past the point where the field of view is the whole
/// tree (the re-ranked pool still grows with effort).
pub const DEFAULT_MAX_EFFORT: f32 = 64.0;

/// Sample target of `effort="auto"`, which aims at recall 0.95 on the queries that follow its
/// first batch: it allows the sample half that miss rate, because later queries can be harder
/// than the first ones (on SmolLM2, queries at later positions than the sample's had up to 0.10
/// less recall@100 than the sample at the effort calibrated for 0.95; benches/RESULTS.md).
pub const AUTO_TARGET: f64 = 0.975;
/// Smallest effort of `effort="auto"`: the tuned default. Below it, the first batch's evidence
/// alone decided to search less, and later queries can be harder (on SmolLM2, the only sets
/// that fell short of 0.95 were those `effort="auto"` had taken below 1; benches/RESULTS.md).
pub const AUTO_MIN_EFFORT: f32 = 1.0;
/// Most queries of the first batch an `effort="auto"` calibration uses (evenly spaced).
pub const AUTO_SAMPLE: usize = 256;

/// Search tuning the config does not carry: saved after the index (file format 2).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(super) struct Tuning {
    /// `effort="auto"` and no calibration yet: the next default-effort query calibrates.
    pub auto_pending: bool,
    /// The last calibration.
    pub last: Option<Calibration>,
}

/// What a calibration found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The effort chosen: the smallest tried that reached the target, or, when none did, the
    /// one with the best recall.
    pub effort: f32,
    /// Mean recall@k over the sample queries at `effort`.
    pub recall: f64,
    /// Standard error of that mean (0 with a single query).
    pub recall_stderr: f64,
    /// Whether `recall - 2 * recall_stderr >= target`.
    pub reached: bool,
    pub target: f64,
    pub k: usize,
    /// Sample queries used.
    pub queries: usize,
    /// Efforts tried (each one approximate search of every sample query).
    pub evaluations: usize,
    /// Wall time, exact scans included.
    pub seconds: f64,
}

impl DciIndex {
    /// Measures the smallest effort that reaches `target` recall@`k` on `queries` (see the
    /// module docs) without changing the index.
    /// Efforts are searched within `efforts` (which must hold 1).
    pub fn find_effort(
        &self,
        queries: KeyData<'_>,
        k: usize,
        target: f64,
        efforts: RangeInclusive<f32>,
    ) -> Result<Calibration> {
        let t0 = Instant::now();
        let queries = queries.to_f32_vec();
        let nq = check_rows(&queries, self.cfg.dim, "queries")?;
        ensure!(nq >= 1, "calibration needs at least one query");
        ensure!(self.len > 0, "the index is empty");
        ensure!(k >= 1, "k must be at least 1, got {k}");
        ensure!(k <= self.len, "k = {k} is larger than the number of points in the index ({})", self.len);
        check_search(target, &efforts)?;
        let queries = self.shift_rows(queries);
        let (exact, _) = self.query_batch(&queries, nq, k, 1.0, true)?;
        let mut truth: Vec<Vec<i64>> = exact.chunks_exact(k).map(|r| r.to_vec()).collect();
        truth.iter_mut().for_each(|r| r.sort_unstable());
        search_effort(target, efforts, k, nq, t0, |effort| {
            let (found, _) = self.query_batch(&queries, nq, k, effort, false)?;
            Ok(per_query_recall(&found, &truth, k))
        })
    }

    /// `find_effort`, then makes the effort found the default of later queries (also when the
    /// target was not reached: it is then the effort with the best recall tried). On error
    /// nothing changes.
    pub fn calibrate(
        &mut self,
        queries: KeyData<'_>,
        k: usize,
        target: f64,
        efforts: RangeInclusive<f32>,
    ) -> Result<Calibration> {
        let found = self.find_effort(queries, k, target, efforts)?;
        self.apply_calibration(found.clone());
        Ok(found)
    }

    /// Makes what `find_effort` found the default effort (and the last calibration).
    pub(crate) fn apply_calibration(&mut self, found: Calibration) {
        self.cfg.effort = found.effort;
        self.tuning = Tuning { auto_pending: false, last: Some(found) };
    }

    /// `effort="auto"`: the next query at the default effort calibrates first (module docs).
    pub fn set_auto_effort(&mut self) {
        self.tuning.auto_pending = true;
    }

    /// Whether the next query at the default effort calibrates first.
    pub fn awaits_calibration(&self) -> bool {
        self.tuning.auto_pending
    }

    /// The last calibration (saved with the index), if any.
    pub fn calibration(&self) -> Option<&Calibration> {
        self.tuning.last.as_ref()
    }

    /// `query` at the default effort, calibrating first when `effort="auto"` awaits it: on at
    /// most `AUTO_SAMPLE` of `queries` (evenly spaced), at this `k`, for `AUTO_TARGET`, at
    /// efforts from `AUTO_MIN_EFFORT`. All
    /// of `queries` is validated before anything changes.
    pub fn query_auto(&mut self, queries: KeyData<'_>, k: usize) -> Result<(Vec<i64>, Vec<f32>)> {
        if self.tuning.auto_pending {
            let rows = queries.to_f32_vec();
            let nq = check_rows(&rows, self.cfg.dim, "queries")?;
            let d = self.cfg.dim;
            let take = nq.min(AUTO_SAMPLE);
            let sample: Vec<f32> = (0..take)
                .flat_map(|i| {
                    let r = if take > 1 { i * (nq - 1) / (take - 1) } else { 0 };
                    rows[r * d..(r + 1) * d].iter().copied()
                })
                .collect();
            self.calibrate(KeyData::F32(&sample), k, AUTO_TARGET, AUTO_MIN_EFFORT..=DEFAULT_MAX_EFFORT)?;
            return self.query(KeyData::F32(&rows), k, None, false);
        }
        self.query(queries, k, None, false)
    }
}

/// `Err` unless `target` and `efforts` are a valid calibration target and effort range.
pub(crate) fn check_search(target: f64, efforts: &RangeInclusive<f32>) -> Result<()> {
    let (min_effort, max_effort) = (*efforts.start(), *efforts.end());
    ensure!(target > 0.0 && target <= 1.0, "target_recall must be in (0, 1], got {target}");
    ensure!(
        max_effort.is_finite() && max_effort >= START_EFFORT,
        "max_effort must be a finite number of at least {START_EFFORT}, got {max_effort}"
    );
    ensure!(
        min_effort > 0.0 && min_effort <= START_EFFORT,
        "min_effort must be in (0, {START_EFFORT}], got {min_effort}"
    );
    Ok(())
}

/// The effort search of the module docs, over `measure(effort)`: the recall of each of `nq`
/// sample queries at that effort (checked by `check_search` first). `t0` is when the whole
/// calibration started.
pub(crate) fn search_effort(
    target: f64,
    efforts: RangeInclusive<f32>,
    k: usize,
    nq: usize,
    t0: Instant,
    mut measure: impl FnMut(f32) -> Result<Vec<f64>>,
) -> Result<Calibration> {
    let (min_effort, max_effort) = (*efforts.start(), *efforts.end());
    let mut tried: Vec<(f32, f64, f64)> = Vec::new();
    let mut reaches = |effort: f32| -> Result<bool> {
        let (mean, se) = mean_stderr(&measure(effort)?);
        tried.push((effort, mean, se));
        Ok(mean - MARGIN_SE * se >= target - 1e-9)
    };

    // Bracket: `hi` reaches the target, `lo` (when known) does not.
    let (mut lo, mut hi) = (None, None);
    let mut e = START_EFFORT;
    if reaches(e)? {
        hi = Some(e);
        while e > min_effort {
            e = (e / 2.0).max(min_effort);
            if reaches(e)? {
                hi = Some(e);
            } else {
                lo = Some(e);
                break;
            }
        }
    } else {
        lo = Some(e);
        while e < max_effort {
            e = (e * 2.0).min(max_effort);
            if reaches(e)? {
                hi = Some(e);
                break;
            }
            lo = Some(e);
        }
    }
    if let (Some(mut l), Some(mut h)) = (lo, hi) {
        while h / l > RESOLUTION {
            let mid = (l * h).sqrt();
            if reaches(mid)? {
                h = mid;
            } else {
                l = mid;
            }
        }
        hi = Some(h);
    }
    let (effort, recall, recall_stderr) = match hi {
        Some(h) => *tried.iter().find(|t| t.0 == h).expect("every bracket end was measured"),
        // Unreachable: the best recall tried (the smallest effort among equals).
        None => *tried
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.total_cmp(&a.0)))
            .expect("at least one effort was measured"),
    };
    Ok(Calibration {
        effort,
        recall,
        recall_stderr,
        reached: hi.is_some(),
        target,
        k,
        queries: nq,
        evaluations: tried.len(),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Recall@k of each query: the share of its `k` ids in `found` (`nq × k`) that `truth` (its
/// sorted ids) holds.
fn per_query_recall(found: &[i64], truth: &[Vec<i64>], k: usize) -> Vec<f64> {
    found
        .chunks_exact(k)
        .zip(truth)
        .map(|(f, t)| f.iter().filter(|id| t.binary_search(id).is_ok()).count() as f64 / k as f64)
        .collect()
}

/// Mean of per-query recalls and the standard error of that mean (0 for one query).
fn mean_stderr(per: &[f64]) -> (f64, f64) {
    let n = per.len() as f64;
    let mean = per.iter().sum::<f64>() / n;
    if per.len() < 2 {
        return (mean, 0.0);
    }
    let var = per.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Config, Metric};
    use rand::{Rng, SeedableRng};
    use rand_xoshiro::Xoshiro256PlusPlus;

    const FULL: RangeInclusive<f32> = DEFAULT_MIN_EFFORT..=DEFAULT_MAX_EFFORT;

    /// Clustered keys (where effort matters) and queries near them.
    fn data(n: usize, nq: usize, dim: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let centers: Vec<f32> = (0..32 * dim).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut draw = |m: usize, spread: f32| -> Vec<f32> {
            let mut out = Vec::with_capacity(m * dim);
            for _ in 0..m {
                let c = rng.gen_range(0..32);
                out.extend((0..dim).map(|j| centers[c * dim + j] + spread * rng.gen_range(-1.0f32..1.0)));
            }
            out
        };
        (draw(n, 0.6), draw(nq, 0.9))
    }

    fn index(keys: &[f32], dim: usize) -> DciIndex {
        let mut cfg = Config::new(dim, Metric::InnerProduct);
        cfg.seed = Some(3);
        let mut idx = DciIndex::new(cfg).unwrap();
        idx.add(KeyData::F32(keys), None).unwrap();
        idx
    }

    fn recall_at(idx: &DciIndex, queries: &[f32], k: usize, effort: f32) -> f64 {
        let (exact, _) = idx.query(KeyData::F32(queries), k, None, true).unwrap();
        let truth: Vec<Vec<i64>> = exact
            .chunks_exact(k)
            .map(|r| {
                let mut r = r.to_vec();
                r.sort_unstable();
                r
            })
            .collect();
        let (found, _) = idx.query(KeyData::F32(queries), k, Some(effort), false).unwrap();
        mean_stderr(&per_query_recall(&found, &truth, k)).0
    }

    #[test]
    fn reaches_the_target_on_held_back_queries_and_sets_the_default() {
        let dim = 24;
        let (keys, queries) = data(20_000, 400, dim, 1);
        let mut idx = index(&keys, dim);
        let (sample, held) = queries.split_at(200 * dim);
        for target in [0.8, 0.95, 0.99] {
            let c = idx.calibrate(KeyData::F32(sample), 50, target, FULL).unwrap();
            assert!(c.reached, "{c:?}");
            assert_eq!(idx.config().effort, c.effort);
            assert!(c.recall - 2.0 * c.recall_stderr >= target - 1e-9, "{c:?}");
            let held_recall = recall_at(&idx, held, 50, c.effort);
            assert!(held_recall >= target - 0.01, "target {target}: held-back recall {held_recall}, {c:?}");
            let again = idx.find_effort(KeyData::F32(sample), 50, target, FULL).unwrap();
            assert_eq!(again.effort, c.effort, "calibration is deterministic");
        }
    }

    #[test]
    fn unreachable_target_reports_the_best_effort() {
        let dim = 8;
        let (keys, queries) = data(3000, 20, dim, 2);
        let mut idx = index(&keys, dim);
        // At max_effort 1 only effort 1 is tried: target 1.0 is out of reach on this data.
        let c = idx.calibrate(KeyData::F32(&queries), 200, 1.0, 1.0..=1.0).unwrap();
        if !c.reached {
            assert_eq!(c.effort, 1.0);
            assert_eq!(c.evaluations, 1);
            assert!(c.recall < 1.0);
        }
        // The range bounds the search: an easy target at efforts from 1 stops at 1.
        let c = idx.calibrate(KeyData::F32(&queries), 10, 0.1, 1.0..=64.0).unwrap();
        assert!(c.reached && c.effort == 1.0 && c.evaluations == 1, "{c:?}");
        let c = idx.calibrate(KeyData::F32(&queries), 10, 0.1, FULL).unwrap();
        assert!(c.reached && c.effort == DEFAULT_MIN_EFFORT, "{c:?}");
        // Target 1.0 is reachable with enough effort (every key is re-ranked exactly).
        let c = idx.calibrate(KeyData::F32(&queries), 200, 1.0, FULL).unwrap();
        assert!(c.reached && c.recall == 1.0, "{c:?}");
    }

    #[test]
    fn bad_input_changes_nothing() {
        let dim = 8;
        let (keys, queries) = data(500, 10, dim, 3);
        let mut empty = DciIndex::new(Config::new(dim, Metric::InnerProduct)).unwrap();
        assert!(empty.calibrate(KeyData::F32(&queries), 5, 0.9, FULL).is_err());
        let mut idx = index(&keys, dim);
        let q = KeyData::F32(&queries);
        let bad = [
            idx.calibrate(KeyData::F32(&queries[..dim + 1]), 5, 0.9, FULL),
            idx.calibrate(KeyData::F32(&[]), 5, 0.9, FULL),
            idx.calibrate(KeyData::F32(&[f32::NAN; 8]), 5, 0.9, FULL),
            idx.calibrate(q, 0, 0.9, FULL),
            idx.calibrate(q, 501, 0.9, FULL),
            idx.calibrate(q, 5, 0.0, FULL),
            idx.calibrate(q, 5, 1.01, FULL),
            idx.calibrate(q, 5, f64::NAN, FULL),
            idx.calibrate(q, 5, 0.9, DEFAULT_MIN_EFFORT..=0.5),
            idx.calibrate(q, 5, 0.9, DEFAULT_MIN_EFFORT..=f32::INFINITY),
            idx.calibrate(q, 5, 0.9, 0.0..=64.0),
            idx.calibrate(q, 5, 0.9, 2.0..=64.0),
        ];
        for r in bad {
            assert!(matches!(r, Err(crate::Error::Invalid(_))), "{r:?}");
        }
        assert_eq!(idx.config().effort, 1.0);
    }
}
