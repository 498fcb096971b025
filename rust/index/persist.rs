//! Save files: a versioned header and a CRC-32 of the payload, then the index in bincode.
//!
//! Layout: magic (8 bytes) | format version (u32 LE) | payload length (u64 LE) |
//! CRC-32 of the payload (u32 LE) | payload. The payload is the index, then (format 2) its
//! search tuning (a pending `effort="auto"`, the last calibration). Files of format 1 have no
//! tuning section and still load (with none).
//!
//! A save writes a temporary file of its own (a unique name beside the target, locked while it
//! is written), flushes it to disk and renames it over the target. So concurrent saves to one
//! path each replace the file whole (the last rename wins), a save that returns `Ok` left a
//! readable file, and a crash leaves the target as it was. A writer killed mid-save leaves its
//! temporary file behind; the next save to the same target removes it (its lock is free then).
//!
//! A load checks the header, the checksum, and then the whole structure (`check_structure`), so
//! that a file that passed its checksum but was written by a buggy or hostile producer is
//! rejected instead of failing in a later call.

use std::fs;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bincode::Options;

use super::{DciIndex, FREE};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"ICEDCI\r\n";
const VERSION: u32 = 2;
/// The oldest format this build reads.
const OLDEST: u32 = 1;
const HEADER: usize = 8 + 4 + 8 + 4;
/// Suffix of the temporary files of a save (named `.{target}.{pid}-{n}.icecache-tmp`).
const TMP_SUFFIX: &str = ".icecache-tmp";

/// io errors name the file (the OS message alone does not).
fn with_path(e: std::io::Error, path: &Path) -> Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display())).into()
}

fn corrupt(why: &str) -> Error {
    Error::File(format!("not a valid IceCache index file: {why}"))
}

/// The bincode encoding of save files: fixed-width integers, little endian, nothing after the
/// index.
fn encoding() -> impl Options {
    bincode::DefaultOptions::new().with_fixint_encoding()
}

/// A writer that counts bytes and keeps a CRC-32 of them.
struct Checksummed<W> {
    inner: W,
    crc: crc32fast::Hasher,
    len: u64,
}

impl<W: Write> Write for Checksummed<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl DciIndex {
    /// Writes the index to `path` (see the module docs for the guarantees).
    pub fn save(&self, path: &Path) -> Result<()> {
        let name = path.file_name().ok_or_else(|| {
            Error::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{}: not a file name", path.display()),
            ))
        })?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let prefix = format!(".{}.", name.to_string_lossy());
        remove_stale(&dir, &prefix);
        let (tmp, file) = create_locked(&dir, &prefix).map_err(|e| with_path(e, path))?;
        // The file stays open, so locked, until it has its final name.
        let written = self.write_file(&file).and_then(|()| {
            fs::rename(&tmp, path)?;
            sync_dir(&dir)
        });
        drop(file);
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(with_path(e, path));
        }
        Ok(())
    }

    /// Header and payload into `file`, then to disk. The payload streams through a checksum;
    /// its length and CRC go into the header at the end.
    fn write_file(&self, file: &fs::File) -> std::io::Result<()> {
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(MAGIC)?;
        out.write_all(&VERSION.to_le_bytes())?;
        out.write_all(&[0; 12])?;
        let mut body = Checksummed { inner: out, crc: crc32fast::Hasher::new(), len: 0 };
        let io = |e: bincode::Error| match *e {
            bincode::ErrorKind::Io(e) => e,
            other => std::io::Error::other(other.to_string()),
        };
        encoding().serialize_into(&mut body, self).map_err(io)?;
        encoding().serialize_into(&mut body, &self.tuning).map_err(io)?;
        let (mut out, crc, len) = (body.inner, body.crc.finalize(), body.len);
        out.seek(SeekFrom::Start(12))?;
        out.write_all(&len.to_le_bytes())?;
        out.write_all(&crc.to_le_bytes())?;
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()
    }

    /// Reads an index written by `save`.
    pub fn load(path: &Path) -> Result<DciIndex> {
        let buf = fs::read(path).map_err(|e| with_path(e, path))?;
        DciIndex::from_bytes(&buf)
    }

    /// Reads an index from the bytes of a save file; rejects any file whose structure is not
    /// that of an index `save` could have written.
    pub fn from_bytes(buf: &[u8]) -> Result<DciIndex> {
        if buf.len() < HEADER {
            return Err(corrupt("the file is shorter than its header"));
        }
        if &buf[..8] != MAGIC {
            return Err(corrupt("wrong magic bytes"));
        }
        let word = |at: usize| u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
        let version = word(8);
        if !(OLDEST..=VERSION).contains(&version) {
            return Err(Error::File(format!(
                "index file format version {version} is not supported (this build reads {OLDEST} to {VERSION})"
            )));
        }
        let len = word(12) as u64 | (word(16) as u64) << 32;
        let crc = word(20);
        let payload = &buf[HEADER..];
        if payload.len() as u64 != len {
            return Err(corrupt(&format!("payload is {} bytes, header says {len} (truncated?)", payload.len())));
        }
        if crc32fast::hash(payload) != crc {
            return Err(corrupt("checksum mismatch (the file is corrupted)"));
        }
        let bad = |e: bincode::Error| corrupt(&e.to_string());
        let mut rest = payload;
        let mut index: DciIndex = encoding().with_limit(len).deserialize_from(&mut rest).map_err(bad)?;
        if version >= 2 {
            index.tuning = encoding().with_limit(len).deserialize_from(&mut rest).map_err(bad)?;
        }
        if !rest.is_empty() {
            return Err(corrupt(&format!("{} bytes after the index", rest.len())));
        }
        if let Some(leaves) = index.tiers.first_mut() {
            for c in &mut leaves.cells {
                // Files of earlier builds hold P-DCI arrays for every leaf cell; only cells of
                // `pdci_min_cell` members or more keep them now.
                if c.members.len() < index.cfg.pdci_min_cell {
                    c.sorted = Vec::new();
                }
            }
        }
        index.check_structure().map_err(|why| corrupt(&why))?;
        index.recompute_sums();
        index.built = index.len;
        index.upper_built = index.upper_points();
        index.id_map =
            index.level.iter().enumerate().filter(|(_, &l)| l != FREE).map(|(s, _)| (index.ids[s], s as u32)).collect();
        Ok(index)
    }
}

