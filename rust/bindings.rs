//! The Python module `icecache._core`: the only place with Python types. Every call validates
//! its input in the core, releases the GIL for real work, and turns errors (and any panic)
//! into Python exceptions.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use half::{bf16, f16};
use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::index::{Config, DciIndex, Metric};
use crate::pages::HeadForest;
use crate::select::SelectParams;
use crate::{Error, KeyData, ResidentPages};

mod lookahead;
/// NumPy arrays handed back to Python.
type NdArray1<'py, T> = Bound<'py, PyArray1<T>>;
type NdArray2<'py, T> = Bound<'py, PyArray2<T>>;

create_exception!(
    _core,
    IndexFileError,
    PyValueError,
    "A save file is truncated, corrupted, or of an unsupported format version."
);

pub(crate) fn to_py(e: Error) -> PyErr {
    match e {
        Error::Invalid(m) => PyValueError::new_err(m),
        Error::UnknownId(id) => PyKeyError::new_err(format!("unknown id {id}")),
        Error::File(m) => IndexFileError::new_err(m),
        Error::Io(e) => e.into(),
        Error::Worker(m) => PyRuntimeError::new_err(m),
        Error::Memory(m) => pyo3::exceptions::PyMemoryError::new_err(m),
        e @ Error::Internal(_) => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Runs `f` without the GIL, on the object's pool if it has one and `parallel` work is
/// coming (handing a small call to a pool thread costs more than the call); a panic becomes
/// RuntimeError.
fn run<T: Send>(
    py: Python<'_>,
    pool: &Option<Arc<rayon::ThreadPool>>,
    parallel: bool,
    f: impl FnOnce() -> crate::Result<T> + Send,
) -> PyResult<T> {
    let out = py.allow_threads(|| {
        catch_unwind(AssertUnwindSafe(|| match pool {
            Some(p) if parallel => p.install(f),
            _ => f(),
        }))
    });
    match out {
        Ok(r) => r.map_err(to_py),
        Err(_) => Err(PyRuntimeError::new_err("internal error in icecache (a bug: please report it)")),
    }
}

/// Key arrays of at most this many values (one decode step's keys, one query) are copied under
/// the GIL: cheaper than registering a borrow, which dominates calls that take a few microseconds.
const SMALL_COPY: usize = 4096;

/// A 2-D key array borrowed from NumPy: f32, f16, or bf16 given as uint16. C-contiguous arrays
/// are read in place; other layouts are copied.
enum Keys<'py> {
    F32(numpy::PyReadonlyArray2<'py, f32>),
    F16(numpy::PyReadonlyArray2<'py, f16>),
    U16(numpy::PyReadonlyArray2<'py, u16>),
    OwnedF32(Vec<f32>),
    OwnedF16(Vec<f16>),
    OwnedBf16(Vec<bf16>),
}

/// `obj` as a NumPy array: arrays pass through; torch tensors and sequences are converted by
/// `icecache._arrays.as_numpy` (zero-copy for CPU tensors).
pub(crate) fn numpy_of<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, numpy::PyUntypedArray>> {
    if let Ok(a) = obj.downcast::<numpy::PyUntypedArray>() {
        return Ok(a.clone());
    }
    let conv = obj.py().import("icecache._arrays")?.call_method1("as_numpy", (obj,))?;
    conv.downcast_into::<numpy::PyUntypedArray>().map_err(|e| PyValueError::new_err(e.to_string()))
}

impl<'py> Keys<'py> {
    /// Reads a `[..., dim]` key array of `ndim` dimensions; returns it and its shape.
    fn extract_nd(obj: &Bound<'py, PyAny>, what: &str, dim: usize, ndim: usize) -> PyResult<(Keys<'py>, Vec<usize>)> {
        let arr = numpy_of(obj)?;
        if arr.ndim() != ndim {
            return Err(PyValueError::new_err(format!(
                "{what} must have {ndim} dimensions (last = {dim}), got {}",
                arr.ndim()
            )));
        }
        let shape = arr.shape().to_vec();
        if dim != 0 && shape[ndim - 1] != dim {
            return Err(PyValueError::new_err(format!(
                "{what} has last dimension {}, expected {dim}",
                shape[ndim - 1]
            )));
        }
        let (keys, _) = if ndim == 2 {
            Keys::from_2d(arr.as_any(), what)?
        } else {
            Keys::from_2d(&arr.call_method1("reshape", (-1i64, *shape.last().unwrap()))?, what)?
        };
        Ok((keys, shape))
    }

    fn extract(obj: &Bound<'py, PyAny>, what: &str, dim: usize) -> PyResult<(Keys<'py>, usize)> {
        let (keys, shape) = Keys::extract_nd(obj, what, dim, 2)?;
        Ok((keys, shape[0]))
    }

    fn from_2d(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<(Keys<'py>, usize)> {
        let arr = obj.downcast::<numpy::PyUntypedArray>()?;
        let rows = arr.shape()[0];
        let contiguous = arr.is_c_contiguous();
        let small = arr.len() <= SMALL_COPY;
        let keys = if let Ok(a) = obj.downcast::<PyArray2<f32>>() {
            if contiguous && small {
                Keys::OwnedF32(a.to_vec().expect("contiguous"))
            } else if contiguous {
                Keys::F32(a.readonly())
            } else {
                Keys::OwnedF32(a.readonly().as_array().iter().copied().collect())
            }
        } else if let Ok(a) = obj.downcast::<PyArray2<f16>>() {
            if contiguous {
                Keys::F16(a.readonly())
            } else {
                Keys::OwnedF16(a.readonly().as_array().iter().copied().collect())
            }
        } else if let Ok(a) = obj.downcast::<PyArray2<u16>>() {
            if contiguous {
                Keys::U16(a.readonly())
            } else {
                let v = a.readonly().as_array().iter().map(|&b| bf16::from_bits(b)).collect();
                Keys::OwnedBf16(v)
            }
        } else {
            return Err(PyValueError::new_err(format!(
                "{what} must be float32, float16, or bfloat16 as a uint16 view, got {}; \
                 convert with .astype(np.float32)",
                arr.dtype()
            )));
        };
        Ok((keys, rows))
    }

    fn data(&self) -> KeyData<'_> {
        match self {
            Keys::F32(a) => KeyData::F32(a.as_slice().expect("contiguous")),
            Keys::F16(a) => KeyData::F16(a.as_slice().expect("contiguous")),
            Keys::U16(a) => KeyData::Bf16(bytemuck_u16(a.as_slice().expect("contiguous"))),
            Keys::OwnedF32(f) => KeyData::F32(f),
            Keys::OwnedF16(h) => KeyData::F16(h),
            Keys::OwnedBf16(b) => KeyData::Bf16(b),
        }
    }
}

/// bf16 has the layout of its u16 bits.
fn bytemuck_u16(s: &[u16]) -> &[bf16] {
    half::slice::HalfBitsSliceExt::reinterpret_cast(s)
}

fn extract_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    // The common case, an int64 array, without a round trip through Python.
    if let Ok(a) = obj.downcast::<PyArray1<i64>>() {
        if let Ok(v) = a.to_vec() {
            return Ok(v);
        }
    }
    let np = obj.py().import("numpy")?;
    let arr = np.call_method1("asarray", (obj,))?;
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    if kind != "i" && kind != "u" {
        return Err(PyValueError::new_err(format!("ids must be integers, got dtype {}", arr.getattr("dtype")?)));
    }
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    if ndim != 1 {
        return Err(PyValueError::new_err(format!("ids must be 1-D, got {ndim} dimension(s)")));
    }
    if kind == "u" {
        let big = arr.call_method0("max").ok().map(|m| m.extract::<u64>()).transpose()?.unwrap_or(0);
        if big > i64::MAX as u64 {
            return Err(PyValueError::new_err(format!("ids must fit in int64, got {big}")));
        }
    }
    let arr = arr.call_method1("astype", ("int64",))?;
    let arr: PyReadonlyArray1<i64> = arr.extract()?;
    Ok(arr.as_array().to_vec())
}

/// Approximate nearest-neighbour index over a multi-level Dynamic Continuous Indexing tree.
/// See ``icecache/_core.pyi`` for the full documentation.
#[pyclass(name = "DCIIndex", module = "icecache._core")]
pub struct PyDciIndex {
    inner: DciIndex,
    pool: Option<Arc<rayon::ThreadPool>>,
}

fn make_pool(threads: Option<usize>) -> PyResult<Option<Arc<rayon::ThreadPool>>> {
    match threads {
        None => Ok(None),
        Some(0) => Err(PyValueError::new_err("threads must be at least 1 (or None for all cores)")),
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .map(|p| Some(Arc::new(p)))
            .map_err(|e| PyRuntimeError::new_err(e.to_string())),
    }
}

#[pymethods]
impl PyDciIndex {
    #[new]
    #[pyo3(signature = (dim, metric = "ip", *, num_simple = None, num_composite = None, promotion = None, seed = None, threads = None, effort = 1.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        dim: usize,
        metric: &str,
        num_simple: Option<usize>,
        num_composite: Option<usize>,
        promotion: Option<&Bound<'_, PyAny>>,
        seed: Option<u64>,
        threads: Option<usize>,
        effort: f32,
    ) -> PyResult<Self> {
        let mut cfg = Config::new(dim, Metric::parse(metric).map_err(to_py)?);
        apply_config(&mut cfg, num_simple, num_composite, promotion, seed, effort)?;
        let inner = DciIndex::new(cfg).map_err(to_py)?;
        Ok(PyDciIndex { inner, pool: make_pool(threads)? })
    }

    /// Key dimension.
    #[getter]
    fn dim(&self) -> usize {
        self.inner.dim()
    }

    /// ``"ip"`` or ``"l2"``.
    #[getter]
    fn metric(&self) -> &'static str {
        self.inner.metric().name()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!("DCIIndex(dim={}, metric={:?}, len={})", self.inner.dim(), self.inner.metric().name(), self.inner.len())
    }

    /// Adds ``keys`` ``[n, dim]`` under ``ids`` (fresh ids when None); returns the ids.
    #[pyo3(signature = (keys, ids = None))]
    fn add<'py>(
        &mut self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<NdArray1<'py, i64>> {
        let (keys, n) = Keys::extract(keys, "keys", self.inner.dim())?;
        let ids = ids.map(extract_ids).transpose()?;
        // Only a bulk build (into an empty index) runs in parallel.
        let parallel = self.inner.is_empty() && n > 1;
        let inner = &mut self.inner;
        let data = keys.data();
        let out = run(py, &self.pool, parallel, || inner.add(data, ids.as_deref()))?;
        Ok(out.into_pyarray(py))
    }

    /// Removes the points with these ids (all must exist; otherwise nothing changes).
    fn remove(&mut self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = extract_ids(ids)?;
        let inner = &mut self.inner;
        run(py, &self.pool, false, || inner.remove(&ids))
    }

    /// Top-``k`` neighbours of each query row: ``(ids [nq, k] int64, scores [nq, k] float32)``.
    #[pyo3(signature = (queries, k, *, effort = None, exact = false))]
    fn query<'py>(
        &self,
        py: Python<'py>,
        queries: &Bound<'py, PyAny>,
        k: i64,
        effort: Option<f32>,
        exact: bool,
    ) -> PyResult<(NdArray2<'py, i64>, NdArray2<'py, f32>)> {
        let (queries, nq) = Keys::extract(queries, "queries", self.inner.dim())?;
        if k < 1 {
            return Err(PyValueError::new_err(format!("k must be at least 1, got {k}")));
        }
        let inner = &self.inner;
        let data = queries.data();
        let (ids, scores) = run(py, &self.pool, nq > 1, || inner.query(data, k as usize, effort, exact))?;
        let k = k as usize;
        let ids = Array2::from_shape_vec((nq, k), ids).expect("shape");
        let scores = Array2::from_shape_vec((nq, k), scores).expect("shape");
        Ok((ids.into_pyarray(py), scores.into_pyarray(py)))
    }

    /// Writes the index to ``path`` (versioned header + checksum; atomic rename).
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let inner = &self.inner;
        run(py, &None, false, || inner.save(&path))
    }

    /// Reads an index written by ``save``.
    #[staticmethod]
    #[pyo3(signature = (path, threads = None))]
    fn load(py: Python<'_>, path: PathBuf, threads: Option<usize>) -> PyResult<Self> {
        let pool = make_pool(threads)?;
        let inner = run(py, &None, false, || DciIndex::load(&path))?;
        Ok(PyDciIndex { inner, pool })
    }

    /// Shape of the tree: ``len``, ``levels`` (points per level), ``cells_per_tier``,
    /// ``mean_leaf_cell``, ``max_leaf_cell``, ``c``, ``bytes``, and the configuration.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let cfg = self.inner.config();
        let d = PyDict::new(py);
        d.set_item("len", s.len)?;
        d.set_item("levels", s.points_per_level)?;
        d.set_item("cells_per_tier", s.cells_per_tier)?;
        d.set_item("mean_leaf_cell", s.mean_leaf_cell)?;
        d.set_item("max_leaf_cell", s.max_leaf_cell)?;
        d.set_item("c", s.c)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("num_simple", cfg.num_simple)?;
        d.set_item("num_composite", cfg.num_composite)?;
        d.set_item("promotion", cfg.promotion.clone())?;
        d.set_item("effort", cfg.effort)?;
        Ok(d)
    }
}

