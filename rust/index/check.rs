//! Structural checks of an index: what a loaded file must satisfy before any call may use it
//! (`check_structure`), and the tree invariants that tests assert (`check_tree`).

use super::cells::NONE;
use super::{DciIndex, Metric, FREE};
use crate::input::check_rows;

type Check = std::result::Result<(), String>;

/// `Err(format!(..))` unless `cond` holds.
macro_rules! require {
    ($cond:expr, $($fmt:tt)+) => {
        // Bound first: clippy flags `!(a <= b)` on floats (NaN fails `a <= b` either way).
        let ok: bool = $cond;
        if !ok {
            return Err(format!($($fmt)+));
        }
    };
}

impl DciIndex {
    /// Everything a call relies on: array lengths, every index in range, each point in exactly
    /// the cells its level puts it in (with its position recorded), owners owning their cells,
    /// free lists that list exactly the free slots and cells, sorted projections that are sorted
    /// permutations of their cell's members with the values the index computes, finite keys and
    /// derived values, unique ids below the next fresh id. Linear in the index size.
    pub(crate) fn check_structure(&self) -> Check {
        self.cfg.validate().map_err(|e| e.to_string())?;
        let d = self.cfg.dim;
        let nd = self.cfg.num_dirs();
        let slots = self.level.len();
        require!(
            self.dirs.len() == nd * (d + 1)
                && self.keys.len() == slots * d
                && self.sq_norms.len() == slots
                && self.proj.len() == slots * nd
                && self.ids.len() == slots
                && (self.shift.is_empty() || self.shift.len() == d)
                && (self.len == 0 || self.code_center.len() == d),
            "array lengths disagree"
        );
        require!(slots < NONE as usize, "too many slots");
        require!(self.proj.iter().all(|x| x.is_finite()), "the projections hold a NaN or infinite value");
        // Unit directions keep the projections of any accepted key finite.
        for u in self.dirs.chunks_exact(d + 1) {
            let sq = u.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
            require!((sq - 1.0).abs() <= 1e-3, "a direction is not a unit vector");
        }
        for (what, v) in [("shift", &self.shift), ("code centre", &self.code_center)] {
            check_rows(v, d, what).map_err(|e| e.to_string())?;
        }
        check_rows(&self.keys, d, "keys").map_err(|e| e.to_string())?;
        for (s, (&sq, k)) in self.sq_norms.iter().zip(self.keys.chunks_exact(d)).enumerate() {
            let want = crate::simd::dot(k, k);
            require!((sq - want).abs() <= 1e-4 * (1.0 + want), "the squared norm of slot {s} is wrong");
        }
        require!(self.c.is_finite() && self.c >= 0.0, "c = {} is not a bound", self.c);
        if self.cfg.metric == Metric::InnerProduct && self.len > 0 {
            let max_sq = self.sq_norms.iter().fold(0f32, |m, &x| m.max(x));
            require!(self.c > 0.0 && self.c * self.c >= max_sq * (1.0 - 1e-5), "c = {} is below a key norm", self.c);
        }
        self.check_slots()?;
        if self.len == 0 {
            require!(self.tiers.is_empty(), "an empty index with tiers");
            return Ok(());
        }
        require!(
            !self.tiers.is_empty() && self.tiers.len() <= self.cfg.promotion.len() + 1,
            "{} tiers for {} promotion levels",
            self.tiers.len(),
            self.cfg.promotion.len()
        );
        for t in 0..self.tiers.len() {
            self.check_tier(t)?;
        }
        self.check_membership()
    }

