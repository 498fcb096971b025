//! Property tests of the M-DCI index against brute-force references.

use std::collections::HashSet;

use icecache::{Config, DciIndex, KeyData, Metric};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// `n` keys of `dim` around `clusters` random centres (attention keys are clustered too).
fn clustered(n: usize, dim: usize, clusters: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let centres: Vec<f32> = (0..clusters * dim).map(|_| 3.0 * rng.sample::<f32, _>(StandardNormal)).collect();
    let mut out = Vec::with_capacity(n * dim);
    for _ in 0..n {
        let c = rng.gen_range(0..clusters);
        let spread = rng.gen_range(0.3..1.5f32);
        for j in 0..dim {
            out.push(centres[c * dim + j] + spread * rng.sample::<f32, _>(StandardNormal));
        }
    }
    out
}

fn index(dim: usize, metric: Metric, seed: u64) -> DciIndex {
    let mut cfg = Config::new(dim, metric);
    cfg.seed = Some(seed);
    // Small promotion ratios would leave small test sets with one tier; these give 3–4 tiers.
    cfg.promotion = vec![0.1, 0.2, 0.3];
    DciIndex::new(cfg).unwrap()
}

/// Brute-force top-k (ids, scores) over live `(id, key)` pairs.
fn naive(points: &[(i64, Vec<f32>)], q: &[f32], k: usize, metric: Metric) -> Vec<(i64, f32)> {
    let mut all: Vec<(i64, f32)> = points
        .iter()
        .map(|(id, key)| {
            let s = match metric {
                Metric::InnerProduct => key.iter().zip(q).map(|(a, b)| a * b).sum(),
                Metric::L2 => key.iter().zip(q).map(|(a, b)| (a - b) * (a - b)).sum(),
            };
            (*id, s)
        })
        .collect();
    match metric {
        Metric::InnerProduct => all.sort_by(|a, b| b.1.total_cmp(&a.1)),
        Metric::L2 => all.sort_by(|a, b| a.1.total_cmp(&b.1)),
    }
    all.truncate(k);
    all
}

/// Exact results must equal the reference up to ties: same scores, and ids that differ only
/// where scores tie.
fn assert_same_topk(got_ids: &[i64], got: &[f32], want: &[(i64, f32)]) {
    for (i, (&g, &(_, w))) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-3 * (1.0 + w.abs()), "rank {i}: score {g} vs {w}");
    }
    let strict: HashSet<i64> = want
        .iter()
        .filter(|(_, s)| (s - want.last().unwrap().1).abs() > 1e-3 * (1.0 + s.abs()))
        .map(|(id, _)| *id)
        .collect();
    let got_set: HashSet<i64> = got_ids.iter().copied().collect();
    assert!(strict.is_subset(&got_set), "exact query missed a non-tied neighbour");
}

fn live_points(keys: &[f32], dim: usize, ids: &[i64], removed: &HashSet<i64>) -> Vec<(i64, Vec<f32>)> {
    keys.chunks_exact(dim).zip(ids).filter(|(_, id)| !removed.contains(id)).map(|(k, id)| (*id, k.to_vec())).collect()
}

