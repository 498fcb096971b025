//! Hot arithmetic kernels, compiled once per x86-64 feature level and picked at run time
//! (the wheel targets baseline x86-64; AVX2/AVX-512 machines still get wide vectors).

use multiversion::multiversion;

/// f32 dot product. Sixteen independent accumulators (one per lane) let LLVM keep several FMA
/// chains in flight.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s = x.mul_add(*y, s);
    }
    s
}

/// Squared Euclidean distance.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn sq_dist(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            let d = x[i] - y[i];
            acc[i] = d.mul_add(d, acc[i]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        let d = x - y;
        s = d.mul_add(d, s);
    }
    s
}

/// Sum of 16 lanes as a tree: four dependent adds instead of fifteen.
#[inline(always)]
fn hsum16(a: [f32; 16]) -> f32 {
    let mut b = [0f32; 8];
    for i in 0..8 {
        b[i] = a[i] + a[i + 8];
    }
    let c = [b[0] + b[4], b[1] + b[5], b[2] + b[6], b[3] + b[7]];
    (c[0] + c[2]) + (c[1] + c[3])
}

/// Dot products of `q` with four rows at once: four independent FMA chains that share each
/// load of `q`, where one row alone waits on the latency of a single chain.
#[inline(always)]
fn dot4(q: &[f32], r: [&[f32]; 4]) -> [f32; 4] {
    let dim = q.len();
    let (r0, r1, r2, r3) = (&r[0][..dim], &r[1][..dim], &r[2][..dim], &r[3][..dim]);
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; 16], [0f32; 16], [0f32; 16], [0f32; 16]);
    let full = dim - dim % 16;
    let rows = r0.chunks_exact(16).zip(r1.chunks_exact(16)).zip(r2.chunks_exact(16)).zip(r3.chunks_exact(16));
    for (x, (((y0, y1), y2), y3)) in q.chunks_exact(16).zip(rows) {
        for i in 0..16 {
            a0[i] = x[i].mul_add(y0[i], a0[i]);
            a1[i] = x[i].mul_add(y1[i], a1[i]);
            a2[i] = x[i].mul_add(y2[i], a2[i]);
            a3[i] = x[i].mul_add(y3[i], a3[i]);
        }
    }
    let mut out = [hsum16(a0), hsum16(a1), hsum16(a2), hsum16(a3)];
    for j in full..dim {
        for (o, row) in out.iter_mut().zip([r0, r1, r2, r3]) {
            *o = q[j].mul_add(row[j], *o);
        }
    }
    out
}

/// `acc += x · y`, lane-wise.
#[inline(always)]
fn fma16(x: &[f32; 16], y: &[f32; 16], acc: &mut [f32; 16]) {
    for l in 0..16 {
        acc[l] = x[l].mul_add(y[l], acc[l]);
    }
}

/// `hsum16` of each of sixteen accumulators, as a 4 × 4 tile. Out of line on purpose: inlined
/// into `dot4x4`, LLVM vectorises these sums across the accumulators and spoils its FMA loop.
#[inline(never)]
fn hsum16x16(c: &[[f32; 16]; 16]) -> [[f32; 4]; 4] {
    [0, 4, 8, 12].map(|r| [hsum16(c[r]), hsum16(c[r + 1]), hsum16(c[r + 2]), hsum16(c[r + 3])])
}

/// Dot products of four rows with four rows: sixteen FMA chains, each row loaded once for four
/// of them. Each product sums as in `dot4` (bit-identical results). Written out, not looped:
/// LLVM keeps the sixteen accumulators in registers only when every index is a constant.
#[inline(always)]
fn dot4x4(a: [&[f32]; 4], b: [&[f32]; 4]) -> [[f32; 4]; 4] {
    let dim = a[0].len();
    let full = dim / 16;
    let [a0, a1, a2, a3] = a.map(|r| &r[..dim].as_chunks::<16>().0[..full]);
    let [b0, b1, b2, b3] = b.map(|r| &r[..dim].as_chunks::<16>().0[..full]);
    let mut c = [[0f32; 16]; 16];
    for k in 0..full {
        let (x0, x1, x2, x3) = (&a0[k], &a1[k], &a2[k], &a3[k]);
        let (y0, y1, y2, y3) = (&b0[k], &b1[k], &b2[k], &b3[k]);
        fma16(x0, y0, &mut c[0]);
        fma16(x0, y1, &mut c[1]);
        fma16(x0, y2, &mut c[2]);
        fma16(x0, y3, &mut c[3]);
        fma16(x1, y0, &mut c[4]);
        fma16(x1, y1, &mut c[5]);
        fma16(x1, y2, &mut c[6]);
        fma16(x1, y3, &mut c[7]);
        fma16(x2, y0, &mut c[8]);
        fma16(x2, y1, &mut c[9]);
        fma16(x2, y2, &mut c[10]);
        fma16(x2, y3, &mut c[11]);
        fma16(x3, y0, &mut c[12]);
        fma16(x3, y1, &mut c[13]);
        fma16(x3, y2, &mut c[14]);
        fma16(x3, y3, &mut c[15]);
    }
    let mut out = hsum16x16(&c);
    for (i, row) in out.iter_mut().enumerate() {
        for (j, o) in row.iter_mut().enumerate() {
            for k in full * 16..dim {
                *o = a[i][k].mul_add(b[j][k], *o);
            }
        }
    }
    out
}

