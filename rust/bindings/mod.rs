//! The Python module `icecache._core`: the only place with Python types. One file per Python
//! type (`dci_index`, `head_forest`, `resident_pages`; `lookahead` for the look-ahead worker's
//! types) and one for the free functions (`functions`); `arrays` converts NumPy arrays. Every entry point goes through `guard`: the
//! body runs under a panic guard (a panic becomes `RuntimeError`), the core's work runs with
//! the GIL released behind the object's reader-writer lock, errors map to Python exceptions,
//! and sizes and ids are range-checked, never cast.

mod arrays;
mod dci_index;
mod functions;
mod guard;
mod head_forest;
mod lookahead;
mod pools;
mod resident_pages;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    pools::note_loading_process();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("IndexFileError", m.py().get_type::<guard::IndexFileError>())?;
    // What `effort="auto"` calibrates for: the runtime's prompt calibration uses the same.
    m.add("AUTO_TARGET", crate::index::AUTO_TARGET)?;
    m.add("AUTO_MIN_EFFORT", crate::index::AUTO_MIN_EFFORT)?;
    m.add_class::<dci_index::PyDciIndex>()?;
    m.add_class::<dci_index::PyCalibration>()?;
    m.add_class::<head_forest::PyHeadForest>()?;
    m.add_class::<resident_pages::PyResidentPages>()?;
    m.add_class::<lookahead::PyLookAhead>()?;
    m.add_class::<lookahead::PyLookAheadLayer>()?;
    m.add_class::<lookahead::PyOutcome>()?;
    m.add_class::<lookahead::PyStagingLayout>()?;
    m.add_function(wrap_pyfunction!(functions::gather_pages, m)?)?;
    Ok(())
}
