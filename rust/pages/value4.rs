//! 4-bit V rows (`page_format="k8v4"`: 8-bit K pages as in [`super::int8`], 4-bit V pages).
//!
//! Each row is cut into groups of [`GROUP`] values (the last one shorter when `d` is not a
//! multiple), and each group is quantised asymmetrically: `x ≈ min + code · step` with codes in
//! `0..=15`. Asymmetric groups were the most accurate 4-bit values measured (attention output
//! error 1.4e-2 against 2.1e-2 for symmetric groups and 2.6e-2 for one scale a row); keys stay
//! 8-bit, as the index scores them.
//!
//! A page is `codes_bytes(page_size, d)` bytes of codes, two a byte (value `2j` in the low
//! nibble of byte `j` of its row, `2j + 1` in the high one; rows of `d.div_ceil(2)` bytes, the
//! whole padded to an even size), then `[page_size, groups(d), 2]` bfloat16 `(step, min)` as
//! native-endian `u16` bits, 2-byte aligned for the device's view of them. bfloat16 rather
//! than f16: it holds the groups of any bf16/f16/f32 row. `min` is rounded down and `step` up
//! to bfloat16 before the codes are chosen, so that every value of the group is within
//! `step / 2` (and the f32 rounding of the division) of its code's value.

use half::bf16;

/// Values per group.
pub const GROUP: usize = 32;

/// Bytes of one group's parameters: bfloat16 step and minimum.
const PARAM_BYTES: usize = 4;

/// Groups of a row of `dim` values.
pub fn groups(dim: usize) -> usize {
    dim.div_ceil(GROUP)
}

/// Bytes of the codes of a page (padded to keep the parameters 2-byte aligned).
pub fn codes_bytes(page_size: usize, dim: usize) -> usize {
    (page_size * dim.div_ceil(2)).next_multiple_of(2)
}

/// Bytes of one 4-bit page of `page_size` rows of `dim` values.
pub fn page_bytes(page_size: usize, dim: usize) -> usize {
    codes_bytes(page_size, dim) + page_size * groups(dim) * PARAM_BYTES
}

/// `x` rounded to bfloat16 towards minus infinity (`down`) or plus infinity; `x` finite.
fn bf16_directed(x: f32, down: bool) -> bf16 {
    let near = bf16::from_f32(x);
    let back = near.to_f32();
    if back == x || (back < x) == down {
        return near;
    }
    // One representable value further in the direction wanted. bfloat16 bits order like
    // sign and magnitude: a larger magnitude has larger bits.
    let bits = near.to_bits();
    let stepped = match (back == 0.0, back > 0.0) {
        (true, _) => {
            if down {
                0x8001 // the smallest negative subnormal
            } else {
                0x0001
            }
        }
        (false, positive) => {
            if positive == down {
                bits - 1
            } else {
                bits + 1
            }
        }
    };
    bf16::from_bits(stepped)
}

/// Smallest and largest value of `group`, by 8 lanes (compare-and-select: vectorised).
fn min_max(group: &[f32]) -> (f32, f32) {
    let (mut lo, mut hi) = ([f32::INFINITY; 8], [f32::NEG_INFINITY; 8]);
    let mut chunks = group.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
        }
    }
    let fold = |a: [f32; 8], tail: &[f32], f: fn(f32, f32) -> f32| a.into_iter().chain(tail.iter().copied()).reduce(f);
    let rest = chunks.remainder();
    (fold(lo, rest, f32::min).unwrap_or(0.0), fold(hi, rest, f32::max).unwrap_or(0.0))
}

/// Quantises `row` (finite) into slot `slot` of `page` (a page of `s` rows).
pub(crate) fn put_row(page: &mut [u8], slot: usize, row: &[f32], s: usize) {
    let d = row.len();
    let half_row = d.div_ceil(2);
    let params_at = slot * groups(d) * PARAM_BYTES;
    let (codes_part, params) = page.split_at_mut(codes_bytes(s, d));
    let codes = &mut codes_part[slot * half_row..(slot + 1) * half_row];
    for (g, group) in row.chunks(GROUP).enumerate() {
        let (lo, hi) = min_max(group);
        let min = bf16_directed(lo, true);
        // In f64: the span of a row near f32's limits overflows f32.
        let step = bf16_directed((((hi as f64) - min.to_f32() as f64) / 15.0).min(f32::MAX as f64) as f32, false);
        let (m, st) = (min.to_f32(), step.to_f32());
        let inv = if st > 0.0 { 1.0 / st } else { 0.0 };
        // x >= m, so rounding is adding a half and truncating (no libm call: vectorised); the
        // cast saturates, the clamp keeps 15 for values rounded past the top.
        let code = |x: f32| (((x - m) * inv + 0.5) as u8).min(15);
        // GROUP is even: a group's values fill whole bytes, the last group's odd tail excepted.
        for (pair, byte) in group.chunks(2).zip(&mut codes[g * GROUP / 2..]) {
            *byte = code(pair[0]) | pair.get(1).map_or(0, |&x| code(x) << 4);
        }
        let p = params_at + g * PARAM_BYTES;
        params[p..p + 2].copy_from_slice(&step.to_bits().to_ne_bytes());
        params[p + 2..p + 4].copy_from_slice(&min.to_bits().to_ne_bytes());
    }
}

