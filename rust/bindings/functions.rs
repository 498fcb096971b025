//! The free function: the gather of pages into staging buffers.

use numpy::{PyArrayDescrMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::arrays::{check_shape, ints, ro, rw, with_elem};
use super::guard::{entry, run};
use super::pools::{on_pool, Workers};

/// Copies pages ``(heads[i], pages[i])`` of the stores into staging rows ``i``.
#[pyfunction]
pub(super) fn gather_pages(
    py: Python<'_>,
    k_store: &Bound<'_, PyAny>,
    v_store: &Bound<'_, PyAny>,
    heads: &Bound<'_, PyAny>,
    pages: &Bound<'_, PyAny>,
    k_stage: &Bound<'_, PyAny>,
    v_stage: &Bound<'_, PyAny>,
) -> PyResult<()> {
    entry(|| {
        let (hs, _) = ints::<i32>(heads, "heads", 1)?;
        let (ps, _) = ints::<i32>(pages, "pages", 1)?;
        with_elem!(k_store, "k_store", |T| {
            let (mut kt, tshape) = rw::<T>(k_stage, "k_stage")?;
            let (mut vt, _) = rw::<T>(v_stage, "v_stage")?;
            let (ks, kshape) = ro::<T>(k_store, "k_store")?;
            let (vs, vshape) = ro::<T>(v_store, "v_store")?;
            check_shape("k_store", &kshape, &[None, None, None, None])?;
            check_shape("v_store", &vshape, &[Some(kshape[0]), Some(kshape[1]), Some(kshape[2]), Some(kshape[3])])?;
            check_shape("k_stage", &tshape, &[None, Some(kshape[2]), Some(kshape[3])])?;
            let (ktl, vtl) = (kt.as_slice_mut()?, vt.as_slice_mut()?);
            let (ksl, vsl) = (ks.as_slice()?, vs.as_slice()?);
            let block = kshape[2] * kshape[3];
            run(py, || {
                on_pool(Workers::default_size(), true, || {
                    crate::load::gather_pages(ksl, vsl, kshape[0], block, &hs, &ps, ktl, vtl)
                })
            })
        })
    })
}