// ------------------------------------------------------------------ K/V stores

/// Runs `$body` with `$T` bound to the element type of `$arr` (f32, f16, or u16 = bf16 bits).
macro_rules! with_elem {
    ($arr:expr, $what:expr, |$T:ident| $body:expr) => {{
        let a = numpy_of($arr)?;
        let dt = a.dtype();
        if dt.is_equiv_to(&numpy::dtype::<f32>(a.py())) {
            type $T = f32;
            $body
        } else if dt.is_equiv_to(&numpy::dtype::<f16>(a.py())) {
            type $T = f16;
            $body
        } else if dt.is_equiv_to(&numpy::dtype::<u16>(a.py())) {
            type $T = u16;
            $body
        } else {
            Err(PyValueError::new_err(format!(
                "{} must be float32, float16, or bfloat16 as a uint16 view, got {dt}",
                $what
            )))
        }
    }};
}

/// An array of element `T` and its shape, read-only; copied to C order if it is not already.
fn ro<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<(numpy::PyReadonlyArrayDyn<'py, T>, Vec<usize>)> {
    let mut a = numpy_of(obj)?;
    if !a.is_c_contiguous() {
        let np = a.py().import("numpy")?;
        a = np.call_method1("ascontiguousarray", (a,))?.downcast_into()?;
    }
    let arr = a.downcast::<numpy::PyArrayDyn<T>>().map_err(|_| {
        PyValueError::new_err(format!("{what} has dtype {}; all K/V arrays of a call must share one dtype", a.dtype()))
    })?;
    let shape = arr.shape().to_vec();
    Ok((arr.readonly(), shape))
}

