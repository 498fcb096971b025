//! The beam descent shared by building and searching: from the root down to a target tier, at
//! each tier the best-scored cells until their members cover the beam, then the cells those
//! members own one tier down. How cells are scored (a point's nearness to routes while
//! building, a query's rank score while searching) is the caller's.

use super::cells::NONE;
use super::DciIndex;

/// Most cells `descend` picks one scan at a time instead of ordering them.
const SCAN_PICKS: usize = 8;

/// Reusable buffers of one descent.
#[derive(Default)]
pub(super) struct Descent {
    /// The cells of the tier above the target that `choose` picked.
    pub chosen: Vec<u32>,
    /// The cells of the tier being scored, and their scores.
    cells: Vec<u32>,
    scores: Vec<f32>,
    /// The scored cells of the target tier after a descent.
    pub cand: Vec<(f32, u32)>,
}

impl DciIndex {
    /// Scores the tier-`target` cells reachable from the root, top-down: at each tier above the
    /// target, cells are taken in score order until their members number `cover(tier)`; the
    /// cells those members own one tier down are scored next. `score(tier, cells, out)` writes
    /// the scores of `cells` to `out`. Leaves the scored target-tier cells, unordered, in
    /// `buf.cand`.
    pub(super) fn descend(
        &self,
        target: usize,
        cover: impl Fn(usize) -> usize,
        score: impl Fn(usize, &[u32], &mut [f32]),
        buf: &mut Descent,
    ) {
        buf.cand.clear();
        let top = self.tiers.len() - 1;
        if target == top {
            let mut out = [0f32];
            score(top, &[self.root], &mut out);
            buf.cand.push((out[0], self.root));
            return;
        }
        self.choose(target, &cover, &score, buf);
        self.score_below(target + 1, &score, buf);
    }

    /// The steps of `descend` down to tier `target + 1` (`target` below the top): leaves in
    /// `buf.chosen` the tier-`target + 1` cells whose members own the target-tier candidates.
    pub(super) fn choose(
        &self,
        target: usize,
        cover: &impl Fn(usize) -> usize,
        score: &impl Fn(usize, &[u32], &mut [f32]),
        buf: &mut Descent,
    ) {
        buf.chosen.clear();
        buf.chosen.push(self.root);
        for t in (target + 2..self.tiers.len()).rev() {
            self.score_below(t, score, buf);
            let below = &self.tiers[t - 1];
            let need = cover(t - 1);
            // Order only the head of the list: about `need / mean members` cells cover `need`.
            let mean = (below.num_members as f32 / below.live_cells() as f32).max(1.0);
            let head = ((need as f32 / mean).ceil() as usize * 2 + 2).min(buf.cand.len());
            let by_score = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0);
            // A few picks (the build's case): a scan per pick is cheaper than ordering the head.
            let scan = head <= SCAN_PICKS;
            if !scan {
                if head < buf.cand.len() {
                    buf.cand.select_nth_unstable_by(head - 1, by_score);
                }
                buf.cand[..head].sort_unstable_by(by_score);
            }
            buf.chosen.clear();
            let mut covered = 0;
            for i in 0..buf.cand.len() {
                if scan && i < head {
                    let best =
                        (i + 1..buf.cand.len()).fold(i, |b, j| if buf.cand[j].0 > buf.cand[b].0 { j } else { b });
                    buf.cand.swap(i, best);
                } else if i == head {
                    // Rare: the head did not cover enough; order the rest too.
                    buf.cand[head..].sort_unstable_by(by_score);
                }
                let c = buf.cand[i].1;
                buf.chosen.push(c);
                covered += below.cells[c as usize].members.len();
                if covered >= need {
                    break;
                }
            }
        }
    }

    /// The tier-`t - 1` cells owned by members of tier-`t` cell `cell`.
    pub(super) fn cells_below(&self, t: usize, cell: u32) -> impl Iterator<Item = u32> + '_ {
        let below = &self.tiers[t - 1];
        let members = &self.tiers[t].cells[cell as usize].members;
        members.iter().map(|&m| below.owned_cell[m as usize]).filter(|&oc| oc != NONE)
    }

    /// Scores the tier-`t - 1` cells below the chosen tier-`t` cells into `buf.cand`.
    fn score_below(&self, t: usize, score: &impl Fn(usize, &[u32], &mut [f32]), buf: &mut Descent) {
        buf.cells.clear();
        for &c in &buf.chosen {
            buf.cells.extend(self.cells_below(t, c));
        }
        buf.scores.resize(buf.cells.len(), 0.0);
        score(t - 1, &buf.cells, &mut buf.scores);
        buf.cand.clear();
        buf.cand.extend(buf.scores.iter().copied().zip(buf.cells.iter().copied()));
    }
}