/// Dot products of one query with `n` consecutive rows of `dim` floats: `out[i] = q · rows[i]`.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn dot_rows(q: &[f32], rows: &[f32], out: &mut [f32]) {
    let dim = q.len();
    let mut quads = rows.chunks_exact(4 * dim);
    let mut outs = out.chunks_exact_mut(4);
    for (r, o) in (&mut quads).zip(&mut outs) {
        let (a, b) = r.split_at(2 * dim);
        o.copy_from_slice(&dot4(q, [&a[..dim], &a[dim..], &b[..dim], &b[dim..]]));
    }
    for (o, r) in outs.into_remainder().iter_mut().zip(quads.remainder().chunks_exact(dim)) {
        *o = dot(q, r);
    }
}

/// Dot products of one query with chosen rows: `out[i] = q · rows[idx[i]]` (rows of `q.len()`).
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn dot_gather(q: &[f32], rows: &[f32], idx: &[u32], out: &mut [f32]) {
    let dim = q.len();
    let row = |i: u32| &rows[i as usize * dim..(i as usize + 1) * dim];
    let mut quads = idx.chunks_exact(4);
    let mut outs = out.chunks_exact_mut(4);
    for (ix, o) in (&mut quads).zip(&mut outs) {
        o.copy_from_slice(&dot4(q, [row(ix[0]), row(ix[1]), row(ix[2]), row(ix[3])]));
    }
    for (o, &i) in outs.into_remainder().iter_mut().zip(quads.remainder()) {
        *o = dot(q, row(i));
    }
}

/// Dot products of chosen rows of `a` with all rows of `b` (rows of `dim` floats):
/// `out[i * nb + j] = a[ia[i]] · b[j]`, `nb` = rows of `b`. Tiles of 4 × 4 load each row once
/// for four products; results equal `dot_gather`'s blocks of four bit for bit.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn dot_cross(dim: usize, a: &[f32], ia: &[u32], b: &[f32], out: &mut [f32]) {
    let nb = b.len() / dim;
    if nb == 0 {
        return;
    }
    let nb4 = nb - nb % 4;
    let arow = |i: u32| &a[i as usize * dim..(i as usize + 1) * dim];
    let brow = |j: usize| &b[j * dim..(j + 1) * dim];
    let b4 = |j: usize| [brow(j), brow(j + 1), brow(j + 2), brow(j + 3)];
    for (ix, o) in ia.chunks(4).zip(out.chunks_mut(4 * nb)) {
        if let &[i0, i1, i2, i3] = ix {
            let ar = [arow(i0), arow(i1), arow(i2), arow(i3)];
            for j in (0..nb4).step_by(4) {
                for (i, row) in dot4x4(ar, b4(j)).iter().enumerate() {
                    o[i * nb + j..i * nb + j + 4].copy_from_slice(row);
                }
            }
            // A column left over: `dot4` with the roles swapped sums the same products.
            for j in nb4..nb {
                for (i, v) in dot4(brow(j), ar).into_iter().enumerate() {
                    o[i * nb + j] = v;
                }
            }
        } else {
            for (&i, orow) in ix.iter().zip(o.chunks_mut(nb)) {
                for j in (0..nb4).step_by(4) {
                    orow[j..j + 4].copy_from_slice(&dot4(arow(i), b4(j)));
                }
                for (j, o) in orow.iter_mut().enumerate().skip(nb4) {
                    *o = dot4(arow(i), [brow(j); 4])[0];
                }
            }
        }
    }
}

/// Dot products of chosen rows of `a` with the `nb` rows of `b` given by column: `bt` is
/// `[dim, stride]` (`bt[k * stride + j]` = `b[j][k]`, `stride` a multiple of 16 that is at least
/// `nb`); `out[i * nb + j] = a[ia[i]] · b[j]`. Each product sums in index order, in one lane, so
/// no horizontal sums are needed: eight rows of `a` at a time, each value broadcast against 16
/// columns of `b`.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn dot_cross_cols(dim: usize, a: &[f32], ia: &[u32], bt: &[f32], stride: usize, nb: usize, out: &mut [f32]) {
    debug_assert!(stride.is_multiple_of(16) && stride >= nb && bt.len() >= dim * stride);
    let arow = |i: u32| &a[i as usize * dim..(i as usize + 1) * dim];
    let mut groups = ia.chunks_exact(8);
    let mut outs = out.chunks_exact_mut(8 * nb);
    for (ix, o) in (&mut groups).zip(&mut outs) {
        let rows =
            [arow(ix[0]), arow(ix[1]), arow(ix[2]), arow(ix[3]), arow(ix[4]), arow(ix[5]), arow(ix[6]), arow(ix[7])];
        for j0 in (0..nb).step_by(16) {
            let w = (nb - j0).min(16);
            // A last block of at most 8 columns takes half-width vectors: the same lanes, half
            // the work.
            if w <= 8 {
                for (p, acc) in cols_tile::<8, 8>(&rows, bt, stride, j0).iter().enumerate() {
                    o[p * nb + j0..p * nb + j0 + w].copy_from_slice(&acc[..w]);
                }
            } else {
                for (p, acc) in cols_tile::<8, 16>(&rows, bt, stride, j0).iter().enumerate() {
                    o[p * nb + j0..p * nb + j0 + w].copy_from_slice(&acc[..w]);
                }
            }
        }
    }
    for (&i, o) in groups.remainder().iter().zip(outs.into_remainder().chunks_exact_mut(nb)) {
        let row = [arow(i)];
        for j0 in (0..nb).step_by(16) {
            let w = (nb - j0).min(16);
            if w <= 8 {
                o[j0..j0 + w].copy_from_slice(&cols_tile::<1, 8>(&row, bt, stride, j0)[0][..w]);
            } else {
                o[j0..j0 + w].copy_from_slice(&cols_tile::<1, 16>(&row, bt, stride, j0)[0][..w]);
            }
        }
    }
}

