//! Recursive splits of a leaf cell into pages: cut along the principal axis at a multiple of
//! `max`, so every page of a cell is full but the last. Budgets charge every slot of a selected
//! page, so full pages carry more attention per slot than evenly part-filled ones (measured on
//! SmolLM2 by `icecache eval recall`).

use crate::simd;

/// Buffers of the splits of one task, reused from cell to cell (a cell's keys, gathered once,
/// and their centred copies) instead of allocations at every split.
#[derive(Default)]
pub(crate) struct SplitScratch {
    rows: Vec<f32>,
    spare: Vec<f32>,
    dots: Vec<f32>,
    order: Vec<(u64, u32)>,
    axis: Vec<f32>,
    next: Vec<f32>,
    mean: Vec<f32>,
    items: Vec<u32>,
}

/// Splits `items` into groups of at most `max` (appended to `out`), neighbours in key space
/// together, and appends each group's key sum (`dim` floats, summed in group order) to `sums`.
/// `key(t)` gives item `t`'s `dim` floats.
pub(crate) fn split_pages<'k>(
    items: &mut [u32],
    key: &impl Fn(u32) -> &'k [f32],
    dim: usize,
    max: usize,
    out: &mut Vec<Vec<u32>>,
    sums: &mut Vec<f32>,
    s: &mut SplitScratch,
) {
    let mut rows = std::mem::take(&mut s.rows);
    let mut spare = std::mem::take(&mut s.spare);
    rows.clear();
    for &t in items.iter() {
        rows.extend_from_slice(key(t));
    }
    spare.resize(rows.len(), 0.0);
    split_rows(items, &mut rows, &mut spare, dim, max, (out, sums), s);
    s.rows = rows;
    s.spare = spare;
}

/// `split_pages` of `items` whose keys are `rows` (in item order); `spare` (as long) is scratch.
/// The rows follow their items through each split (by way of `spare`, whose role the two halves
/// swap with `rows`).
fn split_rows(
    items: &mut [u32],
    rows: &mut [f32],
    spare: &mut [f32],
    dim: usize,
    max: usize,
    (out, sums): (&mut Vec<Vec<u32>>, &mut Vec<f32>),
    s: &mut SplitScratch,
) {
    let n = items.len();
    if n <= max {
        out.push(items.to_vec());
        let at = sums.len();
        sums.resize(at + dim, 0.0);
        for r in rows.chunks_exact(dim) {
            sums[at..].iter_mut().zip(r).for_each(|(a, b)| *a += b);
        }
        return;
    }
    let pages = n.div_ceil(max);
    let left = max * (pages / 2);
    // Centred rows into `spare`, then the projections onto the principal axis.
    principal_axis(rows, spare, dim, s);
    s.dots.resize(n, 0.0);
    simd::dot_rows(&s.axis, spare, &mut s.dots);
    // By projection (`total_cmp`), ties by item, as one integer key: plain integer compares
    // sort faster than the two-step order with its lookups of the items.
    s.order.clear();
    s.order.extend(s.dots.iter().zip(items.iter()).zip(0u32..).map(|((&p, &t), i)| (sort_key(p, t), i)));
    s.order.sort_unstable();
    // Items and their rows in projection order (the rows into `spare`).
    for (dst, &(_, i)) in spare.chunks_exact_mut(dim).zip(&s.order) {
        dst.copy_from_slice(&rows[i as usize * dim..(i as usize + 1) * dim]);
    }
    s.items.clear();
    s.items.extend_from_slice(items);
    for (slot, &(_, i)) in items.iter_mut().zip(&s.order) {
        *slot = s.items[i as usize];
    }
    let (li, ri) = items.split_at_mut(left);
    let (lr, rr) = spare.split_at_mut(left * dim);
    let (ls, rs) = rows.split_at_mut(left * dim);
    split_rows(li, lr, ls, dim, max, (&mut *out, &mut *sums), s);
    split_rows(ri, rr, rs, dim, max, (out, sums), s);
}

