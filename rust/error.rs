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
}

pub type Result<T> = std::result::Result<T, Error>;

/// `Err(Error::Invalid(..))` unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::Error::Invalid(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;
