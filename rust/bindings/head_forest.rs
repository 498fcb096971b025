//! `HeadForest`: one M-DCI tree per KV head of a layer, laid out as semantic pages, with page
//! selection and decode-time inserts.

use numpy::{IntoPyArray, PyArrayDescrMethods, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::arrays::{check_shape, matrix, ro, rw, to_i32, with_elem, Keys, NdArray1, NdArray2};
use super::dci_index::{apply_config, PyCalibration};
use super::guard::{entry, release, run, sizes, to_py, Shared};
use super::pools::{on_pool, Workers};
use crate::index::{DEFAULT_MAX_EFFORT, DEFAULT_MIN_EFFORT};
use crate::pages::{int8, HeadForest, PageFormat, Stores};
use crate::select::SelectParams;

/// K and V page stores borrowed writable from NumPy, in a forest's page format.
enum StoreArrays<'py, T: numpy::Element> {
    Native(PyReadwriteArrayDyn<'py, T>, PyReadwriteArrayDyn<'py, T>),
    /// Quantised stores (`Int8` or `K8V4`), as bytes.
    Bytes(PyReadwriteArrayDyn<'py, u8>, PyReadwriteArrayDyn<'py, u8>, PageFormat),
}

impl<T: numpy::Element> StoreArrays<'_, T> {
    /// The stores for the core.
    fn slices(&mut self) -> PyResult<Stores<'_, T>> {
        Ok(match self {
            StoreArrays::Native(k, v) => Stores::Native(k.as_slice_mut()?, v.as_slice_mut()?),
            StoreArrays::Bytes(k, v, PageFormat::K8V4) => Stores::K8V4(k.as_slice_mut()?, v.as_slice_mut()?),
            StoreArrays::Bytes(k, v, _) => Stores::Int8(k.as_slice_mut()?, v.as_slice_mut()?),
        })
    }
}

/// One M-DCI tree per KV head of one layer, laid out as semantic pages.
/// See ``icecache/_core.pyi`` for the full documentation.
#[pyclass(name = "HeadForest", module = "icecache._core", frozen)]
pub struct PyHeadForest {
    /// Shared with the look-ahead worker's jobs (`bindings::lookahead`).
    pub(super) inner: Shared<HeadForest>,
    workers: Workers,
    pub(super) num_heads: usize,
    pub(super) dim: usize,
    pub(super) page_size: usize,
    format: PageFormat,
}

impl PyHeadForest {
    fn pool(&self) -> Workers {
        self.workers
    }

    /// The pool of a call that may choose its priority: the forest's own (`None`), else the
    /// pool of the forest's thread count at the priority asked for.
    fn pool_for(&self, background: Option<bool>) -> Workers {
        background.map_or(self.workers, |b| self.workers.with_background(b))
    }