/// A C-contiguous, writable array of element `T` and its shape.
fn rw<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<(numpy::PyReadwriteArrayDyn<'py, T>, Vec<usize>)> {
    let a = numpy_of(obj)?;
    let arr = a.downcast::<numpy::PyArrayDyn<T>>().map_err(|_| {
        PyValueError::new_err(format!("{what} has dtype {}; all K/V arrays of a call must share one dtype", a.dtype()))
    })?;
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{what} must be C-contiguous")));
    }
    let shape = arr.shape().to_vec();
    let w = arr.try_readwrite().map_err(|e| PyValueError::new_err(format!("{what} is not writable: {e}")))?;
    Ok((w, shape))
}

fn check_shape(what: &str, shape: &[usize], want: &[Option<usize>]) -> PyResult<()> {
    let ok = shape.len() == want.len() && shape.iter().zip(want).all(|(s, w)| w.is_none_or(|w| *s == w));
    if ok {
        return Ok(());
    }
    let w: Vec<String> = want.iter().map(|w| w.map_or("*".to_string(), |x| x.to_string())).collect();
    Err(PyValueError::new_err(format!("{what} has shape {shape:?}, expected [{}]", w.join(", "))))
}

fn int_array<'py, T: numpy::Element + Copy>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<(Vec<T>, Vec<usize>)> {
    let np = obj.py().import("numpy")?;
    let arr = np.call_method1("asarray", (obj,))?;
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    if kind != "i" && kind != "u" {
        return Err(PyValueError::new_err(format!("{what} must hold integers")));
    }
    let arr = arr.call_method1("astype", (numpy::dtype::<T>(obj.py()),))?;
    let arr = arr.downcast::<numpy::PyArrayDyn<T>>()?.readonly();
    Ok((arr.as_array().iter().copied().collect(), arr.shape().to_vec()))
}

