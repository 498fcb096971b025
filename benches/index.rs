//! Criterion benches of the index on clustered synthetic keys:
//! build, single insert, single query and batch query at n ∈ {8k, 32k, 128k}, d ∈ {64, 128}.
//! Run: `cargo bench --bench index` (RAYON_NUM_THREADS=1 for single-thread figures).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use icecache::{Config, DciIndex, KeyData, Metric};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

const SIZES: [usize; 3] = [8 << 10, 32 << 10, 128 << 10];
const DIMS: [usize; 2] = [64, 128];
const K: usize = 100;

/// Keys around n/100 random centres with a shared offset, like attention keys.
fn clustered(n: usize, dim: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let clusters = (n / 100).max(8);
    let offset: Vec<f32> = (0..dim).map(|_| 2.0 * rng.sample::<f32, _>(StandardNormal)).collect();
    let centres: Vec<f32> = (0..clusters * dim).map(|_| 1.5 * rng.sample::<f32, _>(StandardNormal)).collect();
    let mut out = Vec::with_capacity(n * dim);
    for _ in 0..n {
        let c = rng.gen_range(0..clusters);
        let spread = rng.gen_range(0.3..1.0f32);
        for j in 0..dim {
            out.push(offset[j] + centres[c * dim + j] + spread * rng.sample::<f32, _>(StandardNormal));
        }
    }
    out
}

fn built(keys: &[f32], dim: usize) -> DciIndex {
    let mut cfg = Config::new(dim, Metric::InnerProduct);
    cfg.seed = Some(7);
    let mut idx = DciIndex::new(cfg).unwrap();
    idx.add(KeyData::F32(keys), None).unwrap();
    idx
}

fn benches(c: &mut Criterion) {
    for dim in DIMS {
        for n in SIZES {
            let keys = clustered(n + 1024, dim, n as u64 + dim as u64);
            let (base, extra) = keys.split_at(n * dim);
            let queries = clustered(256, dim, 1);
            let label = format!("n{}k_d{dim}", n >> 10);

            let mut g = c.benchmark_group("build");
            g.sample_size(10).measurement_time(Duration::from_secs(4));
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(BenchmarkId::from_parameter(&label), |b| b.iter(|| built(base, dim)));
            g.finish();

            let mut idx = built(base, dim);
            let mut g = c.benchmark_group("insert");
            g.throughput(Throughput::Elements(1));
            g.bench_function(BenchmarkId::from_parameter(&label), |b| {
                // Time `iters` inserts, then remove them untimed so every sample starts at size n.
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    let mut ids = Vec::with_capacity(iters as usize);
                    for i in 0..iters as usize {
                        let row = &extra[(i % 1024) * dim..(i % 1024 + 1) * dim];
                        ids.extend(idx.add(KeyData::F32(row), None).unwrap());
                    }
                    let took = start.elapsed();
                    idx.remove(&ids).unwrap();
                    took
                })
            });
            g.finish();

            let mut g = c.benchmark_group("query");
            g.throughput(Throughput::Elements(1));
            g.bench_function(BenchmarkId::from_parameter(&label), |b| {
                let mut i = 0;
                b.iter(|| {
                    let q = &queries[(i % 256) * dim..(i % 256 + 1) * dim];
                    i += 1;
                    idx.query(KeyData::F32(q), K, None, false).unwrap()
                })
            });
            g.finish();

            let mut g = c.benchmark_group("batch_query");
            g.throughput(Throughput::Elements(256));
            g.bench_function(BenchmarkId::from_parameter(&label), |b| {
                b.iter(|| idx.query(KeyData::F32(&queries), K, None, false).unwrap())
            });
            g.finish();
        }
    }
}

criterion_group!(index, benches);
criterion_main!(index);