/// `dot_cross_cols`' tile: the products of `R` rows with columns `j0..j0 + L` of `bt`, each
/// summed in index order in its own lane (so the same bits at any `L`).
#[inline(always)]
fn cols_tile<const R: usize, const L: usize>(
    rows: &[&[f32]; R],
    bt: &[f32],
    stride: usize,
    j0: usize,
) -> [[f32; L]; R] {
    let dim = rows[0].len();
    let mut acc = [[0f32; L]; R];
    for k in 0..dim {
        let col: &[f32; L] = bt[k * stride + j0..k * stride + j0 + L].try_into().unwrap();
        for (acc, row) in acc.iter_mut().zip(rows) {
            let x = row[k];
            for l in 0..L {
                acc[l] = x.mul_add(col[l], acc[l]);
            }
        }
    }
    acc
}

/// `rows` (`[n, dim]`) by column, for `dot_cross_cols`: `[dim, stride]`, `stride` = `n` rounded
/// up to 16, zero padded.
pub fn columns(rows: &[f32], dim: usize) -> (Vec<f32>, usize) {
    let n = rows.len() / dim;
    let stride = n.div_ceil(16) * 16;
    let mut bt = vec![0f32; dim * stride];
    for (j, r) in rows.chunks_exact(dim).enumerate() {
        for (k, &x) in r.iter().enumerate() {
            bt[k * stride + j] = x;
        }
    }
    (bt, stride)
}

/// One power-iteration step over `n` consecutive rows: `out += Σ (q · rows[i]) rows[i]`, each
/// block of four rows read once for both products (`dot_rows`, then a pass adding the scaled
/// rows, reads them twice). The same products as `dot_rows`, added in row order.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn dot_add_rows(q: &[f32], rows: &[f32], out: &mut [f32]) {
    let dim = q.len();
    debug_assert_eq!(out.len(), dim);
    let mut quads = rows.chunks_exact(4 * dim);
    for r in &mut quads {
        let (r0, r1, r2, r3) = (&r[..dim], &r[dim..2 * dim], &r[2 * dim..3 * dim], &r[3 * dim..]);
        let a = dot4(q, [r0, r1, r2, r3]);
        for ((((o, x0), x1), x2), x3) in out.iter_mut().zip(r0).zip(r1).zip(r2).zip(r3) {
            *o = a[3].mul_add(*x3, a[2].mul_add(*x2, a[1].mul_add(*x1, a[0].mul_add(*x0, *o))));
        }
    }
    for r in quads.remainder().chunks_exact(dim) {
        let a = dot(q, r);
        for (o, x) in out.iter_mut().zip(r) {
            *o = a.mul_add(*x, *o);
        }
    }
}

/// `sum += x` lane by lane, `x` widened to f64 (exact; one add per lane, so the same bits at
/// any vector width as a scalar loop).
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn add_widened(sum: &mut [f64], x: &[f32]) {
    for (s, &v) in sum.iter_mut().zip(x) {
        *s += v as f64;
    }
}

/// Squared distances of one query to `n` consecutive rows: `out[i] = |q - rows[i]|²`.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn sq_dist_rows(q: &[f32], rows: &[f32], out: &mut [f32]) {
    for (o, r) in out.iter_mut().zip(rows.chunks_exact(q.len())) {
        *o = sq_dist(q, r);
    }
}

/// int8 dot products of one quantised query with `n` consecutive int8 rows:
/// `out[i] = Σ q[j] · rows[i][j]` in i32 (exact: |sum| ≤ dim · 127², far from overflow for dim ≤ 4096).
pub fn dot_rows_i8(q: &[i8], rows: &[i8], out: &mut [i32]) {
    QueryI8::new(q).dot_rows(rows, out)
}

/// A quantised query made ready for many [`dot_rows_i8`] calls (a page at a time, say): the
/// kernel's choice, the query's registers and its bias are set up once, not per call.
pub struct QueryI8<'a> {
    q: &'a [i8],
    #[cfg(target_arch = "x86_64")]
    vnni: Option<vnni::Query>,
}

