//! Checksums that tell a forest's own keys and stores from others without keeping copies.
//!
//! - A key sum per head: a position-keyed checksum of the keys' bits, so that `write_pages`
//!   can tell the keys the forest indexes from other keys of the same shape.
//! - A store mark per head: the checksum of page 0 of the K store that holds the forest's keys
//!   (written by `write_pages` of those keys, kept up to date by `insert`), so that a store
//!   that is not that one, or a copy of it, is told apart. Page 0 exists in every head (a head
//!   holds at least one token) and every 8-bit K page is a copy of the forest's rows, so one page
//!   a head tells a store of other keys, or of none, from the forest's own.

use multiversion::multiversion;

use super::Elem;

/// The key sum of `rows` (`[n, d]` in element type `T`, at positions `start..start + n`), or
/// `None` if a key is NaN or infinite. Over the elements' bits: the same keys in another
/// element type are other keys.
pub(super) fn key_sum<T: Elem>(rows: &[T], d: usize, start: usize) -> Option<u64> {
    let mut sum = 0u64;
    for (i, row) in rows.chunks_exact(d).enumerate() {
        let (hash, finite) = row_hash(row);
        if !finite {
            return None;
        }
        sum = sum.wrapping_add(mix(((start + i) as u64) << 32 ^ hash));
    }
    Some(sum)
}

/// A hash of one row's bits, and whether every element is finite. Sixteen independent lanes,
/// so that it vectorises (at the machine's feature level): it runs over every key
/// `write_pages` writes.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2", "aarch64+neon"))]
fn row_hash<T: Elem>(row: &[T]) -> (u64, bool) {
    const LANES: usize = 16;
    let mut acc = [0u32; LANES];
    let mut inf = [0u32; LANES];
    let chunks = row.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks.chain(std::iter::once(rest)) {
        for ((a, f), &x) in acc.iter_mut().zip(inf.iter_mut()).zip(c) {
            let b = x.bits();
            *f |= u32::from(b & T::EXP_MASK == T::EXP_MASK);
            *a = (*a ^ b).wrapping_mul(0x9E37_79B1).rotate_left(15);
        }
    }
    let inf = inf.iter().fold(0, |x, &f| x | f);
    let hash = acc.iter().fold(row.len() as u64, |h, &a| h.rotate_left(29) ^ a as u64);
    (mix(hash), inf == 0)
}

/// The store mark of one page's bytes.
pub(super) fn page_mark(page: &[u8]) -> u32 {
    crc32fast::hash(page)
}

/// splitmix64's finaliser: spreads its input over all 64 bits, so that sums of different rows
/// rarely cancel.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^ (x >> 31)
}
