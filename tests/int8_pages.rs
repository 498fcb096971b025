//! Tests of quantised page stores: the 8-bit row quantiser's error bound, and `write_pages` /
//! `insert` into 8-bit stores and into 8-bit K / 4-bit V stores (with page splits) holding the
//! quantised K/V of exactly the tokens the page lists say.

use half::bf16;
use icecache::pages::int8::{self, dequantize_row, quantize_row, row_parts};
use icecache::pages::{value4, PageFormat, Stores};
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

fn forest(k: KeyData<'_>, heads: usize, dim: usize, page_size: usize, seed: u64) -> HeadForest {
    forest_as(k, heads, dim, page_size, seed, PageFormat::Int8)
}

fn forest_as(k: KeyData<'_>, heads: usize, dim: usize, page_size: usize, seed: u64, format: PageFormat) -> HeadForest {
    let mut cfg = Config::new(dim, Metric::InnerProduct);
    cfg.seed = Some(seed);
    cfg.promotion = vec![0.06, 0.2];
    HeadForest::build(k, heads, cfg, page_size, format).unwrap()
}

/// Every token's slot holds the codes and scale of quantising its row (`src` `[heads, len,
/// dim]`, bf16 widened), bit for bit; the empty slots of the forest's pages are zero bytes
/// (pages past them are the store's room, never read).
fn check_int8_store(f: &HeadForest, src: &[bf16], store: &[u8], pages: usize) {
    let (d, s, n) = (f.dim(), f.page_size(), f.len());
    let pb = int8::page_bytes(s, d);
    assert_eq!(store.len(), f.num_heads() * pages * pb);
    for h in 0..f.num_heads() {
        for p in 0..f.num_pages(h).unwrap() {
            let page = &store[(h * pages + p) * pb..(h * pages + p + 1) * pb];
            let tokens = f.page_tokens(h, p).unwrap();
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

/// Every token's slot of a 4-bit V store dequantises within half a step of its row (`src`
/// `[heads, len, dim]`), each group's step being at most its span over 15 rounded up to
/// bfloat16 (its minimum rounded down); empty slots dequantise to 0.
fn check_value4_store(f: &HeadForest, src: &[bf16], store: &[u8], pages: usize) {
    let (d, s, n) = (f.dim(), f.page_size(), f.len());
    let pb = value4::page_bytes(s, d);
    assert_eq!(store.len(), f.num_heads() * pages * pb);
    let mut back = vec![0f32; d];
    for h in 0..f.num_heads() {
        for p in 0..f.num_pages(h).unwrap() {
            let page = &store[(h * pages + p) * pb..(h * pages + p + 1) * pb];
            let tokens = f.page_tokens(h, p).unwrap();
            for slot in 0..s {
                value4::get_row(page, slot, s, &mut back);
                let Some(&t) = tokens.get(slot) else {
                    assert!(back.iter().all(|&x| x == 0.0), "empty slot {slot} of page {p}");
                    continue;
                };
                let row: Vec<f32> =
                    src[(h * n + t as usize) * d..(h * n + t as usize + 1) * d].iter().map(|x| x.to_f32()).collect();
                for (group, got) in row.chunks(value4::GROUP).zip(back.chunks(value4::GROUP)) {
                    let lo = group.iter().cloned().fold(f32::INFINITY, f32::min);
                    let hi = group.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let step = (hi - lo + lo.abs() * 2f32.powi(-7)) / 15.0 * (1.0 + 2f32.powi(-6));
                    for (x, y) in group.iter().zip(got) {
                        assert!((x - y).abs() <= step * 0.5 + 1e-6, "head {h} token {t}: {x} vs {y} (step {step})");
                    }
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

    /// write_pages then many inserts (with page splits): the stores always hold the
    /// quantised rows of exactly the tokens the page lists name, as bf16 sources give them.
    #[test]
    fn write_and_insert_hold_the_quantised_tokens(seed in 0u64..1000, n in 40usize..200, page_size in 8usize..=16) {
        let (h, d) = (2, 8);
        let total = n + 300;
        let k32 = keys(h, total, d, seed);
        let v32: Vec<f32> = k32.iter().map(|x| 0.5 - 2.0 * x).collect();
        let (k, v) = (bf16s(&k32), bf16s(&v32));
        let as_bits = |x: &[bf16]| -> Vec<u16> { x.iter().map(|b| b.to_bits()).collect() };
        // Built on the keys it stores: a forest's stores take its own keys only.
        let mut f = forest(KeyData::Bf16(&head_rows(&k, h, total, d, 0, n)), h, d, page_size, seed);
        let pages = f.max_pages() + 400;
        let pb = int8::page_bytes(page_size, d);
        let (mut ks, mut vs) = (vec![0xAAu8; h * pages * pb], vec![0xAAu8; h * pages * pb]);
        let (k0, v0) = (as_bits(&head_rows(&k, h, total, d, 0, n)), as_bits(&head_rows(&v, h, total, d, 0, n)));
        f.write_pages(&k0, &v0, Stores::Int8(&mut ks, &mut vs)).unwrap();
        check_int8_store(&f, &head_rows(&k, h, total, d, 0, n), &ks, pages);
        let mut pos = n;
        let mut moved = false;
        while pos < total {
            let m = (total - pos).min(page_size);
            let before = f.token_map(0).unwrap().to_vec();
            let (kn, vn) = (as_bits(&head_rows(&k, h, total, d, pos, pos + m)), as_bits(&head_rows(&v, h, total, d, pos, pos + m)));
            f.insert(&kn, &vn, Stores::Int8(&mut ks, &mut vs)).unwrap();
            moved |= before.iter().zip(&f.token_map(0).unwrap()).any(|(a, b)| a != b);
            pos += m;
        }
        prop_assert!(moved, "no insert split a page");
        check_int8_store(&f, &k, &ks, pages);
        check_int8_store(&f, &v, &vs, pages);
    }

    /// The same with 4-bit V pages (`k8v4`): K pages as 8-bit ones, V within half a step.
    #[test]
    fn k8v4_write_and_insert_hold_the_quantised_tokens(seed in 0u64..1000, n in 40usize..200, page_size in 8usize..=16, d in prop::sample::select(vec![8usize, 40, 64])) {
        let h = 2;
        let total = n + 300;
        let k32 = keys(h, total, d, seed);
        let v32: Vec<f32> = k32.iter().map(|x| 0.5 - 2.0 * x).collect();
        let (k, v) = (bf16s(&k32), bf16s(&v32));
        let as_bits = |x: &[bf16]| -> Vec<u16> { x.iter().map(|b| b.to_bits()).collect() };
        let mut f = forest_as(KeyData::Bf16(&head_rows(&k, h, total, d, 0, n)), h, d, page_size, seed, PageFormat::K8V4);
        let pages = f.max_pages() + 400;
        let (kb, vb) = (int8::page_bytes(page_size, d), value4::page_bytes(page_size, d));
        let (mut ks, mut vs) = (vec![0xAAu8; h * pages * kb], vec![0xAAu8; h * pages * vb]);
        let (k0, v0) = (as_bits(&head_rows(&k, h, total, d, 0, n)), as_bits(&head_rows(&v, h, total, d, 0, n)));
        f.write_pages(&k0, &v0, Stores::K8V4(&mut ks, &mut vs)).unwrap();
        check_value4_store(&f, &head_rows(&v, h, total, d, 0, n), &vs, pages);
        let mut pos = n;
        while pos < total {
            let m = (total - pos).min(page_size);
            let (kn, vn) = (as_bits(&head_rows(&k, h, total, d, pos, pos + m)), as_bits(&head_rows(&v, h, total, d, pos, pos + m)));
            f.insert(&kn, &vn, Stores::K8V4(&mut ks, &mut vs)).unwrap();
            pos += m;
        }
        check_int8_store(&f, &k, &ks, pages);
        check_value4_store(&f, &v, &vs, pages);
        // Stores of the other layout are refused.
        prop_assert!(f.insert(&kn_of(&k, h, total, d), &kn_of(&v, h, total, d), Stores::Int8(&mut ks, &mut vs)).is_err());
    }
}

/// One token per head (the first), as bf16 bits.
fn kn_of(x: &[bf16], h: usize, total: usize, d: usize) -> Vec<u16> {
    head_rows(x, h, total, d, 0, 1).iter().map(|b| b.to_bits()).collect()
}

#[test]
fn int8_writes_refuse_non_finite_values_and_change_nothing() {
    let (h, n, d, s) = (2, 60, 8, 8);
    let k = keys(h, n, d, 3);
    let mut f = forest(KeyData::F32(&k), h, d, s, 3);
    let pb = int8::page_bytes(s, d);
    let pages = f.max_pages() + 4;
    let (mut ks, mut vs) = (vec![0u8; h * pages * pb], vec![0u8; h * pages * pb]);
    let mut bad_v = k.clone();
    bad_v[5] = f32::INFINITY;
    assert!(f.write_pages(&k, &bad_v, Stores::Int8(&mut ks, &mut vs)).is_err());
    assert!(ks.iter().chain(&vs).all(|&b| b == 0), "a refused write changed the stores");
    f.write_pages(&k, &k, Stores::Int8(&mut ks, &mut vs)).unwrap();
    let (ks0, vs0, map0) = (ks.clone(), vs.clone(), f.token_map(0).unwrap().to_vec());
    let new = keys(h, 2, d, 4);
    let mut bad = new.clone();
    bad[3] = f32::NAN;
    assert!(f.insert(&new, &bad, Stores::Int8(&mut ks, &mut vs)).is_err());
    assert!(f.insert(&new, &new, Stores::Int8(&mut ks[..pb], &mut vs[..pb])).is_err(), "stores too small");
    assert_eq!((f.len(), f.token_map(0).unwrap()), (n, map0));
    assert!(ks == ks0 && vs == vs0, "a refused insert changed the stores");
}

/// A forest of 8-bit stores reads its keys from the K store; one of 16-bit stores keeps the
/// same int8 rows itself. Built, grown and asked alike, they select the same pages.
#[test]
fn selections_from_the_k_store_equal_those_from_the_forests_own_rows() {
    use icecache::SelectParams;
    let (h, n, m, d, s, g) = (2, 600, 500, 16, 16, 3);
    let total = n + m;
    let k = keys(h, total, d, 11);
    let v: Vec<f32> = k.iter().map(|x| 1.0 - x).collect();
    let cfg = |seed| {
        let mut c = Config::new(d, Metric::InnerProduct);
        c.seed = Some(seed);
        c.promotion = vec![0.03, 0.2];
        c
    };
    let (k0, v0) = (head_rows(&k, h, total, d, 0, n), head_rows(&v, h, total, d, 0, n));
    let mut own = HeadForest::build(KeyData::F32(&k0), h, cfg(4), s, PageFormat::Native).unwrap();
    let mut int8 = HeadForest::build(KeyData::F32(&k0), h, cfg(4), s, PageFormat::Int8).unwrap();
    let pages = own.max_pages() + m + 1;
    let pb = int8::page_bytes(s, d);
    let (mut fk, mut fv) = (vec![0f32; h * pages * s * d], vec![0f32; h * pages * s * d]);
    let (mut bk, mut bv) = (vec![0u8; h * pages * pb], vec![0u8; h * pages * pb]);
    own.write_pages(&k0, &v0, Stores::Native(&mut fk, &mut fv)).unwrap();
    int8.write_pages(&k0, &v0, Stores::Int8(&mut bk, &mut bv)).unwrap();
    let queries = keys(1, 8 * h * g, d, 12);
    let compare = |own: &HeadForest, int8: &HeadForest, bk: &[u8]| {
        for (i, q) in queries.chunks_exact(h * g * d).enumerate() {
            for (effort, exact, successors, group_view) in
                [(1.0, false, 0, false), (0.5, false, 8, false), (1.0, false, 8, true), (1.0, true, 0, false)]
            {
                let p = SelectParams { max_pages: 6, scale: 0.3, effort: Some(effort), exact, successors, group_view };
                let a = own.select(q, p, None).unwrap();
                let b = int8.select(q, p, Some(bk)).unwrap();
                assert_eq!(a, b, "query {i}, {p:?}");
            }
        }
    };
    compare(&own, &int8, &bk);
    // It reads them there: negated codes (past each head's page 0, which marks the store as
    // the forest's) turn its choices around; and it keeps no rows itself.
    let mut negated = bk.clone();
    for (i, page) in negated.chunks_exact_mut(pb).enumerate() {
        if i % pages != 0 {
            page[..s * d].iter_mut().for_each(|c| *c = (*c as i8).wrapping_neg() as u8);
        }
    }
    let p = SelectParams { max_pages: 6, scale: 0.3, effort: Some(1.0), exact: true, successors: 0, group_view: false };
    let q = &queries[..h * g * d];
    assert_ne!(int8.select(q, p, Some(&bk)).unwrap(), int8.select(q, p, Some(&negated)).unwrap());
    // A store whose page 0 is not the forest's is not its store.
    negated[..s * d].iter_mut().for_each(|c| *c = (*c as i8).wrapping_neg() as u8);
    let err = int8.select(q, p, Some(&negated)).unwrap_err().to_string();
    assert!(err.contains("does not hold this forest's pages"), "{err}");
    assert!(int8.nbytes() + h * n * (d + 4) <= own.nbytes(), "{} vs {}", int8.nbytes(), own.nbytes());
    // The 8-bit forest refuses to select without its K store, the other with one.
    let p = SelectParams { max_pages: 6, scale: 0.3, effort: None, exact: false, successors: 0, group_view: false };
    assert!(int8.select(&queries[..h * g * d], p, None).is_err());
    assert!(own.select(&queries[..h * g * d], p, Some(&bk)).is_err());
    for a in (n..total).step_by(s) {
        let b = (a + s).min(total);
        let (kn, vn) = (head_rows(&k, h, total, d, a, b), head_rows(&v, h, total, d, a, b));
        let x = own.insert(&kn, &vn, Stores::Native(&mut fk, &mut fv)).unwrap();
        let y = int8.insert(&kn, &vn, Stores::Int8(&mut bk, &mut bv)).unwrap();
        assert_eq!(x, y, "inserts {a}..{b} changed other pages");
    }
    own.validate().unwrap();
    int8.validate().unwrap();
    compare(&own, &int8, &bk);
}
