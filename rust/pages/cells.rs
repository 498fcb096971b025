//! Leaf cells refined by Lloyd iterations before they are cut into pages. The build's M-DCI tree
//! groups each key with the owner key nearest it, and owners are keys promoted at random, so a
//! cell's members are near a random key rather than near each other. A few k-means steps, each
//! key choosing among its cell's centroid and the nearest cells' (`NEIGHBOURS`), pull keys that
//! the same queries attend into the same cells and so the same pages (benches/RESULTS.md,
//! section "Leaf cells refined by k-means").

use rayon::prelude::*;

use crate::error::Result;
use crate::index::{Config, DciIndex, Metric};
use crate::input::KeyData;
use crate::simd;

/// Cells a key may move to besides its own: the nearest centroids to its cell's.
const NEIGHBOURS: usize = 8;
/// Lloyd iterations of a build. Three kept both RULER answers that Gemma-3-270M lost at 16k and
/// budget 256 (teacher-forced), and raised attention recall on held-out SmolLM2 prose and code;
/// each costs about a fifth of the build's own time (benches/RESULTS.md).
pub(crate) const REFINE_STEPS: usize = 3;

/// Refines `cells` (lists of keys, `key(t)` giving key `t`'s `d` floats) by at most `iters`
/// Lloyd iterations in Euclidean key space: each key moves to the nearest centroid among its
/// cell's and its cell's `NEIGHBOURS` nearest; cells left empty are dropped.
/// Deterministic: the result depends only on the cells and keys (members stay in ascending
/// order; the search over the centroids has a fixed seed).
pub(crate) fn refine_cells<'k>(
    cells: &mut Vec<Vec<u32>>,
    key: &(impl Fn(u32) -> &'k [f32] + Sync),
    d: usize,
    iters: usize,
) -> Result<()> {
    for _ in 0..iters {
        if cells.len() < 2 {
            return Ok(());
        }
        let centroids: Vec<f32> = cells
            .par_iter()
            .flat_map_iter(|members| {
                let mut c = vec![0f32; d];
                for &t in members {
                    c.iter_mut().zip(key(t)).for_each(|(a, b)| *a += b);
                }
                let n = members.len() as f32;
                c.into_iter().map(move |x| x / n)
            })
            .collect();
        let centroid = |c: usize| &centroids[c * d..(c + 1) * d];
        let neighbours = nearest_cells(&centroids, d, NEIGHBOURS.min(cells.len() - 1))?;
        // Per cell, each member's cell after this step.
        let dest: Vec<Vec<usize>> = cells
            .par_iter()
            .enumerate()
            .map(|(c, members)| {
                members
                    .iter()
                    .map(|&t| {
                        let own = (simd::sq_dist(key(t), centroid(c)), c);
                        let best = neighbours[c]
                            .iter()
                            .map(|&o| (simd::sq_dist(key(t), centroid(o)), o))
                            .fold(own, |a, b| if b.0 < a.0 { b } else { a });
                        best.1
                    })
                    .collect()
            })
            .collect();
        if dest.iter().enumerate().all(|(c, to)| to.iter().all(|&o| o == c)) {
            return Ok(());
        }
        let mut next: Vec<Vec<u32>> = cells.iter().map(|m| Vec::with_capacity(m.len())).collect();
        for (members, to) in cells.iter().zip(&dest) {
            for (&t, &o) in members.iter().zip(to) {
                next[o].push(t);
            }
        }
        next.par_iter_mut().for_each(|m| m.sort_unstable());
        next.retain(|m| !m.is_empty());
        *cells = next;
    }
    Ok(())
}

/// The `m` cells whose centroids (`[C, d]`) are nearest each cell's, by a DCI search over the
/// centroids (comparing every pair would be quadratic in the cells: 5,000 of them at 512k keys).
fn nearest_cells(centroids: &[f32], d: usize, m: usize) -> Result<Vec<Vec<usize>>> {
    let cells = centroids.len() / d;
    let mut cfg = Config::new(d, Metric::L2);
    cfg.seed = Some(0x6365_6c6c);
    let mut near = DciIndex::new(cfg)?;
    let ids: Vec<i64> = (0..cells as i64).collect();
    near.add(KeyData::F32(centroids), Some(&ids))?;
    let want = (m + 1).min(cells);
    let (found, _) = near.query(KeyData::F32(centroids), want, None, false)?;
    Ok(found
        .chunks_exact(want)
        .enumerate()
        .map(|(c, row)| row.iter().map(|&o| o as usize).filter(|&o| o != c).take(m).collect())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two well-separated blobs, each split between two cells with a key of the other blob:
    /// refinement sends every key to its blob's cells and loses none.
    #[test]
    fn keys_move_to_the_nearest_centroid_and_none_is_lost() {
        let d = 2;
        let mut keys = Vec::new();
        for i in 0..40 {
            let (x, y) = if i < 20 { (0.0, 0.0) } else { (100.0, 0.0) };
            keys.extend_from_slice(&[x + (i % 5) as f32 * 0.1, y + (i % 7) as f32 * 0.1]);
        }
        let key = |t: u32| &keys[t as usize * d..(t as usize + 1) * d];
        let mut cells: Vec<Vec<u32>> = vec![(0..19).chain([20]).collect(), (21..40).chain([19]).collect()];
        refine_cells(&mut cells, &key, d, 3).unwrap();
        let mut all: Vec<u32> = cells.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..40).collect::<Vec<_>>());
        assert_eq!(cells, vec![(0..20).collect::<Vec<u32>>(), (20..40).collect()]);
    }

    /// On points along a line the searched neighbours are (99% of them) among the nearest, and
    /// never the cell itself.
    #[test]
    fn neighbours_are_the_nearest_other_cells() {
        let (d, cells, m) = (3, 600, 8);
        let centroids: Vec<f32> = (0..cells).flat_map(|i| [i as f32, ((i * 7) % 3) as f32 * 0.01, 0.0]).collect();
        let near = nearest_cells(&centroids, d, m).unwrap();
        let mut close = 0;
        for (c, list) in near.iter().enumerate() {
            assert_eq!(list.len(), m);
            assert!(!list.contains(&c));
            close += list.iter().filter(|&&o| o.abs_diff(c) <= m).count();
        }
        assert!(close * 100 >= cells * m * 99, "{close} of {} near", cells * m);
    }

    #[test]
    fn one_cell_and_no_iterations_change_nothing() {
        let keys = [1.0f32, 2.0, 3.0, 4.0];
        let key = |t: u32| &keys[t as usize * 2..(t as usize + 1) * 2];
        let mut one = vec![vec![0u32, 1]];
        refine_cells(&mut one, &key, 2, 5).unwrap();
        assert_eq!(one, vec![vec![0, 1]]);
        let mut two = vec![vec![0u32], vec![1]];
        refine_cells(&mut two, &key, 2, 0).unwrap();
        assert_eq!(two, vec![vec![0], vec![1]]);
    }
}
