//! Ranking helpers shared by building and searching: scores packed with their slot into one
//! integer (so that selection and sorting run on plain integers), and the two ways to keep the
//! best few of a list.

/// Packs a rank score (larger is better) and a slot into one integer that orders best first
/// under `>` (ties: lower slot first), so selection runs on plain integers.
pub(super) fn pack(score: f32, slot: u32) -> u64 {
    let b = score.to_bits();
    let ordered = if b >> 31 == 1 { !b } else { b | 1 << 31 };
    (ordered as u64) << 32 | (!slot) as u64
}

pub(super) fn unpack(p: u64) -> (f32, u32) {
    let ordered = (p >> 32) as u32;
    let b = if ordered >> 31 == 1 { ordered & !(1 << 31) } else { !ordered };
    (f32::from_bits(b), !(p as u32))
}

/// Inserts `x` into `best` (a fixed-length list, best first) if it beats the last, which drops
/// out; ties keep the earlier. One pass per candidate: cheapest when `best` is a handful.
pub(super) fn insert_best(best: &mut [(f32, u32)], x: (f32, u32)) {
    let Some(last) = best.len().checked_sub(1) else { return };
    if x.0 > best[last].0 {
        let mut j = last;
        while j > 0 && x.0 > best[j - 1].0 {
            best[j] = best[j - 1];
            j -= 1;
        }
        best[j] = x;
    }
}

/// Truncates `v` to its `n` largest elements, unordered (a selection, not a sort).
pub(super) fn truncate_best<T: Copy + PartialOrd>(v: &mut Vec<T>, n: usize) {
    if v.len() > n {
        v.select_nth_unstable_by(n - 1, |a, b| b.partial_cmp(a).unwrap());
        v.truncate(n);
    }
}

#[cfg(test)]
mod tests {
    use super::{insert_best, pack, truncate_best, unpack};

    #[test]
    fn pack_orders_like_scores_then_slots() {
        let vals = [f32::NEG_INFINITY, -1e30, -2.5, -0.0, 0.0, 1e-30, 3.0, 1e30, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(pack(w[0], 0) <= pack(w[1], 0), "{} vs {}", w[0], w[1]);
        }
        assert!(pack(1.0, 3) > pack(1.0, 4));
        for &v in &vals {
            assert_eq!(unpack(pack(v, 77)), (v, 77));
        }
    }

    #[test]
    fn insert_best_keeps_the_best_in_order() {
        let mut best = [(f32::NEG_INFINITY, u32::MAX); 3];
        for (i, s) in [0.5f32, 2.0, -1.0, 2.0, 1.0, 3.0].into_iter().enumerate() {
            insert_best(&mut best, (s, i as u32));
        }
        // The tie at 2.0 keeps the earlier (slot 1) ahead.
        assert_eq!(best, [(3.0, 5), (2.0, 1), (2.0, 3)]);
        insert_best(&mut [], (1.0, 0));
    }

    #[test]
    fn truncate_best_keeps_the_largest() {
        let mut v: Vec<u64> = vec![5, 1, 9, 3, 7, 9, 2];
        truncate_best(&mut v, 3);
        v.sort_unstable();
        assert_eq!(v, [7, 9, 9]);
        let mut short = vec![4u64, 2];
        truncate_best(&mut short, 3);
        assert_eq!(short, [4, 2]);
    }
}