/// One M-DCI tree per KV head of one layer, laid out as semantic pages.
/// See ``icecache/_core.pyi`` for the full documentation.
#[pyclass(name = "HeadForest", module = "icecache._core")]
pub struct PyHeadForest {
    /// Shared with the look-ahead worker's jobs (`bindings::lookahead`).
    pub(crate) inner: Arc<RwLock<HeadForest>>,
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl PyHeadForest {
    // The core never panics while it holds the lock, so a poisoned lock still guards a
    // consistent forest.
    fn read(&self) -> RwLockReadGuard<'_, HeadForest> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, HeadForest> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyHeadForest {
    #[new]
    #[pyo3(signature = (keys, *, page_size = 16, seed = None, threads = None, num_simple = None, num_composite = None, promotion = None, effort = 1.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        page_size: usize,
        seed: Option<u64>,
        threads: Option<usize>,
        num_simple: Option<usize>,
        num_composite: Option<usize>,
        promotion: Option<&Bound<'_, PyAny>>,
        effort: f32,
    ) -> PyResult<Self> {
        let (keys, shape) = Keys::extract_nd(keys, "keys", 0, 3)?;
        let mut cfg = HeadForest::default_config(shape[2]);
        apply_config(&mut cfg, num_simple, num_composite, promotion, seed, effort)?;
        let pool = make_pool(threads)?;
        let data = keys.data();
        let inner = run(py, &pool, true, || HeadForest::build(data, shape[0], cfg, page_size))?;
        Ok(PyHeadForest { inner: Arc::new(RwLock::new(inner)), pool })
    }