fn recall(got: &[i64], want: &[(i64, f32)]) -> f64 {
    let w: HashSet<i64> = want.iter().map(|x| x.0).collect();
    got.iter().filter(|g| w.contains(g)).count() as f64 / want.len() as f64
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Build + inserts + removals: exact queries equal brute force, approximate scores are the
    /// true scores of the returned ids, removed ids never come back, invariants hold.
    #[test]
    fn matches_brute_force(
        n in 1usize..400,
        extra in 0usize..120,
        dim in prop::sample::select(vec![3usize, 16, 33]),
        l2 in any::<bool>(),
        remove_every in 2usize..7,
        seed in any::<u64>(),
    ) {
        let metric = if l2 { Metric::L2 } else { Metric::InnerProduct };
        let keys = clustered(n + extra, dim, 5, seed);
        let mut idx = index(dim, metric, seed);
        let mut ids = idx.add(KeyData::F32(&keys[..n * dim]), None).unwrap();
        for row in keys[n * dim..].chunks_exact(dim) {
            ids.extend(idx.add(KeyData::F32(row), None).unwrap());
        }
        idx.validate().unwrap();
        let removed: HashSet<i64> = ids.iter().copied().step_by(remove_every).collect();
        let to_remove: Vec<i64> = removed.iter().copied().collect();
        idx.remove(&to_remove).unwrap();
        idx.validate().unwrap();
        let live = live_points(&keys, dim, &ids, &removed);
        prop_assert_eq!(idx.len(), live.len());
        if live.is_empty() {
            return Ok(());
        }
        let queries = clustered(5, dim, 5, seed ^ 1);
        let k = 10.min(live.len());
        let (ei, es) = idx.query(KeyData::F32(&queries), k, None, true).unwrap();
        let (ai, as_) = idx.query(KeyData::F32(&queries), k, None, false).unwrap();
        for (qi, q) in queries.chunks_exact(dim).enumerate() {
            let want = naive(&live, q, k, metric);
            assert_same_topk(&ei[qi * k..(qi + 1) * k], &es[qi * k..(qi + 1) * k], &want);
            for (&id, &s) in ai[qi * k..(qi + 1) * k].iter().zip(&as_[qi * k..(qi + 1) * k]) {
                prop_assert!(!removed.contains(&id));
                let key = &live.iter().find(|p| p.0 == id).unwrap().1;
                let truth = naive(&[(id, key.clone())], q, 1, metric)[0].1;
                prop_assert!((s - truth).abs() <= 1e-3 * (1.0 + truth.abs()));
            }
            let a = &as_[qi * k..(qi + 1) * k];
            let ordered = a.windows(2).all(|w| match metric {
                Metric::InnerProduct => w[0] >= w[1],
                Metric::L2 => w[0] <= w[1],
            });
            prop_assert!(ordered, "approximate scores out of order");
        }
    }

    /// Every added id is the nearest neighbour (L2, distance 0) of its own key.
    #[test]
    fn every_point_finds_itself(n in 1usize..300, seed in any::<u64>()) {
        let dim = 8;
        let keys = clustered(n, dim, 4, seed);
        let mut idx = index(dim, Metric::L2, seed);
        let ids = idx.add(KeyData::F32(&keys[..n / 2 * dim]), None).unwrap();
        let mut all = ids;
        for row in keys[n / 2 * dim..].chunks_exact(dim) {
            all.extend(idx.add(KeyData::F32(row), None).unwrap());
        }
        let (got, d) = idx.query(KeyData::F32(&keys), 1, None, true).unwrap();
        for i in 0..n {
            prop_assert_eq!(d[i], 0.0);
            prop_assert_eq!(got[i], all[i]);
        }
    }

    /// save → load answers identically, and the loaded index keeps working.
    #[test]
    fn save_load_roundtrip(n in 1usize..300, seed in any::<u64>()) {
        let dim = 12;
        let keys = clustered(n + 20, dim, 4, seed);
        let mut idx = index(dim, Metric::InnerProduct, seed);
        idx.add(KeyData::F32(&keys[..n * dim]), None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("i{seed}.dci"));
        idx.save(&path).unwrap();
        let mut back = DciIndex::load(&path).unwrap();
        back.validate().unwrap();
        let q = clustered(4, dim, 4, seed ^ 7);
        let k = 5.min(n);
        prop_assert_eq!(idx.query(KeyData::F32(&q), k, None, false).unwrap(), back.query(KeyData::F32(&q), k, None, false).unwrap());
        // Same state, same random stream: identical after further inserts too.
        idx.add(KeyData::F32(&keys[n * dim..]), None).unwrap();
        back.add(KeyData::F32(&keys[n * dim..]), None).unwrap();
        prop_assert_eq!(idx.query(KeyData::F32(&q), k, None, false).unwrap(), back.query(KeyData::F32(&q), k, None, false).unwrap());
    }
}

/// Keys with a larger norm than everything built so far raise `c`; exact rankings stay exact
/// and approximate recall stays high.
#[test]
fn inserts_after_larger_norm_keep_rankings() {
    let dim = 32;
    let keys = clustered(3000, dim, 20, 11);
    let mut idx = index(dim, Metric::InnerProduct, 3);
    let mut ids = idx.add(KeyData::F32(&keys[..2000 * dim]), None).unwrap();
    let c0 = idx.stats().c;
    for (i, row) in keys[2000 * dim..].chunks_exact(dim).enumerate() {
        // Every 50th inserted key is scaled past the current bound.
        let scaled: Vec<f32> = if i % 50 == 0 { row.iter().map(|x| x * 3.0).collect() } else { row.to_vec() };
        ids.extend(idx.add(KeyData::F32(&scaled), None).unwrap());
    }
    assert!(idx.stats().c > c0 * 2.0, "c must have grown");
    idx.validate().unwrap();
    let stored: Vec<(i64, Vec<f32>)> = keys
        .chunks_exact(dim)
        .enumerate()
        .map(|(i, r)| {
            let f = if i >= 2000 && (i - 2000) % 50 == 0 { 3.0 } else { 1.0 };
            (ids[i], r.iter().map(|x| x * f).collect())
        })
        .collect();
    let q = clustered(50, dim, 20, 99);
    let k = 20;
    let (ei, es) = idx.query(KeyData::F32(&q), k, None, true).unwrap();
    let (ai, _) = idx.query(KeyData::F32(&q), k, None, false).unwrap();
    let mut rec = 0.0;
    for (qi, qq) in q.chunks_exact(dim).enumerate() {
        let want = naive(&stored, qq, k, Metric::InnerProduct);
        assert_same_topk(&ei[qi * k..(qi + 1) * k], &es[qi * k..(qi + 1) * k], &want);
        rec += recall(&ai[qi * k..(qi + 1) * k], &want);
    }
    rec /= 50.0;
    assert!(rec >= 0.9, "recall@{k} after norm growth: {rec}");
}