/// A new temporary file in `dir` named `{prefix}{pid}-{n}{TMP_SUFFIX}`, locked, and its path.
fn create_locked(dir: &Path, prefix: &str) -> std::io::Result<(PathBuf, fs::File)> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!("{prefix}{}-{n}{TMP_SUFFIX}", std::process::id()));
        let file = match fs::OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => f,
            // Left by an earlier process of the same pid: take the next name.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        };
        file.lock()?;
        // Another save's `remove_stale` may have removed the file between its creation and the
        // lock; then the name is not ours any more.
        if same_file(&file, &tmp) {
            return Ok((tmp, file));
        }
    }
}

#[cfg(unix)]
fn same_file(file: &fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

#[cfg(not(unix))]
fn same_file(_file: &fs::File, path: &Path) -> bool {
    // Elsewhere an open file cannot be removed.
    path.exists()
}

/// Removes temporary files of earlier saves to the same target whose writer is gone (their
/// lock is free). Best effort: a file another process is writing stays.
fn remove_stale(dir: &Path, prefix: &str) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with(prefix) && name.ends_with(TMP_SUFFIX)) {
            continue;
        }
        let path = entry.path();
        if let Ok(f) = fs::OpenOptions::new().read(true).open(&path) {
            if f.try_lock().is_ok() {
                let _ = fs::remove_file(&path);
            }
        }
    }
}

/// Makes a rename in `dir` durable.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Config, Metric, Tuning};
    use crate::input::KeyData;

    /// A file of `version` around `payload`, as `write_file` lays it out.
    fn sealed(version: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&version.to_le_bytes());
        f.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        f.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn index() -> DciIndex {
        let mut cfg = Config::new(4, Metric::InnerProduct);
        cfg.seed = Some(1);
        let mut idx = DciIndex::new(cfg).unwrap();
        let keys: Vec<f32> = (0..400).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
        idx.add(KeyData::F32(&keys), None).unwrap();
        idx
    }

    #[test]
    fn tuning_round_trips_and_format_1_still_loads() {
        let mut idx = index();
        let queries: Vec<f32> = (0..40).map(|i| ((i * 13 % 29) as f32 / 14.0) - 1.0).collect();
        let c = idx.calibrate(KeyData::F32(&queries), 5, 0.9, 0.0625..=64.0).unwrap();
        let mut pending = index();
        pending.set_auto_effort();
        for (idx, effort) in [(&idx, c.effort), (&pending, 1.0)] {
            let dir = std::env::temp_dir().join(format!("icecache-persist-{}", std::process::id()));
            fs::create_dir_all(&dir).unwrap();
            let path = dir.join("tuned.idx");
            idx.save(&path).unwrap();
            let back = DciIndex::load(&path).unwrap();
            assert_eq!(back.tuning, idx.tuning);
            assert_eq!(back.config().effort, effort);
            let _ = fs::remove_dir_all(&dir);
        }
        // Format 1: the index alone, no tuning section.
        let v1 = sealed(1, &encoding().serialize(&idx).unwrap());
        let back = DciIndex::from_bytes(&v1).unwrap();
        assert_eq!(back.tuning, Tuning::default());
        assert_eq!(back.config().effort, c.effort);
        // A format-2 file cut after the index (its tuning section missing) is rejected.
        assert!(matches!(DciIndex::from_bytes(&sealed(2, &encoding().serialize(&idx).unwrap())), Err(Error::File(_))));
        assert!(matches!(DciIndex::from_bytes(&sealed(3, &[])), Err(Error::File(_))));
    }
}