    /// KV heads.
    #[getter]
    fn num_heads(&self) -> usize {
        self.read().num_heads()
    }

    /// Key dimension.
    #[getter]
    fn dim(&self) -> usize {
        self.read().dim()
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.read().page_size()
    }

    fn __len__(&self) -> usize {
        self.read().len()
    }

    fn __repr__(&self) -> String {
        let f = self.read();
        format!(
            "HeadForest(num_heads={}, tokens={}, dim={}, page_size={}, max_pages={})",
            f.num_heads(),
            f.len(),
            f.dim(),
            f.page_size(),
            f.max_pages()
        )
    }

    /// Pages of ``head``.
    fn num_pages(&self, head: usize) -> PyResult<usize> {
        self.read().num_pages(head).map_err(to_py)
    }

    /// Largest page count over the heads.
    fn max_pages(&self) -> usize {
        self.read().max_pages()
    }

    /// Token positions in ``page`` of ``head``, in slot order.
    fn page_tokens<'py>(&self, py: Python<'py>, head: usize, page: usize) -> PyResult<NdArray1<'py, i64>> {
        let f = self.read();
        let t = f.page_tokens(head, page).map_err(to_py)?;
        Ok(t.iter().map(|&x| x as i64).collect::<Vec<_>>().into_pyarray(py))
    }

    /// ``(page, slot)`` of every token position of ``head``.
    fn token_map<'py>(&self, py: Python<'py>, head: usize) -> PyResult<(NdArray1<'py, i32>, NdArray1<'py, i32>)> {
        let f = self.read();
        let m = f.token_map(head).map_err(to_py)?;
        let pages: Vec<i32> = m.iter().map(|x| x.0 as i32).collect();
        let slots: Vec<i32> = m.iter().map(|x| x.1 as i32).collect();
        Ok((pages.into_pyarray(py), slots.into_pyarray(py)))
    }

    /// Writes K and V of every token into the page stores.
    fn write_pages(
        &self,
        py: Python<'_>,
        k_src: &Bound<'_, PyAny>,
        v_src: &Bound<'_, PyAny>,
        k_store: &Bound<'_, PyAny>,
        v_store: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let f = self.read();
        let (h, n, d, s) = (f.num_heads(), f.len(), f.dim(), f.page_size());
        with_elem!(k_store, "k_store", |T| {
            let (ks, kshape) = rw::<T>(k_store, "k_store")?;
            let (vs, vshape) = rw::<T>(v_store, "v_store")?;
            let (kr, krs) = ro::<T>(k_src, "k_src")?;
            let (vr, vrs) = ro::<T>(v_src, "v_src")?;
            check_shape("k_src", &krs, &[Some(h), Some(n), Some(d)])?;
            check_shape("v_src", &vrs, &[Some(h), Some(n), Some(d)])?;
            check_shape("k_store", &kshape, &[Some(h), None, Some(s), Some(d)])?;
            check_shape("v_store", &vshape, &[Some(h), None, Some(s), Some(d)])?;
            let (mut ks, mut vs) = (ks, vs);
            let (ksl, vsl) = (ks.as_slice_mut()?, vs.as_slice_mut()?);
            let (krl, vrl) = (kr.as_slice()?, vr.as_slice()?);
            let inner = &*f;
            run(py, &self.pool, true, || inner.write_pages(krl, vrl, ksl, vsl))
        })
    }

    /// Pages for one decode step: ``(pages [H_kv, max_pages] int32, counts [H_kv] int32)``.
    #[pyo3(signature = (queries, max_pages, *, scale = None, effort = None, exact = false, successors = 0))]
    #[allow(clippy::too_many_arguments)]
    fn select<'py>(
        &self,
        py: Python<'py>,
        queries: &Bound<'py, PyAny>,
        max_pages: i64,
        scale: Option<f32>,
        effort: Option<f32>,
        exact: bool,
        successors: usize,
    ) -> PyResult<(NdArray2<'py, i32>, NdArray1<'py, i32>)> {
        let f = self.read();
        let (q, _) = Keys::extract(queries, "queries", f.dim())?;
        if max_pages < 1 {
            return Err(PyValueError::new_err(format!("max_pages must be at least 1, got {max_pages}")));
        }
        let params = SelectParams {
            max_pages: max_pages as usize,
            scale: scale.unwrap_or(1.0 / (f.dim() as f32).sqrt()),
            effort: effort.unwrap_or(f.heads_effort()),
            exact,
            successors,
        };
        let data = q.data();
        let inner = &*f;
        let (pages, counts) = run(py, &self.pool, true, || inner.select(&data.to_f32_vec(), params))?;
        let h = f.num_heads();
        let pages = Array2::from_shape_vec((h, params.max_pages), pages).expect("shape");
        Ok((pages.into_pyarray(py), counts.into_pyarray(py)))
    }

    /// Appends tokens (``[H_kv, m, d]``), writes them into the stores; returns changed pages per head.
    fn insert<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        values: &Bound<'py, PyAny>,
        k_store: &Bound<'py, PyAny>,
        v_store: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<NdArray1<'py, i32>>> {
        let mut f = self.write();
        let (h, d, s) = (f.num_heads(), f.dim(), f.page_size());
        let changed = with_elem!(k_store, "k_store", |T| {
            let (ks, kshape) = rw::<T>(k_store, "k_store")?;
            let (vs, vshape) = rw::<T>(v_store, "v_store")?;
            let (kr, krs) = ro::<T>(keys, "keys")?;
            let (vr, vrs) = ro::<T>(values, "values")?;
            check_shape("keys", &krs, &[Some(h), None, Some(d)])?;
            check_shape("values", &vrs, &[Some(h), Some(krs[1]), Some(d)])?;
            check_shape("k_store", &kshape, &[Some(h), None, Some(s), Some(d)])?;
            check_shape("v_store", &vshape, &[Some(h), None, Some(s), Some(d)])?;
            let (mut ks, mut vs) = (ks, vs);
            let (ksl, vsl) = (ks.as_slice_mut()?, vs.as_slice_mut()?);
            let (krl, vrl) = (kr.as_slice()?, vr.as_slice()?);
            let inner = &mut *f;
            run(py, &self.pool, true, || inner.insert(krl, vrl, ksl, vsl))
        })?;
        Ok(changed.into_iter().map(|c| c.into_iter().map(|p| p as i32).collect::<Vec<_>>().into_pyarray(py)).collect())
    }
}

