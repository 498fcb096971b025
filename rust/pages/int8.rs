//! 8-bit page stores (`page_format="int8"`): K and V rows as int8 codes with one f32 scale per
//! (head, token) row, `scale = max|x| / 127`, `x ≈ code · scale`.
//!
//! A page is `page_size · d` codes, then `page_size` scales (native-endian f32, as the device
//! reads them), so that a page stays one contiguous block (the gather copies pages whole) and its
//! scales stay 4-byte aligned for the device's view of them. f32 scales rather than f16: they
//! hold the scale of any bf16/f16/f32 row (an f16 scale overflows past rows of about 8e6 and
//! loses small rows), for 2 bytes a row more (at d = 64, 68 bytes a row instead of 66; bf16 rows
//! are 128).

/// Bytes of one row's scale.
pub const SCALE_BYTES: usize = 4;

/// Bytes of one int8 page of `page_size` rows of `dim` values.
pub fn page_bytes(page_size: usize, dim: usize) -> usize {
    page_size * (dim + SCALE_BYTES)
}

/// Rows whose largest magnitude is below this are quantised in f64: the vectorised quantiser's
/// `127 / max|x|` overflows f32 for them.
const SMALL_ROW: f32 = 1e-30;

/// Quantises one row: writes its codes (the first `row.len()` bytes of `codes`, two's complement
/// int8) and returns its scale `max|x| / 127`. Codes are `round(x / scale)` in `-127..=127`
/// (`simd::quantize_i8`, the index's quantiser), so every element is within
/// `scale · (1/2 + 2^-14)` of `code · scale` (computed exactly; the `2^-14` covers the f32
/// rounding of `x · (127 / max|x|)`). Rows below `SMALL_ROW` are quantised in f64: within
/// `scale / 2`, and `2^-140` where the scale is subnormal. A zero row has scale 0 and codes 0.
/// Rows must be finite (callers check).
pub fn quantize_row(row: &[f32], codes: &mut [u8]) -> f32 {
    let codes = &mut codes[..row.len()];
    // SAFETY: `u8` and `i8` have the same size and alignment, and every bit pattern is valid
    // for both; the reborrow ends before `codes` is used again.
    let signed = unsafe { std::slice::from_raw_parts_mut(codes.as_mut_ptr() as *mut i8, codes.len()) };
    let scale = crate::simd::quantize_i8(row, signed);
    if scale == 0.0 || scale * 127.0 >= SMALL_ROW {
        return scale;
    }
    let s = scale as f64;
    for (c, &x) in codes.iter_mut().zip(row) {
        *c = ((x as f64 / s).round().clamp(-127.0, 127.0) as i8) as u8;
    }
    scale
}

/// `code · scale` of each code of a row, into `out`.
pub fn dequantize_row(codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = (c as i8) as f32 * scale;
    }
}

/// Row `slot`'s codes and scale bytes of one page of `page_size` rows of `dim`.
pub fn row_parts(page: &[u8], slot: usize, page_size: usize, dim: usize) -> (&[u8], f32) {
    let codes = &page[slot * dim..(slot + 1) * dim];
    let at = page_size * dim + slot * SCALE_BYTES;
    let scale = f32::from_ne_bytes(page[at..at + SCALE_BYTES].try_into().expect("4 bytes"));
    (codes, scale)
}

/// The int8 K rows of a head's pages: `page_bytes(page_size, dim)` bytes a page (codes, then
/// scales), as the 8-bit stores hold them.
#[derive(Clone, Copy)]
pub(crate) struct PageCodes<'a> {
    pub bytes: &'a [u8],
    pub page_size: usize,
    pub dim: usize,
}

impl<'a> PageCodes<'a> {
    fn page(&self, page: u32) -> &'a [u8] {
        let n = page_bytes(self.page_size, self.dim);
        &self.bytes[page as usize * n..(page as usize + 1) * n]
    }

    /// The codes of the first `len` rows of `page`, `[len, dim]`.
    pub fn rows(&self, page: u32, len: usize) -> &'a [i8] {
        bytemuck::cast_slice(&self.page(page)[..len * self.dim])
    }

    /// Asks the CPU to start loading `page`'s first `len` rows and their scales into cache (a
    /// hint: no effect where the target has no prefetch instruction).
    pub fn prefetch(&self, page: u32, len: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let bytes = self.page(page);
            let scales = self.page_size * self.dim;
            let lines = bytes[..len * self.dim].chunks(64).chain(bytes[scales..scales + len * SCALE_BYTES].chunks(64));
            for line in lines {
                // SAFETY: a prefetch never faults and changes no state but the cache; the
                // address is inside a live slice.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr() as *const i8)
                };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (page, len);
    }

    /// The scales of the first `len` rows of `page`.
    pub fn scales(&self, page: u32, len: usize) -> impl Iterator<Item = f32> + 'a {
        let at = self.page_size * self.dim;
        self.page(page)[at..at + len * SCALE_BYTES]
            .chunks_exact(SCALE_BYTES)
            .map(|b| f32::from_ne_bytes(b.try_into().expect("4 bytes")))
    }

    /// Row `slot` of `page`, dequantised into `out` (`dim` floats).
    pub fn row(&self, page: u32, slot: usize, out: &mut [f32]) {
        let (codes, scale) = row_parts(self.page(page), slot, self.page_size, self.dim);
        dequantize_row(codes, scale, out);
    }
}

/// Quantises `row` into slot `slot` of `page`.
pub(crate) fn put_row(page: &mut [u8], slot: usize, row: &[f32], s: usize) {
    let d = row.len();
    let scale = quantize_row(row, &mut page[slot * d..(slot + 1) * d]);
    let at = s * d + slot * SCALE_BYTES;
    page[at..at + SCALE_BYTES].copy_from_slice(&scale.to_ne_bytes());
}

/// Copies row `from` of `src` (a page) into row `to` of `dst` (another page), codes and scale:
/// moving a token between pages never quantises it again.
pub(crate) fn copy_row(src: &[u8], from: usize, dst: &mut [u8], to: usize, s: usize, d: usize) {
    dst[to * d..(to + 1) * d].copy_from_slice(&src[from * d..(from + 1) * d]);
    let (a, b) = (s * d + from * SCALE_BYTES, s * d + to * SCALE_BYTES);
    dst[b..b + SCALE_BYTES].copy_from_slice(&src[a..a + SCALE_BYTES]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_scale_of_a_known_row() {
        let row = [1.0f32, -0.3, 0.0, 0.1, -1.0];
        let mut codes = [0u8; 5];
        let s = quantize_row(&row, &mut codes);
        assert_eq!(s, 1.0 / 127.0);
        let got: Vec<i8> = codes.iter().map(|&c| c as i8).collect();
        assert_eq!(got, [127, -38, 0, 13, -127]); // -38.1 and 12.7 to the nearest code
    }
}
