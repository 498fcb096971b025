//! IceCache core: KV-cache retrieval for long-context LLMs.
//!
//! The pipeline, one module per stage:
//! - [`index`]: the multi-level Dynamic Continuous Indexing (M-DCI) tree over one head's keys,
//!   usable on its own as an approximate nearest-neighbour index ([`DciIndex`]).
//!
//! Python types live only in `bindings` (feature `python`).

pub mod error;
pub mod index;
pub mod input;
pub mod simd;

#[cfg(feature = "python")]
mod bindings;

pub use error::{Error, Result};
pub use index::{Config, DciIndex, Metric, Stats};
pub use input::KeyData;