fn apply_config(
    cfg: &mut Config,
    num_simple: Option<usize>,
    num_composite: Option<usize>,
    promotion: Option<&Bound<'_, PyAny>>,
    seed: Option<u64>,
    effort: f32,
) -> PyResult<()> {
    if let Some(m) = num_simple {
        cfg.num_simple = m;
    }
    if let Some(l) = num_composite {
        cfg.num_composite = l;
    }
    if let Some(p) = promotion {
        cfg.promotion = match p.extract::<f64>() {
            Ok(x) => vec![x],
            Err(_) => p
                .extract::<Vec<f64>>()
                .map_err(|_| PyValueError::new_err("promotion must be a float or a sequence of floats"))?,
        };
    }
    cfg.seed = seed;
    cfg.effort = effort;
    cfg.validate().map_err(to_py)
}

/// Which pages of each KV head are on the device, and in which slot.
#[pyclass(name = "ResidentPages", module = "icecache._core")]
pub struct PyResidentPages {
    /// Shared with the look-ahead worker's jobs (`bindings::lookahead`).
    pub(crate) inner: Arc<Mutex<ResidentPages>>,
}

impl PyResidentPages {
    // As for `PyHeadForest::read`: the core does not panic while it holds the lock.
    fn lock(&self) -> MutexGuard<'_, ResidentPages> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyResidentPages {
    #[new]
    fn new(num_heads: usize, capacity: usize) -> PyResult<Self> {
        Ok(PyResidentPages { inner: Arc::new(Mutex::new(ResidentPages::new(num_heads, capacity).map_err(to_py)?)) })
    }

