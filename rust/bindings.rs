//! The Python module `icecache._core`: the only place with Python types. Every call validates
//! its input in the core, releases the GIL for real work, and turns errors (and any panic)
//! into Python exceptions.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;

use half::{bf16, f16};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::index::{Config, DciIndex, Metric};
use crate::{Error, KeyData};

create_exception!(
    _core,
    IndexFileError,
    PyValueError,
    "A save file is truncated, corrupted, or of an unsupported format version."
);

fn to_py(e: Error) -> PyErr {
    match e {
        Error::Invalid(m) => PyValueError::new_err(m),
        Error::UnknownId(id) => PyKeyError::new_err(format!("unknown id {id}")),
        Error::File(m) => IndexFileError::new_err(m),
        Error::Io(e) => e.into(),
    }
}

/// Runs `f` without the GIL (on the index's pool if it has one); a panic becomes RuntimeError.
fn run<T: Send>(
    py: Python<'_>,
    pool: &Option<Arc<rayon::ThreadPool>>,
    f: impl FnOnce() -> crate::Result<T> + Send,
) -> PyResult<T> {
    let out = py.allow_threads(|| {
        catch_unwind(AssertUnwindSafe(|| match pool {
            Some(p) => p.install(f),
            None => f(),
        }))
    });
    match out {
        Ok(r) => r.map_err(to_py),
        Err(_) => Err(PyRuntimeError::new_err("internal error in icecache (a bug: please report it)")),
    }
}

/// A 2-D key array borrowed from NumPy: f32, f16, or bf16 given as uint16. C-contiguous arrays
/// are read in place; other layouts are copied.
enum Keys<'py> {
    F32(numpy::PyReadonlyArray2<'py, f32>),
    F16(numpy::PyReadonlyArray2<'py, f16>),
    U16(numpy::PyReadonlyArray2<'py, u16>),
    Owned(Vec<f32>, Option<Vec<f16>>, Option<Vec<bf16>>),
}

impl<'py> Keys<'py> {
    fn extract(obj: &Bound<'py, PyAny>, what: &str, dim: usize) -> PyResult<(Keys<'py>, usize)> {
        let arr = obj.downcast::<numpy::PyUntypedArray>().map_err(|_| {
            PyValueError::new_err(format!("{what} must be a NumPy array, got {}", obj.get_type()))
        })?;
        if arr.ndim() != 2 {
            return Err(PyValueError::new_err(format!(
                "{what} must be 2-D [n, {dim}], got {} dimension(s)",
                arr.ndim()
            )));
        }
        let shape = arr.shape().to_vec();
        if shape[1] != dim {
            return Err(PyValueError::new_err(format!(
                "{what} has {} columns, the index has dim {dim}",
                shape[1]
            )));
        }
        let contiguous = arr.is_c_contiguous();
        let keys = if let Ok(a) = obj.downcast::<PyArray2<f32>>() {
            if contiguous { Keys::F32(a.readonly()) } else { Keys::Owned(a.readonly().as_array().iter().copied().collect(), None, None) }
        } else if let Ok(a) = obj.downcast::<PyArray2<f16>>() {
            if contiguous { Keys::F16(a.readonly()) } else { Keys::Owned(Vec::new(), Some(a.readonly().as_array().iter().copied().collect()), None) }
        } else if let Ok(a) = obj.downcast::<PyArray2<u16>>() {
            if contiguous {
                Keys::U16(a.readonly())
            } else {
                let v = a.readonly().as_array().iter().map(|&b| bf16::from_bits(b)).collect();
                Keys::Owned(Vec::new(), None, Some(v))
            }
        } else {
            return Err(PyValueError::new_err(format!(
                "{what} must be float32, float16, or bfloat16 as a uint16 view, got {}; \
                 convert with .astype(np.float32)",
                arr.dtype()
            )));
        };
        Ok((keys, shape[0]))
    }

    fn data(&self) -> KeyData<'_> {
        match self {
            Keys::F32(a) => KeyData::F32(a.as_slice().expect("contiguous")),
            Keys::F16(a) => KeyData::F16(a.as_slice().expect("contiguous")),
            Keys::U16(a) => KeyData::Bf16(bytemuck_u16(a.as_slice().expect("contiguous"))),
            Keys::Owned(_, Some(h), _) => KeyData::F16(h),
            Keys::Owned(_, _, Some(b)) => KeyData::Bf16(b),
            Keys::Owned(f, None, None) => KeyData::F32(f),
        }
    }
}

/// bf16 has the layout of its u16 bits.
fn bytemuck_u16(s: &[u16]) -> &[bf16] {
    half::slice::HalfBitsSliceExt::reinterpret_cast(s)
}

fn extract_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
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
        if let Some(m) = num_simple {
            cfg.num_simple = m;
        }
        if let Some(l) = num_composite {
            cfg.num_composite = l;
        }
        if let Some(p) = promotion {
            cfg.promotion = match p.extract::<f64>() {
                Ok(x) => vec![x],
                Err(_) => p.extract::<Vec<f64>>().map_err(|_| {
                    PyValueError::new_err("promotion must be a float or a sequence of floats")
                })?,
            };
        }
        cfg.seed = seed;
        cfg.effort = effort;
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
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let (keys, _) = Keys::extract(keys, "keys", self.inner.dim())?;
        let ids = ids.map(extract_ids).transpose()?;
        let inner = &mut self.inner;
        let data = keys.data();
        let out = run(py, &self.pool, || inner.add(data, ids.as_deref()))?;
        Ok(out.into_pyarray(py))
    }

    /// Removes the points with these ids (all must exist; otherwise nothing changes).
    fn remove(&mut self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = extract_ids(ids)?;
        let inner = &mut self.inner;
        run(py, &self.pool, || inner.remove(&ids))
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
    ) -> PyResult<(Bound<'py, PyArray2<i64>>, Bound<'py, PyArray2<f32>>)> {
        let (queries, nq) = Keys::extract(queries, "queries", self.inner.dim())?;
        if k < 1 {
            return Err(PyValueError::new_err(format!("k must be at least 1, got {k}")));
        }
        let inner = &self.inner;
        let data = queries.data();
        let (ids, scores) = run(py, &self.pool, || inner.query(data, k as usize, effort, exact))?;
        let k = k as usize;
        let ids = Array2::from_shape_vec((nq, k), ids).expect("shape");
        let scores = Array2::from_shape_vec((nq, k), scores).expect("shape");
        Ok((ids.into_pyarray(py), scores.into_pyarray(py)))
    }

    /// Writes the index to ``path`` (versioned header + checksum; atomic rename).
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let inner = &self.inner;
        run(py, &None, || inner.save(&path))
    }

    /// Reads an index written by ``save``.
    #[staticmethod]
    #[pyo3(signature = (path, threads = None))]
    fn load(py: Python<'_>, path: PathBuf, threads: Option<usize>) -> PyResult<Self> {
        let pool = make_pool(threads)?;
        let inner = run(py, &None, || DciIndex::load(&path))?;
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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("IndexFileError", m.py().get_type::<IndexFileError>())?;
    m.add_class::<PyDciIndex>()?;
    Ok(())
}
