//! The storage of the M-DCI tree: tiers of cells, and per slot the cells it belongs to and owns.
//! Built and changed by `tree`, walked by `descent`, scanned by `search` and `pdci`.

use serde::{Deserialize, Serialize};

/// "No cell / no slot".
pub(super) const NONE: u32 = u32::MAX;

/// One cell: a parent (`owner`) and the points assigned to it, with their centroid kept as sums.
#[derive(Clone, Default, Serialize, Deserialize)]
pub(super) struct Cell {
    pub live: bool,
    /// The parent point; `NONE` for the root cell.
    pub owner: u32,
    /// Member slots; the owner is one of them (the tree is nested).
    pub members: Vec<u32>,
    /// Sum of member keys and of their transform extras, in f64 so add/remove never drifts.
    pub sum: Vec<f64>,
    pub sum_extra: f64,
    /// Tier 0 only: int8 codes of the members (row `i` = `members[i]`) and their scales.
    pub codes: Vec<i8>,
    pub scales: Vec<f32>,
    /// Tier 0 only, and only cells of `Config::pdci_min_cell` members or more (empty otherwise):
    /// per P-DCI direction, `(projection, slot)` sorted by projection.
    pub sorted: Vec<Vec<(f32, u32)>>,
}

/// All cells of one tier, plus the per-slot maps into them.
#[derive(Clone, Default, Serialize, Deserialize)]
pub(super) struct Tier {
    pub cells: Vec<Cell>,
    pub free_cells: Vec<u32>,
    /// Per slot: the cell it is a member of in this tier (`NONE` if its level is below).
    pub member_cell: Vec<u32>,
    /// Per slot: its index in that cell's `members`.
    pub member_pos: Vec<u32>,
    /// Per slot: the cell of this tier it owns (`NONE` unless its level is above this tier).
    pub owned_cell: Vec<u32>,
    /// Per cell: route = centroid of members (`dim` floats), its squared norm, its mean extra.
    pub routes: Vec<f32>,
    pub route_sq: Vec<f32>,
    pub route_extra: Vec<f32>,
    /// Members over all live cells (= points of level ≥ this tier).
    pub num_members: usize,
}

impl Tier {
    pub fn new(num_slots: usize) -> Tier {
        Tier {
            member_cell: vec![NONE; num_slots],
            member_pos: vec![NONE; num_slots],
            owned_cell: vec![NONE; num_slots],
            ..Tier::default()
        }
    }

    pub fn grow_slots(&mut self, num_slots: usize) {
        self.member_cell.resize(num_slots, NONE);
        self.member_pos.resize(num_slots, NONE);
        self.owned_cell.resize(num_slots, NONE);
    }

    pub fn live_cells(&self) -> usize {
        self.cells.len() - self.free_cells.len()
    }

    pub fn bytes(&self) -> usize {
        let per_slot = (self.member_cell.len() + self.member_pos.len() + self.owned_cell.len()) * 4;
        let routes = (self.routes.len() + self.route_sq.len() + self.route_extra.len()) * 4;
        let cells: usize = self
            .cells
            .iter()
            .map(|c| {
                c.members.capacity() * 4
                    + c.sum.capacity() * 8
                    + c.codes.capacity()
                    + c.scales.capacity() * 4
                    + c.sorted.iter().map(|s| s.capacity() * 8).sum::<usize>()
                    + std::mem::size_of::<Cell>()
            })
            .sum();
        per_slot + routes + cells
    }

    pub fn route(&self, cell: u32, dim: usize) -> &[f32] {
        &self.routes[cell as usize * dim..(cell as usize + 1) * dim]
    }
}
