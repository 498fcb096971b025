//! Tests of 8-bit page stores: the row quantiser's error bound, and `write_pages_int8` /
//! `insert_int8` (with page splits) holding the quantised K/V of exactly the tokens the page
//! lists say.

use half::bf16;
use icecache::pages::int8::{self, dequantize_row, quantize_row, row_parts};
use icecache::{Config, HeadForest, KeyData, Metric};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// The bound of `quantize_row`: `|x - code·scale| <= scale · (1/2 + 2^-14)` (exact arithmetic,
/// f64 here), and `2^-140` absolute for subnormal scales.
fn check_bound(row: &[f32]) {
    let mut codes = vec![0u8; row.len()];
    let scale = quantize_row(row, &mut codes);
    let absmax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert_eq!(scale, absmax / 127.0);
    let s = scale as f64;
    for (&x, &c) in row.iter().zip(&codes) {
        let c = c as i8;
        assert!(c != i8::MIN, "code -128 is never used (symmetric range)");
        let err = (x as f64 - c as f64 * s).abs();
        let bound = s * (0.5 + 2f64.powi(-14)) + 2f64.powi(-140);
        assert!(err <= bound, "x {x:e} code {c} scale {scale:e}: error {err:e} > {bound:e}");
    }
    // f32 dequantisation adds at most its own rounding.
    let mut back = vec![0f32; row.len()];
    dequantize_row(&codes, scale, &mut back);
    for ((&x, &y), &c) in row.iter().zip(&back).zip(&codes) {
        assert_eq!(y, (c as i8) as f32 * scale);
        let bound = s * (0.5 + 2f64.powi(-14)) + 2f64.powi(-140) + (y as f64).abs() * f32::EPSILON as f64;
        assert!((x as f64 - y as f64).abs() <= bound);
    }
}

fn any_finite() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -10.0f32..10.0,
        1 => prop::num::f32::NORMAL | prop::num::f32::SUBNORMAL | prop::num::f32::ZERO,
        1 => prop::sample::select(vec![f32::MAX, f32::MIN, f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1e-45, 0.0, -0.0]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn round_trip_error_is_at_most_half_a_step(row in prop::collection::vec(any_finite(), 1..80)) {
        check_bound(&row);
    }

    #[test]
    fn the_largest_magnitude_gets_code_127(row in prop::collection::vec(-1e6f32..1e6, 1..64)) {
        let mut codes = vec![0u8; row.len()];
        let scale = quantize_row(&row, &mut codes);
        let (i, &x) = row.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap();
        if scale > 0.0 {
            prop_assert_eq!((codes[i] as i8).unsigned_abs(), 127);
            prop_assert_eq!((codes[i] as i8).signum() as f32, x.signum());
        }
    }
}

#[test]
fn zero_rows_and_extremes() {
    let mut codes = vec![7u8; 5];
    assert_eq!(quantize_row(&[0.0f32, -0.0, 0.0, 0.0, 0.0], &mut codes), 0.0);
    assert!(codes.iter().all(|&c| c == 0));
    for row in [
        vec![f32::MAX, f32::MIN, 0.0, 1.0],
        vec![1e-45, -1e-45, 0.0],
        vec![f32::MIN_POSITIVE, 3e-39, -1e-40],
        vec![1.0, 1e-30, -1e30],
    ] {
        check_bound(&row);
    }
}

/// `[heads, n, dim]` keys around a few centres per head.
fn keys(heads: usize, n: usize, dim: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(heads * n * dim);
    for _ in 0..heads {
        let centres: Vec<f32> = (0..6 * dim).map(|_| 3.0 * rng.sample::<f32, _>(StandardNormal)).collect();
        for _ in 0..n {
            let c = rng.gen_range(0..6);
            out.extend((0..dim).map(|j| centres[c * dim + j] + rng.sample::<f32, _>(StandardNormal)));
        }
    }
    out
}

fn forest(k: &[f32], heads: usize, dim: usize, page_size: usize, seed: u64) -> HeadForest {
    let mut cfg = Config::new(dim, Metric::InnerProduct);
    cfg.seed = Some(seed);
    cfg.promotion = vec![0.06, 0.2];
    HeadForest::build(KeyData::F32(k), heads, cfg, page_size).unwrap()
}