    /// Levels, the free-slot list and ids.
    fn check_slots(&self) -> Check {
        let slots = self.level.len();
        let mut free = vec![false; slots];
        for &s in &self.free_slots {
            require!((s as usize) < slots && self.level[s as usize] == FREE, "free slot {s} is in use or out of range");
            require!(!std::mem::replace(&mut free[s as usize], true), "slot {s} is listed free twice");
        }
        let live = self.level.iter().filter(|&&l| l != FREE).count();
        require!(live == self.len && self.free_slots.len() == slots - live, "the free list disagrees with the levels");
        for (s, &l) in self.level.iter().enumerate() {
            require!(l == FREE || (l as usize) < self.tiers.len(), "slot {s} has level {l}, above the top tier");
        }
        let mut ids: Vec<i64> = (0..slots).filter(|&s| self.level[s] != FREE).map(|s| self.ids[s]).collect();
        ids.sort_unstable();
        require!(ids.first().is_none_or(|&id| id >= 0), "negative id");
        require!(ids.windows(2).all(|w| w[0] != w[1]), "an id appears twice");
        require!(ids.last().is_none_or(|&id| id < self.next_id), "the next fresh id {} is in use", self.next_id);
        Ok(())
    }

    /// Tier `t`: table lengths, the free-cell list, and each live cell's members, owner and
    /// (at the leaves) codes and sorted projections.
    fn check_tier(&self, t: usize) -> Check {
        let d = self.cfg.dim;
        let nd = self.cfg.num_dirs();
        let slots = self.level.len();
        let top = self.tiers.len() - 1;
        let tier = &self.tiers[t];
        let cells = tier.cells.len();
        require!(
            tier.member_cell.len() == slots
                && tier.member_pos.len() == slots
                && tier.owned_cell.len() == slots
                && tier.routes.len() == cells * d
                && tier.route_sq.len() == cells
                && tier.route_extra.len() == cells
                && cells < NONE as usize,
            "tier {t} tables disagree"
        );
        let mut listed = vec![false; cells];
        for &c in &tier.free_cells {
            require!((c as usize) < cells && !tier.cells[c as usize].live, "free cell {c} of tier {t} is in use");
            require!(!std::mem::replace(&mut listed[c as usize], true), "cell {c} of tier {t} is listed free twice");
        }
        let live = tier.cells.iter().filter(|c| c.live).count();
        require!(live + tier.free_cells.len() == cells, "tier {t}: the free-cell list misses dead cells");
        if t == top {
            require!(live == 1 && (self.root as usize) < cells, "the top tier must hold exactly the root cell");
        }
        let mut members = 0;
        for (ci, c) in tier.cells.iter().enumerate().filter(|(_, c)| c.live) {
            members += c.members.len();
            require!(!c.members.is_empty(), "cell {ci} of tier {t} is live but empty");
            require!(c.sum.len() == d, "cell {ci} of tier {t} has a sum of the wrong length");
            for (p, &m) in c.members.iter().enumerate() {
                let m = m as usize;
                require!(
                    m < slots
                        && self.level[m] != FREE
                        && self.level[m] as usize >= t
                        && tier.member_cell[m] == ci as u32
                        && tier.member_pos[m] as usize == p,
                    "member {m} of cell {ci} in tier {t} is not recorded there"
                );
            }
            if t == top {
                require!(ci as u32 == self.root && c.owner == NONE, "the root cell must have no owner");
            } else {
                let o = c.owner as usize;
                require!(
                    o < slots
                        && self.level[o] != FREE
                        && self.level[o] as usize > t
                        && tier.owned_cell[o] == ci as u32
                        && tier.member_cell[o] == ci as u32,
                    "cell {ci} of tier {t} has an owner that does not own it"
                );
            }
            if t == 0 {
                self.check_leaf(ci, nd)?;
            }
        }
        require!(members == tier.num_members, "tier {t} counts {} members, cells hold {members}", tier.num_members);
        Ok(())
    }