impl<'a> QueryI8<'a> {
    pub fn new(q: &'a [i8]) -> QueryI8<'a> {
        #[cfg(target_arch = "x86_64")]
        {
            let vnni = (q.len() <= vnni::MAX_DIM
                && !q.is_empty()
                && std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx512bw"))
            // SAFETY: the features the function is compiled for were just detected, and the
            // query's length is in range.
            .then(|| unsafe { vnni::Query::new(q) });
            QueryI8 { q, vnni }
        }
        #[cfg(not(target_arch = "x86_64"))]
        QueryI8 { q }
    }

    /// `dot_rows_i8(q, rows, out)`.
    pub fn dot_rows(&self, rows: &[i8], out: &mut [i32]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.vnni {
            // SAFETY: a `vnni::Query` exists only where its features were detected.
            unsafe { v.dot_rows(rows, out) };
            return;
        }
        dot_rows_i8_portable(self.q, rows, out)
    }
}

/// `dot_rows_i8` of several queries of one head size against the same rows: `out[j * n + i]`
/// is query `j`'s product with row `i`, for the `n = rows.len() / dim` rows (`out` holds at
/// least `qs.len() * n`). With AVX-512 VNNI each row is loaded once for four (or two) queries
/// at a time, where `QueryI8::dot_rows` loads it once per query.
pub fn dot_rows_i8_group(qs: &[QueryI8<'_>], rows: &[i8], out: &mut [i32]) {
    let Some(dim) = qs.first().map(|q| q.q.len()) else { return };
    if dim == 0 {
        return;
    }
    debug_assert!(qs.iter().all(|q| q.q.len() == dim), "queries of one head size");
    let n = rows.len() / dim;
    if n == 0 {
        return;
    }
    let (rows, out) = (&rows[..n * dim], &mut out[..qs.len() * n]);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    while qs.len() - done >= 2 {
        let v = |j: usize| qs.get(done + j).and_then(|q| q.vnni.as_ref());
        let rest = &mut out[done * n..];
        if let (Some(a), Some(b), Some(c), Some(d)) = (v(0), v(1), v(2), v(3)) {
            // SAFETY: a `vnni::Query` exists only where its features were detected; the rows
            // are whole rows of the queries' length, and the block of `out` holds `4 * n`.
            unsafe { vnni::dot_rows_group::<4, 4>([a, b, c, d], rows, &mut rest[..4 * n]) };
            done += 4;
        } else if let (Some(a), Some(b)) = (v(0), v(1)) {
            // SAFETY: as above, with `2 * n`.
            unsafe { vnni::dot_rows_group::<2, 8>([a, b], rows, &mut rest[..2 * n]) };
            done += 2;
        } else {
            break;
        }
    }
    for (q, o) in qs[done..].iter().zip(out[done * n..].chunks_exact_mut(n)) {
        q.dot_rows(rows, o);
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    /// The query stays in four registers: head dimensions up to 256.
    pub(super) const MAX_DIM: usize = 256;

    /// AVX-512 VNNI: `vpdpbusd` multiplies unsigned by signed bytes, so each row is made
    /// unsigned by flipping its sign bits (`r ^ 0x80` is `r + 128` as u8) and `128 · Σ q` is
    /// subtracted once per query; the query's padding bytes are zero, so a row's padding adds
    /// nothing. Rows go sixteen at a time: their sixteen accumulators are summed across lanes
    /// together (`sum16`), a few shuffles per row instead of a full reduction each.
    ///
    /// # Safety
    ///
    /// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI (check with
    /// `is_x86_feature_detected!`), and `q.len()` must be in `1..=MAX_DIM` (the query is held in
    /// `MAX_DIM / 64` registers). Every row of `rows` is `q.len()` bytes, and loads are masked
    /// to that length, so they never read past `q` or a row.
    /// A query in registers (`MAX_DIM / 64` chunks) with its length's tail mask and its bias
    /// `128 · Σ q`.
    pub(super) struct Query {
        qs: [__m512i; MAX_DIM / 64],
        dim: usize,
        chunks: usize,
        tail_mask: __mmask64,
        bias: i32,
    }

    impl Query {
        /// # Safety
        ///
        /// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI (check with
        /// `is_x86_feature_detected!`), and `q.len()` must be in `1..=MAX_DIM`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
        pub(super) unsafe fn new(q: &[i8]) -> Query {
            let dim = q.len();
            let chunks = dim.div_ceil(64);
            let tail = dim - (chunks - 1) * 64;
            let tail_mask: __mmask64 = if tail == 64 { !0 } else { (1u64 << tail) - 1 };
            let mut qs = [_mm512_setzero_si512(); MAX_DIM / 64];
            for (c, qc) in qs[..chunks].iter_mut().enumerate() {
                let m = if c + 1 == chunks { tail_mask } else { !0 };
                *qc = _mm512_maskz_loadu_epi8(m, q.as_ptr().add(c * 64));
            }
            let bias = 128 * q.iter().map(|&x| x as i32).sum::<i32>();
            Query { qs, dim, chunks, tail_mask, bias }
        }

        /// AVX-512 VNNI: `vpdpbusd` multiplies unsigned by signed bytes, so each row is made
        /// unsigned by flipping its sign bits (`r ^ 0x80` is `r + 128` as u8) and `128 · Σ q`
        /// is subtracted once per query; the query's padding bytes are zero, so a row's padding
        /// adds nothing. Rows go sixteen at a time: their sixteen accumulators are summed across
        /// lanes together (`sum16`), a few shuffles per row instead of a full reduction each.
        ///
        /// # Safety
        ///
        /// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI, which `new` required.
        /// Every row of `rows` is the query's length, and loads are masked to that length, so
        /// they never read past a row.
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
        pub(super) unsafe fn dot_rows(&self, rows: &[i8], out: &mut [i32]) {
            let dim = self.dim;
            let qs = &self.qs[..self.chunks];
            let (tail_mask, bias) = (self.tail_mask, self.bias);
            // Row i goes to out[i], for the rows that both hold.
            let n = out.len().min(rows.len() / dim);
            let (rows, out) = (&rows[..n * dim], &mut out[..n]);
            let mut blocks = rows.chunks_exact(16 * dim);
            let mut outs = out.chunks_exact_mut(16);
            for (block, o) in (&mut blocks).zip(&mut outs) {
                let mut accs = [_mm512_setzero_si512(); 16];
                for (a, r) in accs.iter_mut().zip(block.chunks_exact(dim)) {
                    *a = row_acc(qs, r, tail_mask);
                }
                let sums = _mm512_sub_epi32(sum16(&accs), _mm512_set1_epi32(bias));
                _mm512_storeu_si512(o.as_mut_ptr() as *mut _, sums);
            }
            for (o, r) in outs.into_remainder().iter_mut().zip(blocks.remainder().chunks_exact(dim)) {
                *o = _mm512_reduce_add_epi32(row_acc(qs, r, tail_mask)) - bias;
            }
        }
    }

    /// `G` queries against blocks of `R = 16 / G` rows: each row is loaded and flipped once
    /// for all `G`, and the block's sixteen accumulators (query `h`, row `r` at `h * R + r`) are
    /// summed across lanes together (`sum16`). Rows past the last whole block go one at a time.
    /// `out[h * n + i]` is query `h`'s product with row `i`, for the `n` rows of `rows`.
    ///
    /// # Safety
    ///
    /// As for `Query::dot_rows`; the queries share one length, `rows` holds whole rows of it,
    /// `out` holds `G * n`, and `G * R == 16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn dot_rows_group<const G: usize, const R: usize>(qs: [&Query; G], rows: &[i8], out: &mut [i32]) {
        let (dim, chunks, tail_mask) = (qs[0].dim, qs[0].chunks, qs[0].tail_mask);
        let n = rows.len() / dim;
        let flip = _mm512_set1_epi8(i8::MIN);
        let mut biases = [0i32; 16];
        for (lane, b) in biases.iter_mut().enumerate() {
            *b = qs[lane / R].bias;
        }
        let bias = _mm512_loadu_si512(biases.as_ptr() as *const _);
        let whole = n / R * R;
        let mut lanes = [0i32; 16];
        for first in (0..whole).step_by(R) {
            let mut accs = [_mm512_setzero_si512(); 16];
            for c in 0..chunks {
                let m = if c + 1 == chunks { tail_mask } else { !0 };
                for r in 0..R {
                    let v = _mm512_maskz_loadu_epi8(m, rows.as_ptr().add((first + r) * dim + c * 64));
                    let v = _mm512_xor_si512(v, flip);
                    for h in 0..G {
                        accs[h * R + r] = _mm512_dpbusd_epi32(accs[h * R + r], v, qs[h].qs[c]);
                    }
                }
            }
            _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, _mm512_sub_epi32(sum16(&accs), bias));
            for h in 0..G {
                out[h * n + first..h * n + first + R].copy_from_slice(&lanes[h * R..(h + 1) * R]);
            }
        }
        for i in whole..n {
            let r = &rows[i * dim..(i + 1) * dim];
            for h in 0..G {
                out[h * n + i] = _mm512_reduce_add_epi32(row_acc(&qs[h].qs[..chunks], r, tail_mask)) - qs[h].bias;
            }
        }
    }

    /// `vpdpbusd` of one row (sign bits flipped) with the query's chunks `qs`, lanes unsummed.
    ///
    /// # Safety
    ///
    /// As for `Query::dot_rows`; `r` is one row, `tail_mask` masks its last chunk.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn row_acc(qs: &[__m512i], r: &[i8], tail_mask: __mmask64) -> __m512i {
        let flip = _mm512_set1_epi8(i8::MIN);
        let mut acc = _mm512_setzero_si512();
        for (c, &qc) in qs.iter().enumerate() {
            let m = if c + 1 == qs.len() { tail_mask } else { !0 };
            let v = _mm512_maskz_loadu_epi8(m, r.as_ptr().add(c * 64));
            acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(v, flip), qc);
        }
        acc
    }

