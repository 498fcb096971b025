//! Recursive splits of a leaf cell into pages: cut along the principal axis at a multiple of
//! `max`, so every page of a cell is full but the last. Budgets charge every slot of a selected
//! page, so full pages carry more attention per slot than evenly part-filled ones (measured on
//! SmolLM2 by `icecache eval recall`).

use crate::simd;

/// Splits `items` into groups of at most `max` (appended to `out`), neighbours in key space
/// together. `key(t)` gives item `t`'s `dim` floats.
pub(crate) fn split_pages<'k>(
    items: &mut [u32],
    key: &impl Fn(u32) -> &'k [f32],
    dim: usize,
    max: usize,
    out: &mut Vec<Vec<u32>>,
) {
    if items.len() <= max {
        out.push(items.to_vec());
        return;
    }
    let pages = items.len().div_ceil(max);
    let left = max * (pages / 2);
    let (axis, rows) = principal_axis(items, key, dim);
    let mut dots = vec![0f32; items.len()];
    simd::dot_rows(&axis, &rows, &mut dots);
    let mut proj: Vec<(f32, u32)> = dots.into_iter().zip(items.iter().copied()).collect();
    proj.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    for (slot, (_, t)) in items.iter_mut().zip(proj) {
        *slot = t;
    }
    let (l, r) = items.split_at_mut(left);
    split_pages(l, key, dim, max, out);
    split_pages(r, key, dim, max, out);
}

/// Top principal direction of the items' keys (a few power-iteration steps from the direction
/// of the item farthest from the mean: deterministic, and close after a handful of steps), and
/// the centred keys (`[n, dim]`, in item order).
fn principal_axis<'k>(items: &[u32], key: &impl Fn(u32) -> &'k [f32], dim: usize) -> (Vec<f32>, Vec<f32>) {
    let n = items.len();
    let mut mean = vec![0f32; dim];
    for &t in items {
        mean.iter_mut().zip(key(t)).for_each(|(m, x)| *m += x);
    }
    mean.iter_mut().for_each(|m| *m /= n as f32);
    // Centred rows, contiguous, so each iteration is two SIMD passes over them.
    let mut rows = Vec::with_capacity(n * dim);
    for &t in items {
        rows.extend(key(t).iter().zip(&mean).map(|(x, m)| x - m));
    }
    let far = rows
        .chunks_exact(dim)
        .map(|r| simd::dot(r, r))
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(0, |(i, _)| i);
    let mut v = rows[far * dim..(far + 1) * dim].to_vec();
    let mut next = vec![0f32; dim];
    let mut dots = vec![0f32; n];
    for _ in 0..4 {
        simd::dot_rows(&v, &rows, &mut dots);
        next.fill(0.0);
        simd::add_scaled_rows(&dots, &rows, &mut next);
        let norm = simd::dot(&next, &next).sqrt();
        if norm <= f32::MIN_POSITIVE {
            break;
        }
        v.iter_mut().zip(&next).for_each(|(a, b)| *a = b / norm);
    }
    (v, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_pages_and_cover_every_item() {
        let dim = 3;
        let keys: Vec<f32> = (0..100 * dim).map(|i| ((i * 7919) % 101) as f32).collect();
        let key = |t: u32| &keys[t as usize * dim..(t as usize + 1) * dim];
        for n in [1usize, 16, 17, 33, 50, 100] {
            let mut items: Vec<u32> = (0..n as u32).collect();
            let mut out = Vec::new();
            split_pages(&mut items, &key, dim, 16, &mut out);
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