/// Row `slot` of a page of `s` rows of `out.len()` values, dequantised into `out`.
pub fn get_row(page: &[u8], slot: usize, s: usize, out: &mut [f32]) {
    let d = out.len();
    let half_row = d.div_ceil(2);
    let codes = &page[slot * half_row..(slot + 1) * half_row];
    let params_at = codes_bytes(s, d) + slot * groups(d) * PARAM_BYTES;
    for (i, o) in out.iter_mut().enumerate() {
        let p = params_at + (i / GROUP) * PARAM_BYTES;
        let step = bf16::from_bits(u16::from_ne_bytes([page[p], page[p + 1]])).to_f32();
        let min = bf16::from_bits(u16::from_ne_bytes([page[p + 2], page[p + 3]])).to_f32();
        let code = (codes[i / 2] >> (4 * (i % 2))) & 0xf;
        *o = min + code as f32 * step;
    }
}

/// Copies row `from` of `src` (a page) into row `to` of `dst` (another page), codes and
/// parameters: moving a token between pages never quantises it again.
pub(crate) fn copy_row(src: &[u8], from: usize, dst: &mut [u8], to: usize, s: usize, d: usize) {
    let half_row = d.div_ceil(2);
    dst[to * half_row..(to + 1) * half_row].copy_from_slice(&src[from * half_row..(from + 1) * half_row]);
    let (at, row) = (codes_bytes(s, d), groups(d) * PARAM_BYTES);
    let (a, b) = (at + from * row, at + to * row);
    dst[b..b + row].copy_from_slice(&src[a..a + row]);
}

/// Empties rows `from..s` of `page` (codes and parameters: they dequantise to 0).
pub(crate) fn clear_from(page: &mut [u8], from: usize, s: usize, d: usize) {
    let at = codes_bytes(s, d);
    page[from * d.div_ceil(2)..at].fill(0);
    page[at + from * groups(d) * PARAM_BYTES..].fill(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directed_rounding_brackets_the_value() {
        for x in [0.0f32, 1.0, -1.0, 0.1, -0.1, 3.3e-3, -7.77e5, 1e-40, -1e-40, 65504.5] {
            let (lo, hi) = (bf16_directed(x, true).to_f32(), bf16_directed(x, false).to_f32());
            assert!(lo <= x && x <= hi, "{x}: {lo} {hi}");
            assert!(hi - lo <= (x.abs() * 2f32.powi(-7)).max(1e-38), "{x}: {lo} {hi}");
        }
    }

    #[test]
    fn a_row_comes_back_within_half_a_step() {
        // 70 values: two full groups and one of 6, and an odd count of nibbles.
        let s = 3;
        let row: Vec<f32> =
            (0..70).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37 + if i >= 64 { 100.0 } else { 0.0 }).collect();
        let mut page = vec![0xffu8; page_bytes(s, row.len())];
        clear_from(&mut page, 0, s, row.len());
        put_row(&mut page, 1, &row, s);
        let mut out = vec![0f32; row.len()];
        get_row(&page, 1, s, &mut out);
        for (g, (a, b)) in row.chunks(GROUP).zip(out.chunks(GROUP)).enumerate() {
            let (lo, hi) = a.iter().fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
            let step = (hi - lo) / 15.0;
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= step * 0.51 + 1e-6, "group {g}: {x} vs {y} (step {step})");
            }
        }
        // The other rows are empty.
        get_row(&page, 0, s, &mut out);
        assert!(out.iter().all(|&x| x == 0.0));
        // A copy moves the row unchanged.
        let mut other = vec![0u8; page.len()];
        copy_row(&page, 1, &mut other, 2, s, row.len());
        let mut moved = vec![0f32; row.len()];
        get_row(&other, 2, s, &mut moved);
        get_row(&page, 1, s, &mut out);
        assert_eq!(moved, out);
    }

    #[test]
    fn constant_and_zero_groups() {
        let s = 1;
        let mut page = vec![0u8; page_bytes(s, 64)];
        let row: Vec<f32> = (0..64).map(|i| if i < 32 { 0.0 } else { 2.5 }).collect();
        put_row(&mut page, 0, &row, s);
        let mut out = vec![9f32; 64];
        get_row(&page, 0, s, &mut out);
        assert_eq!(out, row); // 0 and 2.5 are bfloat16 values: exact
    }
}