    /// The K and V page stores, borrowed writable and checked against this forest's shape:
    /// `[H_kv, P, page_size, d]` of the tokens' element `T`, or for quantised stores (`bytes`,
    /// see `byte_stores`) `[H_kv, P, page bytes]` uint8 (the format's K and V page bytes).
    fn borrow_stores<'py, T: numpy::Element>(
        &self,
        bytes: bool,
        k_store: &Bound<'py, PyAny>,
        v_store: &Bound<'py, PyAny>,
    ) -> PyResult<StoreArrays<'py, T>> {
        let (h, s, d) = (Some(self.num_heads), Some(self.page_size), Some(self.dim));
        if bytes {
            let (k, kshape) = rw::<u8>(k_store, "k_store")?;
            let (v, vshape) = rw::<u8>(v_store, "v_store")?;
            let (kb, vb) = (
                self.format.k_page_bytes(self.page_size, self.dim, 1),
                self.format.v_page_bytes(self.page_size, self.dim, 1),
            );
            check_shape("k_store", &kshape, &[h, None, Some(kb)])?;
            check_shape("v_store", &vshape, &[h, None, Some(vb)])?;
            return Ok(StoreArrays::Bytes(k, v, self.format));
        }
        let (k, kshape) = rw::<T>(k_store, "k_store")?;
        let (v, vshape) = rw::<T>(v_store, "v_store")?;
        check_shape("k_store", &kshape, &[h, None, s, d])?;
        check_shape("v_store", &vshape, &[h, None, s, d])?;
        Ok(StoreArrays::Native(k, v))
    }

    /// Whether this forest's stores are quantised (bytes), after checking that `k_store` is of
    /// that kind (uint8 for quantised stores, the tokens' dtype otherwise).
    fn byte_stores(&self, k_store: &Bound<'_, PyAny>) -> PyResult<bool> {
        let a = super::arrays::numpy_of(k_store)?;
        let uint8 = a.dtype().is_equiv_to(&numpy::dtype::<u8>(a.py()));
        let bytes = self.format.k_is_int8();
        if uint8 != bytes {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "this forest was built with page_format={:?}: its stores are {}, not {}",
                self.format.name(),
                if bytes { "uint8" } else { "in the tokens' dtype" },
                a.dtype()
            )));
        }
        Ok(bytes)
    }

    /// An 8-bit K store: `[H_kv, P, int8_page_bytes]` uint8.
    fn check_k_store(&self, shape: &[usize]) -> PyResult<()> {
        check_shape("k_store", shape, &[Some(self.num_heads), None, Some(int8::page_bytes(self.page_size, self.dim))])
    }

    /// `f(forest, codes)` on shared access: `codes` is `k_store`'s bytes when one is given
    /// (borrowed after the lock, with the GIL), for the core's work without the GIL.
    fn with_codes<R: Send>(
        &self,
        py: Python<'_>,
        k_store: Option<&Bound<'_, PyAny>>,
        f: impl FnOnce(&HeadForest, Option<&[u8]>) -> crate::Result<R> + Send,
    ) -> PyResult<R> {
        let Some(store) = k_store else { return self.inner.view(py, |forest| f(forest, None)) };
        let store = store.clone().unbind();
        self.inner.with_read(py, |py, forest| {
            let (codes, shape) = ro::<u8>(store.bind(py), "k_store")?;
            self.check_k_store(&shape)?;
            let codes = codes.as_slice()?;
            release(py, || f(forest, Some(codes)))
        })
    }
}

