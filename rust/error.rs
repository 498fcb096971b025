//! The one error type of the core. The bindings map each variant to a Python exception.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// Bad argument: shape, dtype, value range, NaN/Inf, duplicate ids.
    #[error("{0}")]
    Invalid(String),
    /// An id that is not in the index.
    #[error("unknown id {0}")]
    UnknownId(i64),
    /// A save file that is truncated, corrupted, or of another format version.
    #[error("{0}")]
    File(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A background job failed or was cancelled (the message says which and why).
    #[error("{0}")]
    Worker(String),
    /// A call out of order: it must wait for a running job, or come after another call.
    #[error("{0}")]
    Order(String),
    /// An allocation the arguments ask for that the allocator refused.
    #[error("{0}")]
    Memory(String),
    /// A bug: a panic inside the core, caught at the boundary (`catch_panics`).
    #[error("internal error in icecache (a bug: please report it): {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// An empty vector with room for `n` entries, or `Error::Memory` if that cannot be allocated:
/// for sizes that come from the caller (an abort on allocation failure would take the process
/// down).
pub fn try_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        let bytes = (n as u128) * std::mem::size_of::<T>() as u128;
        Error::Memory(format!("cannot allocate {what}: {n} entries ({bytes} bytes)"))
    })?;
    Ok(v)
}

/// `n` copies of `value`, allocated as `try_capacity` does.
pub fn try_filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = try_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// Runs `f`, turning a panic into `Error::Internal` with the panic's message, so that no
/// panic unwinds out of the core.
pub fn catch_panics<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string());
        Err(Error::Internal(msg))
    })
}

/// `Err(Error::Invalid(..))` unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::Error::Invalid(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_internal_errors() {
        let r: Result<()> = catch_panics(|| panic!("boom {}", 7));
        assert!(matches!(r, Err(Error::Internal(m)) if m == "boom 7"));
        let r: Result<u8> = catch_panics(|| Ok(3));
        assert!(matches!(r, Ok(3)));
        let r: Result<()> = catch_panics(|| Err(Error::Invalid("x".into())));
        assert!(matches!(r, Err(Error::Invalid(_))));
    }

    #[test]
    fn impossible_allocations_are_errors() {
        assert!(matches!(try_filled(usize::MAX / 2, 0u64, "x"), Err(Error::Memory(_))));
        assert!(matches!(try_filled(1 << 50, 0u32, "x"), Err(Error::Memory(_))));
        assert_eq!(try_filled(3, 7u8, "x").unwrap(), vec![7, 7, 7]);
    }
}
