//! `ResidentPages`: which pages of each KV head are on the device, and in which slot.

use numpy::IntoPyArray;
use pyo3::prelude::*;

use super::arrays::{check_shape, ints, matrix, NdArray1, NdArray2};
use super::guard::{entry, sizes, to_py, Shared};
use crate::ResidentPages;

/// Which pages of each KV head are on the device, and in which slot.
#[pyclass(name = "ResidentPages", module = "icecache._core", frozen)]
pub struct PyResidentPages {
    /// Shared with the look-ahead worker's jobs (`bindings::lookahead`).
    pub(super) inner: Shared<ResidentPages>,
    pub(super) num_heads: usize,
}

#[pymethods]
impl PyResidentPages {
    #[new]
    fn new(
        #[pyo3(from_py_with = sizes::num_heads)] num_heads: usize,
        #[pyo3(from_py_with = sizes::capacity)] capacity: usize,
    ) -> PyResult<Self> {
        entry(|| {
            let inner = ResidentPages::new(num_heads, capacity).map_err(to_py)?;
            Ok(PyResidentPages { inner: Shared::new(inner, "ResidentPages"), num_heads })
        })
    }

    /// ``[H_kv, capacity]`` int32: the page in each device slot, -1 for an empty one.
    fn slot_pages<'py>(&self, py: Python<'py>) -> PyResult<NdArray2<'py, i32>> {
        entry(|| {
            let (pages, capacity) = self.inner.view(py, |r| Ok((r.slot_pages()?, r.capacity())))?;
            matrix(py, (self.num_heads, capacity), pages)
        })
    }

    /// Marks pages of ``head`` stale (reloaded when next selected).
    fn invalidate(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = sizes::head)] head: usize,
        pages: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        entry(|| {
            let (p, _) = ints::<i64>(pages, "pages", 1)?;
            self.inner.update(py, |r| r.invalidate(head, &p))
        })
    }

    /// ``(load_heads, load_pages, load_slots, table)`` for one step's selection.
    #[allow(clippy::type_complexity)]
    fn plan<'py>(
        &self,
        py: Python<'py>,
        pages: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
    ) -> PyResult<(NdArray1<'py, i32>, NdArray1<'py, i32>, NdArray1<'py, i32>, NdArray2<'py, i32>)> {
        entry(|| {
            let (p, pshape) = ints::<i32>(pages, "pages", 2)?;
            let (c, _) = ints::<i32>(counts, "counts", 1)?;
            check_shape("pages", &pshape, &[Some(self.num_heads), None])?;
            let plan = self.inner.update(py, |r| r.plan(&p, &c))?;
            Ok((
                plan.heads.into_pyarray(py),
                plan.pages.into_pyarray(py),
                plan.slots.into_pyarray(py),
                matrix(py, (pshape[0], pshape[1]), plan.table)?,
            ))
        })
    }
}