#[pymethods]
impl PyHeadForest {
    #[new]
    #[pyo3(signature = (keys, *, page_size = 16, page_format = "native", seed = None, threads = None, num_simple = None, num_composite = None, promotion = None, effort = 1.0, background = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = sizes::page_size)] page_size: usize,
        page_format: &str,
        #[pyo3(from_py_with = sizes::seed)] seed: Option<u64>,
        #[pyo3(from_py_with = sizes::threads)] threads: Option<usize>,
        #[pyo3(from_py_with = sizes::num_simple)] num_simple: Option<usize>,
        #[pyo3(from_py_with = sizes::num_composite)] num_composite: Option<usize>,
        promotion: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = sizes::effort)] effort: f32,
        background: bool,
    ) -> PyResult<Self> {
        entry(|| {
            let format = PageFormat::parse(page_format).map_err(to_py)?;
            let (keys, shape) = Keys::extract_nd(keys, "keys", 0, 3)?;
            let mut cfg = HeadForest::default_config(shape[2]);
            apply_config(&mut cfg, num_simple, num_composite, promotion, seed, effort)?;
            let workers = Workers::with_priority(threads, background)?;
            let data = keys.data()?;
            let inner =
                run(py, || on_pool(workers, true, || HeadForest::build(data, shape[0], cfg, page_size, format)))?;
            let (num_heads, dim, page_size) = (inner.num_heads(), inner.dim(), inner.page_size());
            Ok(PyHeadForest { inner: Shared::new(inner, "HeadForest"), workers, num_heads, dim, page_size, format })
        })
    }

    /// KV heads.
    #[getter]
    fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// Key dimension.
    #[getter]
    fn dim(&self) -> usize {
        self.dim
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.page_size
    }

    /// The page stores' format: ``"native"`` (the tokens' dtype) or ``"int8"``.
    #[getter]
    fn page_format(&self) -> &'static str {
        self.format.name()
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        entry(|| self.inner.view(py, |f| Ok(f.len())))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        entry(|| {
            let (len, max_pages) = self.inner.view(py, |f| Ok((f.len(), f.max_pages())))?;
            Ok(format!(
                "HeadForest(num_heads={}, tokens={len}, dim={}, page_size={}, page_format={:?}, max_pages={max_pages})",
                self.num_heads,
                self.dim,
                self.page_size,
                self.format.name()
            ))
        })
    }

    /// Pages of ``head``.
    fn num_pages(&self, py: Python<'_>, #[pyo3(from_py_with = sizes::head)] head: usize) -> PyResult<usize> {
        entry(|| self.inner.view(py, |f| f.num_pages(head)))
    }

    /// Largest page count over the heads.
    fn max_pages(&self, py: Python<'_>) -> PyResult<usize> {
        entry(|| self.inner.view(py, |f| Ok(f.max_pages())))
    }

    /// Approximate heap bytes of the trees and page layouts (not the page stores).
    fn nbytes(&self, py: Python<'_>) -> PyResult<usize> {
        entry(|| self.inner.view(py, |f| Ok(f.nbytes())))
    }

    /// Token positions in ``page`` of ``head``, in slot order.
    fn page_tokens<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = sizes::head)] head: usize,
        #[pyo3(from_py_with = sizes::page)] page: usize,
    ) -> PyResult<NdArray1<'py, i64>> {
        entry(|| {
            let t = self
                .inner
                .view(py, |f| Ok(f.page_tokens(head, page)?.iter().map(|&x| x as i64).collect::<Vec<_>>()))?;
            Ok(t.into_pyarray(py))
        })
    }

    /// ``(page, slot)`` of every token position of ``head``.
    fn token_map<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = sizes::head)] head: usize,
    ) -> PyResult<(NdArray1<'py, i32>, NdArray1<'py, i32>)> {
        entry(|| {
            let m = self.inner.view(py, |f| f.token_map(head))?;
            let pages = to_i32(m.iter().map(|x| x.0), "page")?;
            let slots = to_i32(m.iter().map(|x| x.1), "slot")?;
            Ok((pages.into_pyarray(py), slots.into_pyarray(py)))
        })
    }

    /// Writes K and V of every token into the page stores.
    #[pyo3(signature = (k_src, v_src, k_store, v_store, *, background = None))]
    fn write_pages(
        &self,
        py: Python<'_>,
        k_src: &Bound<'_, PyAny>,
        v_src: &Bound<'_, PyAny>,
        k_store: &Bound<'_, PyAny>,
        v_store: &Bound<'_, PyAny>,
        background: Option<bool>,
    ) -> PyResult<()> {
        entry(|| {
            let arrays = [k_src, v_src, k_store, v_store].map(|a| a.clone().unbind());
            // The forest's shared lock first, then the arrays, with the GIL again.
            self.inner.with_read(py, |py, forest| {
                let [k_src, v_src, k_store, v_store] = arrays.each_ref().map(|a| a.bind(py));
                let (h, d) = (self.num_heads, self.dim);
                let n = forest.len();
                let pool = self.pool_for(background);
                let bytes = self.byte_stores(k_store)?;
                with_elem!(k_src, "k_src", |T| {
                    let mut stores = self.borrow_stores::<T>(bytes, k_store, v_store)?;
                    let (kr, krs) = ro::<T>(k_src, "k_src")?;
                    let (vr, vrs) = ro::<T>(v_src, "v_src")?;
                    check_shape("k_src", &krs, &[Some(h), Some(n), Some(d)])?;
                    check_shape("v_src", &vrs, &[Some(h), Some(n), Some(d)])?;
                    let stores = stores.slices()?;
                    let (krl, vrl) = (kr.as_slice()?, vr.as_slice()?);
                    release(py, || on_pool(pool, true, || forest.write_pages(krl, vrl, stores)))
                })
            })
        })
    }

    /// Pages for one decode step: ``(pages [H_kv, max_pages] int32, counts [H_kv] int32)``.
    #[pyo3(signature = (queries, max_pages, *, k_store = None, scale = None, effort = None, exact = false, successors = 0, group_view = false))]
    #[allow(clippy::too_many_arguments)]
    fn select<'py>(
        &self,
        py: Python<'py>,
        queries: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = sizes::max_pages)] max_pages: usize,
        k_store: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = sizes::optional_scale)] scale: Option<f32>,
        #[pyo3(from_py_with = sizes::optional_effort)] effort: Option<f32>,
        exact: bool,
        #[pyo3(from_py_with = sizes::successors)] successors: usize,
        group_view: bool,
    ) -> PyResult<(NdArray2<'py, i32>, NdArray1<'py, i32>)> {
        entry(|| {
            let (q, _) = Keys::extract(queries, "queries", self.dim)?;
            let q = q.data()?.to_f32_vec();
            let params = SelectParams {
                max_pages,
                scale: scale.unwrap_or(1.0 / (self.dim as f32).sqrt()),
                effort,
                exact,
                successors,
                group_view,
            };
            let pool = self.pool();
            let (pages, counts) =
                self.with_codes(py, k_store, |f, codes| on_pool(pool, true, || f.select(&q, params, codes)))?;
            Ok((matrix(py, (self.num_heads, max_pages), pages)?, counts.into_pyarray(py)))
        })
    }

    /// Calibrates each head's default effort on its GQA group's queries ``[H_q, n, d]``.
    #[pyo3(
        signature = (queries, k, target_recall = 0.95, *, k_store = None, min_effort = DEFAULT_MIN_EFFORT, max_effort = DEFAULT_MAX_EFFORT),
        text_signature = "(self, queries, k, target_recall=0.95, *, k_store=None, min_effort=0.0625, max_effort=64.0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn calibrate(
        &self,
        py: Python<'_>,
        queries: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = sizes::k)] k: usize,
        #[pyo3(from_py_with = sizes::target_recall)] target_recall: f64,
        k_store: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = sizes::min_effort)] min_effort: f32,
        #[pyo3(from_py_with = sizes::max_effort)] max_effort: f32,
    ) -> PyResult<Vec<PyCalibration>> {
        entry(|| {
            let (q, shape) = Keys::extract_nd(queries, "queries", self.dim, 3)?;
            let q = q.data()?.to_f32_vec();
            let pool = self.pool();
            let efforts = min_effort..=max_effort;
            let found = match k_store {
                None => self.inner.update(py, |f| {
                    on_pool(pool, true, || f.calibrate(&q, shape[0], k, target_recall, efforts, None))
                })?,
                Some(store) => {
                    let store = store.clone().unbind();
                    self.inner.with_write(py, |py, f| {
                        let (codes, shape_k) = ro::<u8>(store.bind(py), "k_store")?;
                        self.check_k_store(&shape_k)?;
                        let codes = codes.as_slice()?;
                        release(py, || {
                            on_pool(pool, true, || f.calibrate(&q, shape[0], k, target_recall, efforts, Some(codes)))
                        })
                    })?
                }
            };
            Ok(found.into_iter().map(PyCalibration::from).collect())
        })
    }

    /// Each head's default effort (``select`` with ``effort=None`` uses it).
    #[getter]
    fn efforts(&self, py: Python<'_>) -> PyResult<Vec<f32>> {
        entry(|| self.inner.view(py, |f| Ok(f.efforts())))
    }

    /// Appends tokens (``[H_kv, m, d]``), writes them into the stores; returns changed pages per head.
    #[pyo3(signature = (keys, values, k_store, v_store, *, background = None))]
    fn insert<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        values: &Bound<'py, PyAny>,
        k_store: &Bound<'py, PyAny>,
        v_store: &Bound<'py, PyAny>,
        background: Option<bool>,
    ) -> PyResult<Vec<NdArray1<'py, i32>>> {
        entry(|| {
            let arrays = [keys, values, k_store, v_store].map(|a| a.clone().unbind());
            // The lock first: a second writer waits for it instead of failing on the stores.
            let changed = self.inner.with_write(py, |py, forest| {
                let [keys, values, k_store, v_store] = arrays.each_ref().map(|a| a.bind(py));
                let (h, d) = (self.num_heads, self.dim);
                let bytes = self.byte_stores(k_store)?;
                with_elem!(keys, "keys", |T| {
                    let mut stores = self.borrow_stores::<T>(bytes, k_store, v_store)?;
                    let (kr, krs) = ro::<T>(keys, "keys")?;
                    let (vr, vrs) = ro::<T>(values, "values")?;
                    check_shape("keys", &krs, &[Some(h), None, Some(d)])?;
                    check_shape("values", &vrs, &[Some(h), Some(krs[1]), Some(d)])?;
                    let stores = stores.slices()?;
                    // Copies: what the core validates must be what it inserts, whatever other
                    // threads do to the caller's arrays meanwhile.
                    let (krl, vrl) = (kr.as_slice()?.to_vec(), vr.as_slice()?.to_vec());
                    let pool = self.pool_for(background);
                    release(py, || on_pool(pool, true, || forest.insert(&krl, &vrl, stores)))
                })
            })?;
            changed.into_iter().map(|c| Ok(to_i32(c, "page")?.into_pyarray(py))).collect()
        })
    }
}
