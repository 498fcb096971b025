//! Save files: a versioned header and a CRC-32 of the payload, then the index in bincode.
//!
//! Layout: magic (8 bytes) | format version (u32 LE) | payload length (u64 LE) |
//! CRC-32 of the payload (u32 LE) | payload. Writes go to a temporary file that is renamed into
//! place, so a failed save never leaves a half-written file under the target name.

use std::fs;
use std::io::Write;
use std::path::Path;

use super::cells::NONE;
use super::{DciIndex, FREE};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"ICEDCI\r\n";
const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 8 + 4;

/// io errors name the file (the OS message alone does not).
fn with_path(e: std::io::Error, path: &Path) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn corrupt(why: &str) -> Error {
    Error::File(format!("not a valid IceCache index file: {why}"))
}

impl DciIndex {
    pub fn save(&self, path: &Path) -> Result<()> {
        let payload = bincode::serialize(self).map_err(|e| Error::File(e.to_string()))?;
        let mut buf = Vec::with_capacity(HEADER + payload.len());
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&VERSION.to_le_bytes());
        buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        buf.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        buf.extend_from_slice(&payload);
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = Path::new(&tmp);
        let written = fs::File::create(tmp).and_then(|mut f| {
            f.write_all(&buf)?;
            f.sync_all()
        });
        if let Err(e) = written.and_then(|_| fs::rename(tmp, path)) {
            let _ = fs::remove_file(tmp);
            return Err(with_path(e, path).into());
        }
        Ok(())
    }

    pub fn load(path: &Path) -> Result<DciIndex> {
        let buf = fs::read(path).map_err(|e| with_path(e, path))?;
        if buf.len() < HEADER {
            return Err(corrupt("the file is shorter than its header"));
        }
        if &buf[..8] != MAGIC {
            return Err(corrupt("wrong magic bytes"));
        }
        let version = u32::from_le_bytes(buf[8..12].try_into().unwrap());
        if version != VERSION {
            return Err(Error::File(format!(
                "index file format version {version} is not supported (this build reads {VERSION})"
            )));
        }
        let len = u64::from_le_bytes(buf[12..20].try_into().unwrap());
        let crc = u32::from_le_bytes(buf[20..24].try_into().unwrap());
        let payload = &buf[HEADER..];
        if payload.len() as u64 != len {
            return Err(corrupt(&format!("payload is {} bytes, header says {len} (truncated?)", payload.len())));
        }
        if crc32fast::hash(payload) != crc {
            return Err(corrupt("checksum mismatch (the file is corrupted)"));
        }
        let mut index: DciIndex = bincode::deserialize(payload).map_err(|e| corrupt(&e.to_string()))?;
        // Tags are not saved (see `DciIndex::tags`): every point loads untagged.
        index.tags = vec![0; index.level.len()];
        if let Some(leaves) = index.tiers.first_mut() {
            for c in &mut leaves.cells {
                c.tags = vec![0; c.members.len()];
            }
        }
        index.check_consistency(false).map_err(|why| corrupt(&why))?;
        index.id_map =
            index.level.iter().enumerate().filter(|(_, &l)| l != FREE).map(|(s, _)| (index.ids[s], s as u32)).collect();
        Ok(index)
    }

    /// Structural checks, so that a file that passed its checksum but was written by a buggy or
    /// hostile producer cannot make later calls index out of bounds. `deep` also checks the tree's
    /// invariants (every point in exactly one cell of each tier up to its level, owners in their
    /// own cells, centroids, codes and sorted projections up to date); tests use it.
    pub(crate) fn check_consistency(&self, deep: bool) -> std::result::Result<(), String> {
        self.cfg.validate().map_err(|e| e.to_string())?;
        let d = self.cfg.dim;
        let nd = self.cfg.num_dirs();
        let slots = self.level.len();
        let ok = self.dirs.len() == nd * (d + 1)
            && self.keys.len() == slots * d
            && self.sq_norms.len() == slots
            && self.proj.len() == slots * nd
            && self.ids.len() == slots
            && self.tags.len() == slots
            && self.level.iter().filter(|&&l| l != FREE).count() == self.len
            && self.free_slots.iter().all(|&s| (s as usize) < slots)
            && (self.shift.is_empty() || self.shift.len() == d)
            && (self.len == 0 || self.code_center.len() == d);
        if !ok {
            return Err("array lengths disagree".into());
        }
        if self.len == 0 {
            return if self.tiers.is_empty() { Ok(()) } else { Err("empty index with tiers".into()) };
        }
        let top = self.tiers.len().checked_sub(1).ok_or("no tiers")?;
        for (t, tier) in self.tiers.iter().enumerate() {
            let cells = tier.cells.len();
            let per_slot = tier.member_cell.len() == slots
                && tier.member_pos.len() == slots
                && tier.owned_cell.len() == slots
                && tier.routes.len() == cells * d
                && tier.route_sq.len() == cells
                && tier.route_extra.len() == cells;
            if !per_slot {
                return Err(format!("tier {t} tables disagree"));
            }
            for (ci, c) in tier.cells.iter().enumerate().filter(|(_, c)| c.live) {
                let fine = c.sum.len() == d
                    && c.members.iter().all(|&m| {
                        (m as usize) < slots
                            && tier.member_cell[m as usize] == ci as u32
                            && (tier.member_pos[m as usize] as usize) < c.members.len()
                    })
                    && (t > 0
                        || (c.codes.len() == c.members.len() * d
                            && c.scales.len() == c.members.len()
                            && c.tags.len() == c.members.len()
                            && c.sorted.len() == nd
                            && c.sorted.iter().all(|a| a.len() == c.members.len())));
                if !fine {
                    return Err(format!("cell {ci} of tier {t} is inconsistent"));
                }
            }
            if tier.owned_cell.iter().any(|&c| c != NONE && c as usize >= cells) {
                return Err(format!("tier {t} owns a missing cell"));
            }
        }
        if self.root as usize >= self.tiers[top].cells.len() {
            return Err("root out of range".into());
        }
        if deep {
            self.check_tree()?;
        }
        Ok(())
    }
}

