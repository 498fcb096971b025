//! Key arrays as they arrive from callers: f32, f16, or bf16 (the latter two widened to f32,
//! since all index arithmetic is f32).

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{ensure, Result};

/// A borrowed row-major `[n, dim]` block of keys.
#[derive(Clone, Copy, Debug)]
pub enum KeyData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

impl<'a> KeyData<'a> {
    pub fn len(&self) -> usize {
        match self {
            KeyData::F32(s) => s.len(),
            KeyData::F16(s) => s.len(),
            KeyData::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values `range` of the block (a whole number of rows, for a sub-block of rows).
    pub fn part(&self, range: std::ops::Range<usize>) -> KeyData<'a> {
        match *self {
            KeyData::F32(s) => KeyData::F32(&s[range]),
            KeyData::F16(s) => KeyData::F16(&s[range]),
            KeyData::Bf16(s) => KeyData::Bf16(&s[range]),
        }
    }

    /// A copy of the keys as f32 that the core owns. Always a copy: the caller's buffer may
    /// change while a call runs (another thread writing a NumPy array), and what a call
    /// validates must be what it uses.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.to_f32_vec_with_room(0)
    }

    /// `to_f32_vec` with capacity for `room` more values (an index grows its copy in place).
    pub fn to_f32_vec_with_room(&self, room: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len() + room);
        match *self {
            KeyData::F32(s) => out.extend_from_slice(s),
            KeyData::F16(s) => out.extend(s.iter().map(|x| x.to_f32())),
            KeyData::Bf16(s) => out.extend(s.iter().map(|x| x.to_f32())),
        }
        out
    }
}

/// Largest squared norm accepted: keeps every dot product and squared distance finite in f32.
const MAX_SQ_NORM: f32 = f32::MAX / 4.0;
/// Values from which `check_rows` spreads its pass over the thread pool: below it (a decode
/// step, a query batch) handing the work to the pool costs more than the pass itself.
const PARALLEL_CHECK_MIN: usize = 1 << 16;

/// Checks that `data` is a whole number of rows of `dim` finite values whose norms f32
/// arithmetic can handle; returns the row count.
pub fn check_rows(data: &[f32], dim: usize, what: &str) -> Result<usize> {
    ensure!(
        data.len().is_multiple_of(dim),
        "{what}: {} values are not a whole number of rows of dim {dim}",
        data.len()
    );
    // Common case in one pass (a NaN or infinity fails its row's norm test too), spread over
    // the pool when large; the error path below finds the first offender.
    let ok = |r: &[f32]| crate::simd::dot(r, r) <= MAX_SQ_NORM;
    let all_ok = if data.len() >= PARALLEL_CHECK_MIN {
        data.par_chunks_exact(dim).all(ok)
    } else {
        data.chunks_exact(dim).all(ok)
    };
    if all_ok {
        return Ok(data.len() / dim);
    }
    if let Some(i) = data.iter().position(|x| !x.is_finite()) {
        return Err(crate::Error::Invalid(format!("{what}: row {} holds a NaN or infinite value", i / dim)));
    }
    if let Some(i) = data.chunks_exact(dim).position(|r| !ok(r)) {
        return Err(crate::Error::Invalid(format!("{what}: row {i} has a norm too large for float32 arithmetic")));
    }
    Ok(data.len() / dim)
}