/// A key that orders `(projection, item)` pairs as `f32::total_cmp` on the projection, then
/// the item.
fn sort_key(p: f32, item: u32) -> u64 {
    let b = p.to_bits() as i32;
    let ordered = (b ^ (((b >> 31) as u32) >> 1) as i32) as u32 ^ (1 << 31);
    (ordered as u64) << 32 | item as u64
}

/// Top principal direction of `rows` (into `s.axis`; a few power-iteration steps from the
/// direction of the row farthest from the mean: deterministic, and close after a handful of
/// steps), and the centred rows (into `centred`, `[n, dim]`, in row order).
fn principal_axis(rows: &[f32], centred: &mut [f32], dim: usize, s: &mut SplitScratch) {
    let n = rows.len() / dim;
    let mean = &mut s.mean;
    mean.clear();
    mean.resize(dim, 0.0);
    for r in rows.chunks_exact(dim) {
        mean.iter_mut().zip(r).for_each(|(m, x)| *m += x);
    }
    mean.iter_mut().for_each(|m| *m /= n as f32);
    for (c, r) in centred.chunks_exact_mut(dim).zip(rows.chunks_exact(dim)) {
        c.iter_mut().zip(r).zip(mean.iter()).for_each(|((c, x), m)| *c = x - m);
    }
    let centred = &*centred;
    let far = centred
        .chunks_exact(dim)
        .map(|r| simd::dot(r, r))
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(0, |(i, _)| i);
    s.axis.clear();
    s.axis.extend_from_slice(&centred[far * dim..(far + 1) * dim]);
    s.next.resize(dim, 0.0);
    for _ in 0..4 {
        s.next.fill(0.0);
        simd::dot_add_rows(&s.axis, centred, &mut s.next);
        let norm = simd::dot(&s.next, &s.next).sqrt();
        if norm <= f32::MIN_POSITIVE {
            break;
        }
        s.axis.iter_mut().zip(&s.next).for_each(|(a, b)| *a = b / norm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sort_keys_order_as_total_cmp_then_item() {
        let ps = [f32::NEG_INFINITY, -3.5, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY, f32::NAN, -f32::NAN];
        for &a in &ps {
            for &b in &ps {
                for (i, j) in [(1u32, 2u32), (2, 1), (7, 7)] {
                    let want = a.total_cmp(&b).then(i.cmp(&j));
                    assert_eq!(sort_key(a, i).cmp(&sort_key(b, j)), want, "{a} {i} vs {b} {j}");
                }
            }
        }
    }

    #[test]
    fn splits_fill_pages_and_cover_every_item() {
        let dim = 3;
        let keys: Vec<f32> = (0..100 * dim).map(|i| ((i * 7919) % 101) as f32).collect();
        let key = |t: u32| &keys[t as usize * dim..(t as usize + 1) * dim];
        for n in [1usize, 16, 17, 33, 50, 100] {
            let mut items: Vec<u32> = (0..n as u32).collect();
            let mut out = Vec::new();
            let mut sums = Vec::new();
            split_pages(&mut items, &key, dim, 16, &mut out, &mut sums, &mut SplitScratch::default());
            assert_eq!(sums.len(), out.len() * dim);
            for (g, sum) in out.iter().zip(sums.chunks_exact(dim)) {
                let mut want = vec![0f32; dim];
                for &t in g {
                    want.iter_mut().zip(key(t)).for_each(|(a, b)| *a += b);
                }
                assert_eq!(sum, &want[..]);
            }
            assert_eq!(out.len(), n.div_ceil(16));
            let mut all: Vec<u32> = out.iter().flatten().copied().collect();
            all.sort_unstable();
            assert_eq!(all, (0..n as u32).collect::<Vec<_>>());
            let part_filled = out.iter().filter(|g| g.len() < 16).count();
            assert!(
                out.iter().all(|g| g.len() <= 16) && part_filled <= 1,
                "{n}: sizes {:?}",
                out.iter().map(|g| g.len()).collect::<Vec<_>>()
            );
        }
    }
}