    /// Lane `i` of the result is the sum of the sixteen lanes of `a[i]`: pairs of rows, then
    /// quads, are summed within each 128-bit lane (unpack and add), then the 128-bit lanes of
    /// four quads are transposed and added.
    ///
    /// # Safety
    ///
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn sum16(a: &[__m512i; 16]) -> __m512i {
        let t0 = quad(pair(a[0], a[1]), pair(a[2], a[3]));
        let t1 = quad(pair(a[4], a[5]), pair(a[6], a[7]));
        let t2 = quad(pair(a[8], a[9]), pair(a[10], a[11]));
        let t3 = quad(pair(a[12], a[13]), pair(a[14], a[15]));
        halves(halves(t0, t1), halves(t2, t3))
    }

    /// Rows `x`, `y`: per 128-bit lane `[x0 + x2, y0 + y2, x1 + x3, y1 + y3]` of that lane.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pair(x: __m512i, y: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y))
    }

    /// Pairs `p` = (x, y), `r` = (z, w): per 128-bit lane, each of the four rows' sum over it.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn quad(p: __m512i, r: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_unpacklo_epi64(p, r), _mm512_unpackhi_epi64(p, r))
    }

    /// 128-bit lanes `[x0 + x1, x2 + x3, y0 + y1, y2 + y3]`: applied to two quads' sums and then
    /// to the results, lane `m` holds the total of quad `m`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn halves(x: __m512i, y: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_shuffle_i32x4::<0x88>(x, y), _mm512_shuffle_i32x4::<0xDD>(x, y))
    }
}