/// Approximate search finds most true neighbours of clustered data. Isotropic Gaussian clusters
/// in 48-d are harder than attention keys (which the default effort is tuned on), hence 1.5.
#[test]
fn recall_on_clustered_data() {
    for metric in [Metric::InnerProduct, Metric::L2] {
        let dim = 48;
        let keys = clustered(20000, dim, 100, 5);
        let mut cfg = Config::new(dim, metric);
        cfg.seed = Some(1);
        let mut idx = DciIndex::new(cfg).unwrap();
        idx.add(KeyData::F32(&keys), None).unwrap();
        let q = clustered(100, dim, 100, 6);
        let (ei, _) = idx.query(KeyData::F32(&q), 50, None, true).unwrap();
        let (ai, _) = idx.query(KeyData::F32(&q), 50, Some(1.5), false).unwrap();
        let hits: usize = (0..100)
            .map(|i| {
                let e: HashSet<_> = ei[i * 50..(i + 1) * 50].iter().collect();
                ai[i * 50..(i + 1) * 50].iter().filter(|a| e.contains(a)).count()
            })
            .sum();
        let rec = hits as f64 / 5000.0;
        assert!(rec >= 0.95, "{metric:?}: recall@50 {rec}");
    }
}

/// P-DCI inside cells (forced for every cell) still finds the neighbours.
#[test]
fn pdci_cells_find_neighbours() {
    let dim = 16;
    let keys = clustered(4000, dim, 10, 8);
    let mut cfg = Config::new(dim, Metric::L2);
    cfg.seed = Some(2);
    cfg.pdci_min_cell = 1;
    let mut idx = DciIndex::new(cfg).unwrap();
    idx.add(KeyData::F32(&keys), None).unwrap();
    let q = clustered(50, dim, 10, 9);
    let (ei, _) = idx.query(KeyData::F32(&q), 10, None, true).unwrap();
    let (ai, _) = idx.query(KeyData::F32(&q), 10, Some(4.0), false).unwrap();
    let hits =
        ai.iter().zip(ei.chunks(10).flat_map(|c| std::iter::repeat_n(c, 10))).filter(|(a, e)| e.contains(a)).count();
    assert!(hits as f64 / 500.0 >= 0.8, "P-DCI recall@10 {}", hits as f64 / 500.0);
}

#[test]
fn bad_input_is_rejected_and_changes_nothing() {
    let dim = 4;
    let mut idx = index(dim, Metric::InnerProduct, 1);
    assert!(idx.query(KeyData::F32(&[0.0; 4]), 1, None, false).is_err(), "empty index");
    let keys = clustered(50, dim, 2, 1);
    idx.add(KeyData::F32(&keys), None).unwrap();
    let before = idx.query(KeyData::F32(&keys[..dim]), 5, None, false).unwrap();
    assert!(idx.add(KeyData::F32(&[1.0, 2.0, 3.0]), None).is_err(), "ragged");
    assert!(idx.add(KeyData::F32(&[1.0, f32::NAN, 0.0, 0.0]), None).is_err(), "NaN");
    assert!(idx.add(KeyData::F32(&[1.0, f32::INFINITY, 0.0, 0.0]), None).is_err(), "Inf");
    assert!(idx.add(KeyData::F32(&[0.0; 8]), Some(&[7, 7])).is_err(), "duplicate ids");
    assert!(idx.add(KeyData::F32(&[0.0; 4]), Some(&[3])).is_err(), "existing id");
    assert!(idx.add(KeyData::F32(&[0.0; 4]), Some(&[-1])).is_err(), "negative id");
    assert!(idx.add(KeyData::F32(&[0.0; 8]), Some(&[100])).is_err(), "id count");
    assert!(idx.remove(&[1, 1000]).is_err(), "unknown id");
    assert!(idx.remove(&[1, 1]).is_err(), "repeated id");
    assert!(idx.query(KeyData::F32(&keys[..dim]), 0, None, false).is_err(), "k = 0");
    assert!(idx.query(KeyData::F32(&keys[..dim]), 51, None, false).is_err(), "k > len");
    assert!(idx.query(KeyData::F32(&keys[..dim]), 1, Some(0.0), false).is_err(), "effort 0");
    assert_eq!(idx.len(), 50);
    idx.validate().unwrap();
    assert_eq!(idx.query(KeyData::F32(&keys[..dim]), 5, None, false).unwrap(), before);
}

