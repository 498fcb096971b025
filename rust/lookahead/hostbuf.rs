//! [`HostBuf`]: host memory that its owner (the runtime, through the bindings) lends to jobs.
//!
//! The contract is the owner's: keep the memory alive and leave it alone until the job that
//! holds it has finished. A job then reads and writes it as typed slices, each buffer taken
//! mutably once per job.

use crate::error::{ensure, Result};

/// A region of host memory lent to a job by its owner.
#[derive(Clone, Copy, Debug)]
pub struct HostBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `HostBuf` is a pointer and a length; `HostBuf::new`'s contract makes the owner keep
// the memory valid and untouched while a job holds it, so it may move to the worker threads.
unsafe impl Send for HostBuf {}
// SAFETY: as for `Send`; jobs write disjoint parts of a buffer from different threads only
// through `slice_mut` calls on disjoint buffers.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// An empty buffer (no memory).
    pub const EMPTY: HostBuf = HostBuf { ptr: std::ptr::null_mut(), len: 0 };

    /// Lends `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes, and nobody but the job that holds
    /// this buffer may access it until that job is finished.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> HostBuf {
        HostBuf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes `at..at + len` of this buffer (clamped to it).
    ///
    /// # Safety
    /// As for [`HostBuf::new`]: the part is lent on the same terms as the whole.
    pub unsafe fn sub(&self, at: usize, len: usize) -> HostBuf {
        let at = at.min(self.len);
        HostBuf { ptr: self.ptr.wrapping_add(at), len: len.min(self.len - at) }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, for the dispatcher's volatile read of a flag.
    pub(super) fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    fn check<T>(&self, what: &str) -> Result<usize> {
        let size = std::mem::size_of::<T>();
        ensure!(
            self.len.is_multiple_of(size),
            "{what}: {} bytes are not a whole number of {size}-byte elements",
            self.len
        );
        ensure!(
            self.len == 0 || (self.ptr as usize).is_multiple_of(std::mem::align_of::<T>()),
            "{what} is not aligned for its element type"
        );
        Ok(self.len / size)
    }

    /// The buffer as elements of `T`.
    pub(super) fn slice<T>(&self, what: &str) -> Result<&[T]> {
        let n = self.check::<T>(what)?;
        if n == 0 {
            return Ok(&[]);
        }
        // SAFETY: `new`'s contract: valid, exclusively lent memory; size and alignment checked.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, n) })
    }

    /// The buffer as mutable elements of `T`. Each job takes each of its buffers mutably once.
    #[allow(clippy::mut_from_ref)]
    pub(super) fn slice_mut<T>(&self, what: &str) -> Result<&mut [T]> {
        let n = self.check::<T>(what)?;
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as for `slice`; the job holding the buffer is its only user.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, n) })
    }
}
