//! Fuzzing of save files as a buggy or hostile writer would make them: edited payloads with a
//! recomputed length and checksum. Each either fails to load with `Error::File`, or loads into
//! an index that every call (queries, adds, removes, stats, save) can use without a panic.
//!
//! `PROPTEST_CASES` sets the cases per strategy (CI runs the default, a few seconds).

use std::sync::OnceLock;

use icecache::{Config, DciIndex, Error, KeyData, Metric};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DIM: usize = 6;
const HEADER: usize = 24;

/// Save files of small indexes in several states: bulk-built, grown, with removals; inner
/// product and L2.
fn files() -> &'static [Vec<u8>] {
    static FILES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        let mut keys = |n: usize| -> Vec<f32> { (0..n * DIM).map(|_| rng.gen_range(-2.0..2.0f32)).collect() };
        let mut out = Vec::new();
        for (i, metric) in [Metric::InnerProduct, Metric::L2].into_iter().enumerate() {
            let mut cfg = Config::new(DIM, metric);
            cfg.seed = Some(i as u64);
            cfg.promotion = vec![0.15, 0.3];
            cfg.pdci_min_cell = 4; // exercise P-DCI's sorted projections too
            let mut idx = DciIndex::new(cfg).unwrap();
            let ids = idx.add(KeyData::F32(&keys(60)), None).unwrap();
            for _ in 0..15 {
                idx.add(KeyData::F32(&keys(1)), None).unwrap();
            }
            idx.remove(&ids[..ids.len() / 4]).unwrap();
            let path = dir.path().join(format!("{i}.dci"));
            idx.save(&path).unwrap();
            out.push(std::fs::read(&path).unwrap());
        }
        out
    })
}

/// `payload` under the header of `file`, with its length and CRC recomputed.
fn seal(file: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut out = file[..12].to_vec();
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Loads `bytes`; if that works, uses the index every way a caller can.
fn load_and_use(bytes: &[u8], seed: u64) -> Result<(), TestCaseError> {
    let mut idx = match DciIndex::from_bytes(bytes) {
        Ok(idx) => idx,
        Err(Error::File(_)) => return Ok(()),
        Err(e) => return Err(TestCaseError::fail(format!("load failed with {e:?}, not Error::File"))),
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut keys = |n: usize| -> Vec<f32> { (0..n * DIM).map(|_| rng.gen_range(-3.0..3.0f32)).collect() };
    let q = keys(3);
    let n = idx.len();
    for k in [1, n.max(1)] {
        let _ = idx.query(KeyData::F32(&q), k, None, false);
        let _ = idx.query(KeyData::F32(&q), k, Some(3.0), false);
        let _ = idx.query(KeyData::F32(&q), k, None, true);
    }
    let _ = idx.stats();
    let _ = idx.validate();
    if let Ok((ids, _)) = idx.query(KeyData::F32(&q[..DIM]), 3.min(n.max(1)), None, true) {
        let _ = idx.remove(&ids);
    }
    for _ in 0..4 {
        let _ = idx.add(KeyData::F32(&keys(1)), None);
    }
    let _ = idx.add(KeyData::F32(&keys(8)), None);
    if seed.is_multiple_of(8) {
        // Past 512 points inserts rebuild the tree: that must hold for a loaded one too.
        for _ in 0..520usize.saturating_sub(idx.len()) {
            let _ = idx.add(KeyData::F32(&keys(1)), None);
        }
        let _ = idx.validate();
    }
    let _ = idx.query(KeyData::F32(&q), 2.min(idx.len().max(1)), None, false);
    let dir = tempfile::tempdir().unwrap();
    if idx.save(&dir.path().join("again.dci")).is_ok() {
        if let Err(e) = DciIndex::load(&dir.path().join("again.dci")) {
            return Err(TestCaseError::fail(format!("a saved index must load: {e}")));
        }
    }
    Ok(())
}

/// Values that hit the checks hardest: small indices, "none" markers, non-finite floats.
fn word() -> impl Strategy<Value = [u8; 4]> {
    prop_oneof![
        (0u32..200).prop_map(u32::to_le_bytes),
        Just(u32::MAX.to_le_bytes()),
        Just((u32::MAX - 1).to_le_bytes()),
        Just(f32::NAN.to_le_bytes()),
        Just(f32::INFINITY.to_le_bytes()),
        Just((-1.0e30f32).to_le_bytes()),
        any::<u32>().prop_map(u32::to_le_bytes),
    ]
}

proptest! {
    /// Random bytes written at random places.
    #[test]
    fn edited_bytes(file in 0usize..2, edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6), seed in any::<u64>()) {
        let f = &files()[file];
        let mut payload = f[HEADER..].to_vec();
        for (at, v) in edits {
            let i = at.index(payload.len());
            payload[i] = v;
        }
        load_and_use(&seal(f, &payload), seed)?;
    }

    /// Whole words (indices, lengths, floats) overwritten.
    #[test]
    fn edited_words(file in 0usize..2, edits in prop::collection::vec((any::<prop::sample::Index>(), word()), 1..4), seed in any::<u64>()) {
        let f = &files()[file];
        let mut payload = f[HEADER..].to_vec();
        for (at, w) in edits {
            let i = at.index(payload.len() - 3);
            payload[i..i + 4].copy_from_slice(&w);
        }
        load_and_use(&seal(f, &payload), seed)?;
    }

    /// Bytes cut out or spliced in (everything after moves).
    #[test]
    fn cut_and_spliced(file in 0usize..2, at in any::<prop::sample::Index>(), cut in 0usize..16, splice in prop::collection::vec(any::<u8>(), 0..16), seed in any::<u64>()) {
        let f = &files()[file];
        let mut payload = f[HEADER..].to_vec();
        let i = at.index(payload.len());
        let end = (i + cut).min(payload.len());
        payload.splice(i..end, splice);
        load_and_use(&seal(f, &payload), seed)?;
    }
}

#[test]
fn the_base_files_load_and_validate() {
    for f in files() {
        DciIndex::from_bytes(f).unwrap().validate().unwrap();
        // The fuzz cases are not vacuous: an unedited payload sealed again still loads.
        DciIndex::from_bytes(&seal(f, &f[HEADER..])).unwrap();
    }
}