    /// ``[H_kv, capacity]`` int32: the page in each device slot, -1 for an empty one.
    fn slot_pages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let resident = self.lock();
        let shape = (resident.num_heads(), resident.capacity());
        Ok(Array2::from_shape_vec(shape, resident.slot_pages().map_err(to_py)?).expect("shape").into_pyarray(py))
    }

    /// Marks pages of ``head`` stale (reloaded when next selected).
    fn invalidate(&mut self, head: usize, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let (p, _) = int_array::<i64>(pages, "pages")?;
        self.lock().invalidate(head, &p).map_err(to_py)
    }

    /// ``(load_heads, load_pages, load_slots, table)`` for one step's selection.
    #[allow(clippy::type_complexity)]
    fn plan<'py>(
        &mut self,
        py: Python<'py>,
        pages: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
    ) -> PyResult<(NdArray1<'py, i32>, NdArray1<'py, i32>, NdArray1<'py, i32>, NdArray2<'py, i32>)> {
        let (p, pshape) = int_array::<i32>(pages, "pages")?;
        let (c, _) = int_array::<i32>(counts, "counts")?;
        let mut resident = self.lock();
        check_shape("pages", &pshape, &[Some(resident.num_heads()), None])?;
        let plan = resident.plan(&p, &c).map_err(to_py)?;
        let table = Array2::from_shape_vec((pshape[0], pshape[1]), plan.table).expect("shape");
        Ok((
            plan.heads.into_pyarray(py),
            plan.pages.into_pyarray(py),
            plan.slots.into_pyarray(py),
            table.into_pyarray(py),
        ))
    }
}

/// Copies pages ``(heads[i], pages[i])`` of the stores into staging rows ``i``.
#[pyfunction]
fn gather_pages(
    py: Python<'_>,
    k_store: &Bound<'_, PyAny>,
    v_store: &Bound<'_, PyAny>,
    heads: &Bound<'_, PyAny>,
    pages: &Bound<'_, PyAny>,
    k_stage: &Bound<'_, PyAny>,
    v_stage: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (hs, _) = int_array::<i32>(heads, "heads")?;
    let (ps, _) = int_array::<i32>(pages, "pages")?;
    with_elem!(k_store, "k_store", |T| {
        let (ks, kshape) = ro::<T>(k_store, "k_store")?;
        let (vs, vshape) = ro::<T>(v_store, "v_store")?;
        check_shape("k_store", &kshape, &[None, None, None, None])?;
        check_shape("v_store", &vshape, &[Some(kshape[0]), Some(kshape[1]), Some(kshape[2]), Some(kshape[3])])?;
        let (kt, tshape) = rw::<T>(k_stage, "k_stage")?;
        let (vt, _) = rw::<T>(v_stage, "v_stage")?;
        check_shape("k_stage", &tshape, &[None, Some(kshape[2]), Some(kshape[3])])?;
        let (mut kt, mut vt) = (kt, vt);
        let (ktl, vtl) = (kt.as_slice_mut()?, vt.as_slice_mut()?);
        let (ksl, vsl) = (ks.as_slice()?, vs.as_slice()?);
        let block = kshape[2] * kshape[3];
        run(py, &None, true, || crate::load::gather_pages(ksl, vsl, kshape[0], block, &hs, &ps, ktl, vtl))
    })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("IndexFileError", m.py().get_type::<IndexFileError>())?;
    m.add_class::<PyDciIndex>()?;
    m.add_class::<PyHeadForest>()?;
    m.add_class::<PyResidentPages>()?;
    m.add_class::<lookahead::PyLookAhead>()?;
    m.add_class::<lookahead::PyLookAheadLayer>()?;
    m.add_class::<lookahead::PyOutcome>()?;
    m.add_class::<lookahead::PyStagingLayout>()?;
    m.add_function(wrap_pyfunction!(gather_pages, m)?)?;
    Ok(())
}