    /// Leaf cell `ci`: codes and scales for every member, and, if it has `pdci_min_cell` members
    /// or more, `nd` sorted projections (none otherwise), each a permutation of the members
    /// holding the values `key_proj` computes (removals look an entry up by that value).
    fn check_leaf(&self, ci: usize, nd: usize) -> Check {
        let d = self.cfg.dim;
        let leaves = &self.tiers[0];
        let c = &leaves.cells[ci];
        let n = c.members.len();
        require!(
            c.codes.len() == n * d
                && c.scales.len() == n
                && c.scales.iter().all(|x| x.is_finite())
                && c.sorted.len() == if n >= self.cfg.pdci_min_cell { nd } else { 0 },
            "leaf cell {ci} is inconsistent"
        );
        let mut seen = vec![false; n];
        for (j, arr) in c.sorted.iter().enumerate() {
            require!(arr.len() == n, "sorted projections {j} of leaf cell {ci} have the wrong length");
            seen.fill(false);
            for (i, &(p, s)) in arr.iter().enumerate() {
                let pos = leaves.member_pos.get(s as usize).map_or(usize::MAX, |&p| p as usize);
                require!(
                    c.members.get(pos) == Some(&s),
                    "sorted projections {j} of leaf cell {ci} name a slot outside the cell"
                );
                require!(
                    !std::mem::replace(&mut seen[pos], true),
                    "sorted projections {j} of leaf cell {ci} name a slot twice"
                );
                require!(p == self.key_proj(s, j), "sorted projections {j} of leaf cell {ci} are stale");
                require!(i == 0 || arr[i - 1].0 <= p, "sorted projections {j} of leaf cell {ci} are out of order");
            }
        }
        Ok(())
    }

    /// Each live point is a member of exactly the tiers up to its level and owns a cell in each
    /// tier below it; free slots are in no cell.
    fn check_membership(&self) -> Check {
        for (slot, &l) in self.level.iter().enumerate() {
            for (t, tier) in self.tiers.iter().enumerate() {
                let (mc, oc) = (tier.member_cell[slot], tier.owned_cell[slot]);
                if l == FREE {
                    require!(mc == NONE && oc == NONE, "free slot {slot} is still in tier {t}");
                    continue;
                }
                require!(
                    (mc != NONE) == (t <= l as usize),
                    "slot {slot} of level {l}: membership in tier {t} is wrong"
                );
                require!((oc != NONE) == (t < l as usize), "slot {slot} of level {l}: ownership in tier {t} is wrong");
                if mc != NONE {
                    let c = tier.cells.get(mc as usize);
                    require!(
                        c.is_some_and(
                            |c| c.live && c.members.get(tier.member_pos[slot] as usize) == Some(&(slot as u32))
                        ),
                        "slot {slot} is not where tier {t} records it"
                    );
                }
                if oc != NONE {
                    let c = tier.cells.get(oc as usize);
                    require!(
                        c.is_some_and(|c| c.live && c.owner == slot as u32) && mc == oc,
                        "slot {slot} must be a member of the cell it owns in tier {t}"
                    );
                }
            }
        }
        Ok(())
    }

    /// The invariants `check_structure` leaves out because a file can break them without
    /// making any call fail (and a load recomputes the sums and routes): routes equal to their
    /// members' centroids, codes up to date. Not cheap; for tests.
    pub(crate) fn check_tree(&self) -> Check {
        let d = self.cfg.dim;
        for (t, tier) in self.tiers.iter().enumerate() {
            for (ci, c) in tier.cells.iter().enumerate().filter(|(_, c)| c.live) {
                let n = c.members.len() as f32;
                let r = tier.route(ci as u32, d);
                for (j, &rj) in r.iter().enumerate() {
                    let mean = c.members.iter().map(|&m| self.key(m)[j]).sum::<f32>() / n;
                    require!((mean - rj).abs() <= 1e-3 * (1.0 + mean.abs()), "route of cell {ci} in tier {t} is stale");
                }
            }
        }
        let Some(leaves) = self.tiers.first() else { return Ok(()) };
        for c in leaves.cells.iter().filter(|c| c.live) {
            for (p, &m) in c.members.iter().enumerate() {
                let mut code = vec![0i8; d];
                let s = self.code_of(m, &mut code);
                require!(code[..] == c.codes[p * d..(p + 1) * d] && s == c.scales[p], "code of slot {m} is stale");
            }
        }
        Ok(())
    }
}