impl DciIndex {
    /// The tree invariants (see `check_consistency`). Quadratic in nothing, but not cheap.
    fn check_tree(&self) -> std::result::Result<(), String> {
        let d = self.cfg.dim;
        let top = self.tiers.len() - 1;
        let root = &self.tiers[top].cells[self.root as usize];
        if !root.live || root.owner != NONE {
            return Err("the root cell must be live and have no owner".into());
        }
        if self.tiers[top].live_cells() != 1 {
            return Err("the top tier must hold exactly one cell".into());
        }
        for (slot, &l) in self.level.iter().enumerate() {
            for (t, tier) in self.tiers.iter().enumerate() {
                let member = tier.member_cell[slot] != NONE;
                let owns = tier.owned_cell[slot] != NONE;
                if l == FREE {
                    if member || owns {
                        return Err(format!("free slot {slot} is still in tier {t}"));
                    }
                    continue;
                }
                if member != (t <= l as usize) {
                    return Err(format!("slot {slot} of level {l}: membership in tier {t} is wrong"));
                }
                if owns != (t < l as usize) {
                    return Err(format!("slot {slot} of level {l}: ownership in tier {t} is wrong"));
                }
                if owns {
                    let c = &tier.cells[tier.owned_cell[slot] as usize];
                    if !c.live || c.owner != slot as u32 || tier.member_cell[slot] != tier.owned_cell[slot] {
                        return Err(format!("slot {slot} must be a member of the cell it owns in tier {t}"));
                    }
                }
            }
        }
        for (t, tier) in self.tiers.iter().enumerate() {
            let mut total = 0;
            for (ci, c) in tier.cells.iter().enumerate().filter(|(_, c)| c.live) {
                total += c.members.len();
                if c.members.is_empty() {
                    return Err(format!("cell {ci} of tier {t} is live but empty"));
                }
                if c.owner != NONE && tier.owned_cell[c.owner as usize] != ci as u32 {
                    return Err(format!("cell {ci} of tier {t} has an owner that does not own it"));
                }
                for (p, &m) in c.members.iter().enumerate() {
                    if tier.member_pos[m as usize] as usize != p {
                        return Err(format!("member_pos of slot {m} in tier {t} is stale"));
                    }
                }
                let n = c.members.len() as f32;
                let r = tier.route(ci as u32, d);
                for (j, &rj) in r.iter().enumerate() {
                    let mean = c.members.iter().map(|&m| self.key(m)[j]).sum::<f32>() / n;
                    if (mean - rj).abs() > 1e-3 * (1.0 + mean.abs()) {
                        return Err(format!("route of cell {ci} in tier {t} is stale"));
                    }
                }
                if t == 0 {
                    for (p, &m) in c.members.iter().enumerate() {
                        let mut code = vec![0i8; d];
                        let s = self.code_of(m, &mut code);
                        if code[..] != c.codes[p * d..(p + 1) * d] || s != c.scales[p] {
                            return Err(format!("code of slot {m} is stale"));
                        }
                        if c.tags[p] != self.tags[m as usize] {
                            return Err(format!("tag of slot {m} is stale in its leaf cell"));
                        }
                    }
                    for (j, arr) in c.sorted.iter().enumerate() {
                        if arr.windows(2).any(|w| w[0].0 > w[1].0) {
                            return Err(format!("sorted projections {j} of cell {ci} are out of order"));
                        }
                        let mut slots: Vec<u32> = arr.iter().map(|e| e.1).collect();
                        let mut members = c.members.clone();
                        slots.sort_unstable();
                        members.sort_unstable();
                        if slots != members {
                            return Err(format!("sorted projections {j} of cell {ci} miss members"));
                        }
                        if arr.iter().any(|&(p, s)| p != self.key_proj(s, j)) {
                            return Err(format!("sorted projections {j} of cell {ci} are stale"));
                        }
                    }
                }
            }
            if total != tier.num_members {
                return Err(format!("tier {t} counts {} members, cells hold {total}", tier.num_members));
            }
        }
        Ok(())
    }
}