#[test]
fn corrupted_files_are_rejected() {
    let dim = 4;
    let mut idx = index(dim, Metric::L2, 1);
    idx.add(KeyData::F32(&clustered(100, dim, 2, 1)), None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.dci");
    idx.save(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let bad = dir.path().join("bad.dci");
    let cases: Vec<Vec<u8>> = vec![
        good[..10].to_vec(),
        good[..good.len() - 1].to_vec(),
        {
            let mut b = good.clone();
            let i = b.len() / 2;
            b[i] ^= 0x40;
            b
        },
        {
            let mut b = good.clone();
            b[0] = b'X';
            b
        },
        {
            let mut b = good.clone();
            b[8] = 99;
            b
        },
    ];
    for (i, bytes) in cases.into_iter().enumerate() {
        std::fs::write(&bad, bytes).unwrap();
        assert!(matches!(DciIndex::load(&bad), Err(icecache::Error::File(_))), "case {i}");
    }
}

fn recall_at_10(idx: &DciIndex, points: &[(i64, Vec<f32>)], queries: &[f32], dim: usize, metric: Metric) -> f64 {
    let (got, _) = idx.query(KeyData::F32(queries), 10, None, false).unwrap();
    let total: f64 = queries
        .chunks_exact(dim)
        .zip(got.chunks_exact(10))
        .map(|(q, g)| recall(g, &naive(points, q, 10, metric)))
        .sum();
    total / (queries.len() / dim) as f64
}

/// An index grown from empty in small batches answers as well as a bulk build of the same keys
/// (inserts rebuild the tree as it doubles and its upper tiers as they grow), and keeps every
/// invariant through those rebuilds.
#[test]
fn grown_index_matches_a_bulk_build() {
    let (dim, n) = (32, 20000);
    for metric in [Metric::InnerProduct, Metric::L2] {
        let keys = clustered(n, dim, 100, 21);
        let queries = clustered(200, dim, 100, 22);
        let mut cfg = Config::new(dim, metric);
        cfg.seed = Some(5);
        let mut bulk = DciIndex::new(cfg.clone()).unwrap();
        bulk.add(KeyData::F32(&keys), None).unwrap();
        let mut grown = DciIndex::new(cfg).unwrap();
        for (i, batch) in keys.chunks(500 * dim).enumerate() {
            grown.add(KeyData::F32(batch), None).unwrap();
            if i % 10 == 9 {
                grown.validate().unwrap();
            }
        }
        let points = live_points(&keys, dim, &(0..n as i64).collect::<Vec<_>>(), &HashSet::new());
        let (rb, rg) =
            (recall_at_10(&bulk, &points, &queries, dim, metric), recall_at_10(&grown, &points, &queries, dim, metric));
        assert!(rg >= 0.95 * rb, "{metric:?}: grown recall@10 {rg:.3}, bulk {rb:.3}");
    }
}

/// Keys added one at a time spread over cells as a build spreads them: on unclustered keys the
/// first cells used to swallow nearly every key (queries scanned all of them).
#[test]
fn one_row_growth_keeps_leaf_cells_small() {
    let (dim, n) = (32, 3000);
    let mut rng = StdRng::seed_from_u64(4);
    let keys: Vec<f32> = (0..n * dim).map(|_| rng.sample::<f32, _>(StandardNormal)).collect();
    let mut cfg = Config::new(dim, Metric::L2);
    cfg.seed = Some(6);
    let mut bulk = DciIndex::new(cfg.clone()).unwrap();
    bulk.add(KeyData::F32(&keys), None).unwrap();
    let mut grown = DciIndex::new(cfg).unwrap();
    for row in keys.chunks_exact(dim) {
        grown.add(KeyData::F32(row), None).unwrap();
    }
    grown.validate().unwrap();
    let (b, g) = (bulk.stats().max_leaf_cell, grown.stats().max_leaf_cell);
    assert!(g <= 3 * b, "largest leaf cell: {g} grown one row at a time, {b} built");
}
