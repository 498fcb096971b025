//! IceCache core: KV-cache retrieval for long-context LLMs.
//!
//! The pipeline, one module per stage:
//! - [`index`]: the multi-level Dynamic Continuous Indexing (M-DCI) tree over one head's keys,
//!   usable on its own as an approximate nearest-neighbour index ([`DciIndex`]);
//! - [`pages`]: one tree per KV head whose leaf cells are laid out as semantic pages of the CPU
//!   KV store ([`HeadForest`]), with decode-time inserts;
//! - [`select`]: the pages a decode step attends to, per KV head (GQA union);
//! - [`load`]: which pages are resident on the device, and the gather for one bulk copy;
//! - [`lookahead`]: the decode-time host work of a layer (insert, select, plan, gather) on a
//!   native worker, off the device's critical path.
//!
//! Python types live only in `bindings` (feature `python`).

pub mod error;
pub mod index;
pub mod input;
pub mod load;
pub mod lookahead;
pub mod pages;
pub mod select;
pub mod simd;

#[cfg(feature = "python")]
mod bindings;

pub use error::{Error, Result};
pub use index::{Calibration, Config, DciIndex, Metric, Stats};
pub use input::KeyData;
pub use load::{gather_pages, LoadPlan, ResidentPages};
pub use pages::HeadForest;
pub use select::SelectParams;