#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
fn dot_rows_i8_portable(q: &[i8], rows: &[i8], out: &mut [i32]) {
    let dim = q.len();
    for (o, r) in out.iter_mut().zip(rows.chunks_exact(dim)) {
        let mut acc = [0i32; 32];
        let cq = q.chunks_exact(32);
        let cr = r.chunks_exact(32);
        let (rq, rr) = (cq.remainder(), cr.remainder());
        for (x, y) in cq.zip(cr) {
            for i in 0..32 {
                acc[i] += x[i] as i32 * y[i] as i32;
            }
        }
        let mut s: i32 = acc.iter().sum();
        for (x, y) in rq.iter().zip(rr) {
            s += *x as i32 * *y as i32;
        }
        *o = s;
    }
}

/// Softmax numerators in place: `x[i] ← exp(x[i] - max x)`; returns their sum. A polynomial
/// `exp` (relative error < 1e-5: plenty for ranking pages) keeps the loop vectorised.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn softmax_numerators(x: &mut [f32]) -> f32 {
    // Lane-wise max and sum: float reductions only vectorise when written across lanes.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for c in chunks {
        for i in 0..16 {
            lanes[i] = lanes[i].max(c[i]);
        }
    }
    let max = lanes.iter().fold(rest, |m, &v| m.max(v));
    for v in x.iter_mut() {
        let t = ((*v - max) * std::f32::consts::LOG2_E).max(-126.0);
        // 2^t = 2^i · 2^f with f in [-1/2, 1/2], where the polynomial below is tight.
        let i = (t + 0.5).floor();
        let f = t - i;
        let p = 1.0
            + f * (std::f32::consts::LN_2
                + f * (0.240_226_5 + f * (0.055_504_11 + f * (0.009_618_129 + f * 0.001_333_355_8))));
        // 2^i from its exponent bits: adding 1.5 · 2^23 leaves `i + 127` (in 1..=127) in the
        // low mantissa bits, a bit cast instead of a float-to-int conversion, which Rust's
        // saturating `as` would do one lane at a time.
        *v = p * f32::from_bits((i + (127.0 + 12_582_912.0)).to_bits() << 23);
    }
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// Symmetric int8 quantisation of one vector: returns the scale `s` with `v ≈ s · code`.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn quantize_i8(v: &[f32], code: &mut [i8]) -> f32 {
    quantize_with::<false>(v, v, code)
}

/// Symmetric int8 quantisation of `v - centre`.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn quantize_i8_centred(v: &[f32], centre: &[f32], code: &mut [i8]) -> f32 {
    quantize_with::<true>(v, centre, code)
}