/// Every token's slot holds the codes and scale of quantising its row (`src` `[heads, len,
/// dim]`, bf16 widened), bit for bit; empty slots are zero bytes.
fn check_int8_store(f: &HeadForest, src: &[bf16], store: &[u8], pages: usize) {
    let (d, s, n) = (f.dim(), f.page_size(), f.len());
    let pb = int8::page_bytes(s, d);
    assert_eq!(store.len(), f.num_heads() * pages * pb);
    for h in 0..f.num_heads() {
        for p in 0..pages {
            let page = &store[(h * pages + p) * pb..(h * pages + p + 1) * pb];
            let tokens = if p < f.num_pages(h).unwrap() { f.page_tokens(h, p).unwrap() } else { &[] };
            for slot in 0..s {
                let (codes, scale) = row_parts(page, slot, s, d);
                match tokens.get(slot) {
                    Some(&t) => {
                        let row = &src[(h * n + t as usize) * d..(h * n + t as usize + 1) * d];
                        let mut want = vec![0u8; d];
                        let wide: Vec<f32> = row.iter().map(|x| x.to_f32()).collect();
                        let want_scale = quantize_row(&wide, &mut want);
                        assert_eq!((codes, scale), (&want[..], want_scale), "head {h} token {t}");
                    }
                    None => assert!(codes.iter().all(|&c| c == 0) && scale == 0.0, "empty slot {slot} of page {p}"),
                }
            }
        }
    }
}

fn bf16s(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// `[H, lo..hi, d]` of `[H, total, d]`.
fn head_rows<T: Copy>(src: &[T], h: usize, total: usize, d: usize, lo: usize, hi: usize) -> Vec<T> {
    (0..h).flat_map(|hh| src[(hh * total + lo) * d..(hh * total + hi) * d].to_vec()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    /// write_pages_int8 then many inserts (with page splits): the stores always hold the
    /// quantised rows of exactly the tokens the page lists name, as bf16 sources give them.
    #[test]
    fn write_and_insert_hold_the_quantised_tokens(seed in 0u64..1000, n in 40usize..200, page_size in 8usize..=16) {
        let (h, d) = (2, 8);
        let total = n + 300;
        let k32 = keys(h, total, d, seed);
        let v32: Vec<f32> = k32.iter().map(|x| 0.5 - 2.0 * x).collect();
        let (k, v) = (bf16s(&k32), bf16s(&v32));
        let as_bits = |x: &[bf16]| -> Vec<u16> { x.iter().map(|b| b.to_bits()).collect() };
        let mut f = forest(&head_rows(&k32, h, total, d, 0, n), h, d, page_size, seed);
        let pages = f.max_pages() + 400;
        let pb = int8::page_bytes(page_size, d);
        let (mut ks, mut vs) = (vec![0xAAu8; h * pages * pb], vec![0xAAu8; h * pages * pb]);
        let (k0, v0) = (as_bits(&head_rows(&k, h, total, d, 0, n)), as_bits(&head_rows(&v, h, total, d, 0, n)));
        f.write_pages_int8(&k0, &v0, &mut ks, &mut vs).unwrap();
        check_int8_store(&f, &head_rows(&k, h, total, d, 0, n), &ks, pages);
        let mut pos = n;
        let mut moved = false;
        while pos < total {
            let m = (total - pos).min(page_size);
            let before = f.token_map(0).unwrap().to_vec();
            let (kn, vn) = (as_bits(&head_rows(&k, h, total, d, pos, pos + m)), as_bits(&head_rows(&v, h, total, d, pos, pos + m)));
            f.insert_int8(&kn, &vn, &mut ks, &mut vs).unwrap();
            moved |= before.iter().zip(f.token_map(0).unwrap()).any(|(a, b)| a != b);
            pos += m;
        }
        prop_assert!(moved, "no insert split a page");
        check_int8_store(&f, &k, &ks, pages);
        check_int8_store(&f, &v, &vs, pages);
    }
}

#[test]
fn int8_writes_refuse_non_finite_values_and_change_nothing() {
    let (h, n, d, s) = (2, 60, 8, 8);
    let k = keys(h, n, d, 3);
    let mut f = forest(&k, h, d, s, 3);
    let pb = int8::page_bytes(s, d);
    let pages = f.max_pages() + 4;
    let (mut ks, mut vs) = (vec![0u8; h * pages * pb], vec![0u8; h * pages * pb]);
    let mut bad_v = k.clone();
    bad_v[5] = f32::INFINITY;
    assert!(f.write_pages_int8(&k, &bad_v, &mut ks, &mut vs).is_err());
    assert!(ks.iter().chain(&vs).all(|&b| b == 0), "a refused write changed the stores");
    f.write_pages_int8(&k, &k, &mut ks, &mut vs).unwrap();
    let (ks0, vs0, map0) = (ks.clone(), vs.clone(), f.token_map(0).unwrap().to_vec());
    let new = keys(h, 2, d, 4);
    let mut bad = new.clone();
    bad[3] = f32::NAN;
    assert!(f.insert_int8(&new, &bad, &mut ks, &mut vs).is_err());
    assert!(f.insert_int8(&new, &new, &mut ks[..pb], &mut vs[..pb]).is_err(), "stores too small");
    assert_eq!((f.len(), f.token_map(0).unwrap()), (n, &map0[..]));
    assert!(ks == ks0 && vs == vs0, "a refused insert changed the stores");
}