/// Quantises `v - centre` (`v` alone unless `CENTRED`): one pass for the largest magnitude,
/// lane-wise so that it vectorises, and one for the codes.
#[inline(always)]
fn quantize_with<const CENTRED: bool>(v: &[f32], centre: &[f32], code: &mut [i8]) -> f32 {
    let (centre, code) = (&centre[..v.len()], &mut code[..v.len()]);
    let diff = |x: f32, c: f32| if CENTRED { x - c } else { x };
    let mut lanes = [0f32; 16];
    let (vc, cc) = (v.chunks_exact(16), centre.chunks_exact(16));
    // A compare-and-select maximum: `f32::max`'s NaN rules keep LLVM from vectorising it.
    let max = |m: f32, x: f32| if x > m { x } else { m };
    let tail = vc.remainder().iter().zip(cc.remainder()).fold(0f32, |m, (&x, &c)| max(m, diff(x, c).abs()));
    for (x, c) in vc.zip(cc) {
        for i in 0..16 {
            lanes[i] = max(lanes[i], diff(x[i], c[i]).abs());
        }
    }
    let maxabs = lanes.iter().fold(tail, |m, &x| max(m, x));
    if maxabs == 0.0 {
        code.fill(0);
        return 0.0;
    }
    let inv = 127.0 / maxabs;
    for i in 0..v.len() {
        // Round half away from zero by hand (`f32::round` is a libm call on baseline x86-64).
        // |r| <= 127, so adding 1.5 · 2^23 leaves r in the low bits, two's complement: a float
        // to int conversion that vectorises, where `as` (saturating) does not.
        let y = diff(v[i], centre[i]) * inv;
        let r = (y + 0.5f32.copysign(y)).trunc();
        code[i] = (r + 12_582_912.0).to_bits() as u8 as i8;
    }
    maxabs / 127.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row count around the sixteen-row blocks, every head dimension up to the kernels'
    /// limit and beyond (the portable path), every byte value: the exact integer dot products,
    /// from both kernels; an `out` shorter than the rows takes the first rows only.
    #[test]
    fn dot_rows_i8_is_exact_for_every_shape_and_value() {
        for dim in (1..=260).filter(|d| d % 13 == 0 || *d <= 3 || [63, 64, 65, 127, 128, 129, 255, 256].contains(d)) {
            let byte = |i: usize| ((i * 7919 + dim * 31) % 256) as u8 as i8;
            let q: Vec<i8> = (0..dim).map(|i| byte(i * 3 + 1)).collect();
            let rows: Vec<i8> = (0..37 * dim).map(byte).collect();
            for n in [0usize, 1, 15, 16, 17, 31, 32, 33, 37] {
                let want: Vec<i32> = rows[..n * dim]
                    .chunks_exact(dim)
                    .map(|r| r.iter().zip(&q).map(|(&a, &b)| a as i32 * b as i32).sum())
                    .collect();
                let mut got = vec![7i32; n];
                dot_rows_i8(&q, &rows[..n * dim], &mut got);
                assert_eq!(got, want, "dim {dim}, {n} rows");
                dot_rows_i8_portable(&q, &rows[..n * dim], &mut got);
                assert_eq!(got, want, "portable: dim {dim}, {n} rows");
                if n > 1 {
                    let mut short = vec![0i32; n - 1];
                    dot_rows_i8(&q, &rows[..n * dim], &mut short);
                    assert_eq!(short, want[..n - 1], "dim {dim}, {n} rows into {}", n - 1);
                }
            }
        }
    }

    /// Groups of one to seven queries (blocks of four and two, and one alone), every row
    /// count around the blocks, head sizes around the register chunks: each query's exact
    /// products, as `dot_rows_i8` gives them.
    #[test]
    fn dot_rows_i8_group_is_exact_for_every_group_and_shape() {
        for dim in [1usize, 3, 63, 64, 65, 128, 129, 256, 257] {
            let byte = |i: usize| ((i * 7919 + dim * 31) % 256) as u8 as i8;
            let rows: Vec<i8> = (0..37 * dim).map(byte).collect();
            for group in 1..=7 {
                let codes: Vec<Vec<i8>> =
                    (0..group).map(|j| (0..dim).map(|i| byte(i * 5 + j * 11 + 2)).collect()).collect();
                let qs: Vec<QueryI8> = codes.iter().map(|c| QueryI8::new(c)).collect();
                for n in [0usize, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 37] {
                    let mut got = vec![7i32; group * n];
                    dot_rows_i8_group(&qs, &rows[..n * dim], &mut got);
                    for (j, q) in codes.iter().enumerate() {
                        let want: Vec<i32> = rows[..n * dim]
                            .chunks_exact(dim)
                            .map(|r| r.iter().zip(q).map(|(&a, &b)| a as i32 * b as i32).sum())
                            .collect();
                        assert_eq!(got[j * n..(j + 1) * n], want, "dim {dim}, group {group}, query {j}, {n} rows");
                    }
                }
            }
        }
    }

    #[test]
    fn dot_cross_cols_matches_plain_dot_products() {
        let dim = 37;
        let value = |i: usize| ((i * 7919) % 211) as f32 / 50.0 - 2.0;
        let a: Vec<f32> = (0..30 * dim).map(value).collect();
        for nb in [1usize, 15, 16, 17, 40] {
            let b: Vec<f32> = (0..nb * dim).map(|i| value(i + 13)).collect();
            let (bt, stride) = columns(&b, dim);
            for rows in [1usize, 7, 8, 9, 20] {
                let ia: Vec<u32> = (0..rows as u32).map(|i| (i * 11) % 30).collect();
                let mut out = vec![f32::NAN; rows * nb];
                dot_cross_cols(dim, &a, &ia, &bt, stride, nb, &mut out);
                for (i, &r) in ia.iter().enumerate() {
                    for j in 0..nb {
                        let ar = &a[r as usize * dim..(r as usize + 1) * dim];
                        let want: f32 = ar.iter().zip(&b[j * dim..(j + 1) * dim]).map(|(x, y)| x * y).sum();
                        let got = out[i * nb + j];
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "nb {nb} rows {rows}: {got} vs {want}"
                        );
                        // One lane, in index order, whatever the width of its block.
                        let lane = ar.iter().zip(&b[j * dim..(j + 1) * dim]).fold(0f32, |s, (x, y)| x.mul_add(*y, s));
                        assert_eq!(got, lane, "nb {nb} rows {rows} column {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn softmax_numerators_match_exp() {
        let mut x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.731).sin() * 40.0).collect();
        let want: Vec<f32> = {
            let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            x.iter().map(|v| (v - m).exp()).collect()
        };
        let sum = softmax_numerators(&mut x);
        for (g, w) in x.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * w.max(1e-30) + 1e-37, "{g} vs {w}");
        }
        assert!((sum - want.iter().sum::<f32>()).abs() < 1e-4 * sum);
    }

    #[test]
    fn kernels_match_naive() {
        for dim in [1usize, 7, 16, 33, 64, 129] {
            let a: Vec<f32> = (0..dim).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..dim).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - naive).abs() < 1e-4);
            let naive_d: f32 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
            assert!((sq_dist(&a, &b) - naive_d).abs() < 1e-4);
            let mut out = [0f32; 2];
            let rows: Vec<f32> = b.iter().chain(a.iter()).copied().collect();
            dot_rows(&a, &rows, &mut out);
            assert!((out[0] - naive).abs() < 1e-4);
            sq_dist_rows(&a, &rows, &mut out);
            assert!((out[0] - naive_d).abs() < 1e-4 && out[1].abs() < 1e-6);
            // Blocks of four rows and a remainder, contiguous and gathered.
            let many: Vec<f32> = (0..9 * dim).map(|i| (i as f32 * 0.23).sin()).collect();
            let want: Vec<f32> = many.chunks_exact(dim).map(|r| r.iter().zip(&a).map(|(x, y)| x * y).sum()).collect();
            let mut got = [0f32; 9];
            dot_rows(&a, &many, &mut got);
            assert!(got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-4), "{got:?} vs {want:?}");
            let idx = [8u32, 0, 3, 3, 7, 1, 2];
            let mut got = [0f32; 7];
            dot_gather(&a, &many, &idx, &mut got);
            assert!(got.iter().zip(&idx).all(|(g, &i)| (g - want[i as usize]).abs() < 1e-4));
            // Every tile shape (7 x 5 = a block of four rows and three alone, against four
            // columns and one): the naive sums, and `dot_gather`'s blocks of four bit for bit.
            let cols = &many[2 * dim..7 * dim];
            let mut cross = [0f32; 35];
            dot_cross(dim, &many, &idx, cols, &mut cross);
            for (i, &r) in idx.iter().enumerate() {
                let row = &many[r as usize * dim..(r as usize + 1) * dim];
                let mut quad = [0f32; 4];
                dot_gather(row, cols, &[0, 1, 2, 3], &mut quad);
                for j in 0..5 {
                    let naive: f32 = row.iter().zip(&cols[j * dim..(j + 1) * dim]).map(|(x, y)| x * y).sum();
                    assert!((cross[i * 5 + j] - naive).abs() < 1e-4);
                    assert!(j == 4 || cross[i * 5 + j] == quad[j]);
                }
            }
            // A power step: `dot_rows`' products, each row added in row order (blocks of four
            // rows and a remainder), bit for bit.
            let mut dots = [0f32; 6];
            dot_rows(&a, &many[..6 * dim], &mut dots);
            let mut seq = b.clone();
            for (&c, r) in dots.iter().zip(many.chunks_exact(dim)) {
                seq.iter_mut().zip(r).for_each(|(o, x)| *o = c.mul_add(*x, *o));
            }
            let mut acc = b.clone();
            dot_add_rows(&a, &many[..6 * dim], &mut acc);
            assert_eq!(acc, seq);
            let mut wide: Vec<f64> = b.iter().map(|&x| x as f64 * 0.5).collect();
            let want: Vec<f64> = wide.iter().zip(&a).map(|(s, &x)| s + x as f64).collect();
            add_widened(&mut wide, &a);
            assert_eq!(wide, want);
            let mut qa = vec![0i8; dim];
            let mut qb = vec![0i8; dim];
            let sa = quantize_i8(&a, &mut qa);
            let sb = quantize_i8(&b, &mut qb);
            let mut oi = [0i32; 1];
            dot_rows_i8(&qa, &qb, &mut oi);
            let naive_i: i32 = qa.iter().zip(&qb).map(|(x, y)| *x as i32 * *y as i32).sum();
            assert_eq!(oi[0], naive_i);
            dot_rows_i8_portable(&qa, &qb, &mut oi);
            assert_eq!(oi[0], naive_i);
            assert!((oi[0] as f32 * sa * sb - naive).abs() < 0.02 * dim as f32);
            // Codes round half away from zero, centred or not.
            let mut code = vec![0i8; dim];
            let v: Vec<f32> = (0..dim).map(|i| [127.0, -127.0, 0.5, -0.5, 1.49, -2.5, 0.0][i % 7]).collect();
            let want: Vec<i8> = (0..dim).map(|i| [127, -127, 1, -1, 1, -3, 0][i % 7]).collect();
            if dim >= 2 {
                assert_eq!(quantize_i8(&v, &mut code), 1.0);
                assert_eq!(code, want);
                let centre = vec![1.0f32; dim];
                let shifted: Vec<f32> = v.iter().map(|x| x + 1.0).collect();
                assert_eq!(quantize_i8_centred(&shifted, &centre, &mut code), 1.0);
                assert_eq!(code, want);
            }
            // Extremes: -127 and 127 everywhere.
            let lo = vec![-127i8; dim];
            let hi = vec![127i8; dim];
            dot_rows_i8(&lo, &hi, &mut oi);
            assert_eq!(oi[0], -127 * 127 * dim as i32);
        }
    }
}
