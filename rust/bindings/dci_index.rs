//! `DCIIndex`: the M-DCI index on its own, as an approximate nearest-neighbour index.

use std::path::PathBuf;

use numpy::IntoPyArray;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::arrays::{extract_ids, matrix, Keys, NdArray1, NdArray2};
use super::guard::{entry, run, sizes, to_py, Shared};
use super::pools::{on_pool, Workers};
use crate::index::{Calibration, Config, DciIndex, Metric, DEFAULT_MAX_EFFORT, DEFAULT_MIN_EFFORT};

/// Approximate nearest-neighbour index over a multi-level Dynamic Continuous Indexing tree.
/// See ``icecache/_core.pyi`` for the full documentation.
#[pyclass(name = "DCIIndex", module = "icecache._core", frozen)]
pub struct PyDciIndex {
    inner: Shared<DciIndex>,
    workers: Workers,
    dim: usize,
    metric: Metric,
}

/// The index parameters both Python types take, applied to `cfg` and validated by the core.
pub(super) fn apply_config(
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

// `calibrate`'s text signature spells the default out.
const _: () = assert!(DEFAULT_MIN_EFFORT == 0.0625 && DEFAULT_MAX_EFFORT == 64.0);

/// What `DCIIndex.calibrate` found. See ``icecache/_core.pyi``.
#[pyclass(name = "Calibration", module = "icecache._core", frozen, get_all)]
pub struct PyCalibration {
    effort: f32,
    recall: f64,
    recall_stderr: f64,
    reached: bool,
    target_recall: f64,
    k: usize,
    queries: usize,
    evaluations: usize,
    seconds: f64,
}

impl From<Calibration> for PyCalibration {
    fn from(c: Calibration) -> PyCalibration {
        PyCalibration {
            effort: c.effort,
            recall: c.recall,
            recall_stderr: c.recall_stderr,
            reached: c.reached,
            target_recall: c.target,
            k: c.k,
            queries: c.queries,
            evaluations: c.evaluations,
            seconds: c.seconds,
        }
    }
}

#[pymethods]
impl PyCalibration {
    fn __repr__(&self) -> String {
        format!(
            "Calibration(effort={:.4}, recall={:.4}, recall_stderr={:.4}, reached={}, target_recall={}, k={}, \
             queries={}, evaluations={}, seconds={:.3})",
            self.effort,
            self.recall,
            self.recall_stderr,
            if self.reached { "True" } else { "False" },
            self.target_recall,
            self.k,
            self.queries,
            self.evaluations,
            self.seconds
        )
    }
}

impl PyDciIndex {
    fn wrap(inner: DciIndex, workers: Workers) -> PyDciIndex {
        let (dim, metric) = (inner.dim(), inner.metric());
        PyDciIndex { inner: Shared::new(inner, "DCIIndex"), workers, dim, metric }
    }

    fn pool(&self) -> Workers {
        self.workers
    }
}

#[pymethods]
impl PyDciIndex {
    #[new]
    #[pyo3(
        signature = (dim, metric = "ip", *, num_simple = None, num_composite = None, promotion = None, seed = None, threads = None, effort = Some(1.0)),
        text_signature = "(dim, metric='ip', *, num_simple=None, num_composite=None, promotion=None, seed=None, threads=None, effort=1.0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        #[pyo3(from_py_with = sizes::dim)] dim: usize,
        metric: &str,
        #[pyo3(from_py_with = sizes::num_simple)] num_simple: Option<usize>,
        #[pyo3(from_py_with = sizes::num_composite)] num_composite: Option<usize>,
        promotion: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = sizes::seed)] seed: Option<u64>,
        #[pyo3(from_py_with = sizes::threads)] threads: Option<usize>,
        #[pyo3(from_py_with = sizes::effort_or_auto)] effort: Option<f32>,
    ) -> PyResult<Self> {
        entry(|| {
            let (effort, auto) = match effort {
                Some(e) => (e, false),
                None => (1.0, true),
            };
            let mut cfg = Config::new(dim, Metric::parse(metric).map_err(to_py)?);
            apply_config(&mut cfg, num_simple, num_composite, promotion, seed, effort)?;
            let mut inner = DciIndex::new(cfg).map_err(to_py)?;
            if auto {
                inner.set_auto_effort();
            }
            Ok(PyDciIndex::wrap(inner, Workers::new(threads)?))
        })
    }

    /// Key dimension.
    #[getter]
    fn dim(&self) -> usize {
        self.dim
    }

    /// ``"ip"`` or ``"l2"``.
    #[getter]
    fn metric(&self) -> &'static str {
        self.metric.name()
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        entry(|| self.inner.view(py, |idx| Ok(idx.len())))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let len = self.__len__(py)?;
        Ok(format!("DCIIndex(dim={}, metric={:?}, len={len})", self.dim, self.metric.name()))
    }

    /// Adds ``keys`` ``[n, dim]`` under ``ids`` (fresh ids when None); returns the ids.
    #[pyo3(signature = (keys, ids = None))]
    fn add<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<NdArray1<'py, i64>> {
        entry(|| {
            let (keys, n) = Keys::extract(keys, "keys", self.dim)?;
            let ids = ids.map(extract_ids).transpose()?;
            let data = keys.data()?;
            let pool = self.pool();
            let out = self.inner.update(py, |idx| {
                // Only a bulk build (into an empty index) runs in parallel.
                let parallel = idx.is_empty() && n > 1;
                on_pool(pool, parallel, || idx.add(data, ids.as_deref()))
            })?;
            Ok(out.into_pyarray(py))
        })
    }

    /// Removes the points with these ids (all must exist; otherwise nothing changes).
    fn remove(&self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        entry(|| {
            let ids = extract_ids(ids)?;
            self.inner.update(py, |idx| idx.remove(&ids))
        })
    }

    /// Top-``k`` neighbours of each query row: ``(ids [nq, k] int64, scores [nq, k] float32)``.
    #[pyo3(signature = (queries, k, *, effort = None, exact = false))]
    fn query<'py>(
        &self,
        py: Python<'py>,
        queries: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = sizes::k)] k: usize,
        #[pyo3(from_py_with = sizes::optional_effort)] effort: Option<f32>,
        exact: bool,
    ) -> PyResult<(NdArray2<'py, i64>, NdArray2<'py, f32>)> {
        entry(|| {
            let (queries, nq) = Keys::extract(queries, "queries", self.dim)?;
            let data = queries.data()?;
            let pool = self.pool();
            let auto = effort.is_none() && !exact && self.inner.view(py, |idx| Ok(idx.awaits_calibration()))?;
            let (ids, scores) = if auto {
                // `effort="auto"`: this query calibrates first (`query_auto` checks again under
                // the write lock: another thread may have calibrated meanwhile).
                self.inner.update(py, |idx| on_pool(pool, true, || idx.query_auto(data, k)))?
            } else {
                self.inner.view(py, |idx| on_pool(pool, nq > 1, || idx.query(data, k, effort, exact)))?
            };
            Ok((matrix(py, (nq, k), ids)?, matrix(py, (nq, k), scores)?))
        })
    }

    /// Sets the default effort to the smallest that reaches ``target_recall`` on ``queries``.
    #[pyo3(
        signature = (queries, k, target_recall = 0.95, *, min_effort = DEFAULT_MIN_EFFORT, max_effort = DEFAULT_MAX_EFFORT),
        text_signature = "(self, queries, k, target_recall=0.95, *, min_effort=0.0625, max_effort=64.0)"
    )]
    fn calibrate(
        &self,
        py: Python<'_>,
        queries: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = sizes::k)] k: usize,
        #[pyo3(from_py_with = sizes::target_recall)] target_recall: f64,
        #[pyo3(from_py_with = sizes::min_effort)] min_effort: f32,
        #[pyo3(from_py_with = sizes::max_effort)] max_effort: f32,
    ) -> PyResult<PyCalibration> {
        entry(|| {
            let (queries, _) = Keys::extract(queries, "queries", self.dim)?;
            let data = queries.data()?;
            let pool = self.pool();
            let found = self.inner.update(py, |idx| {
                on_pool(pool, true, || idx.calibrate(data, k, target_recall, min_effort..=max_effort))
            })?;
            Ok(found.into())
        })
    }

    /// The last calibration (``calibrate`` or ``effort="auto"``), or None.
    #[getter]
    fn calibration(&self, py: Python<'_>) -> PyResult<Option<PyCalibration>> {
        entry(|| self.inner.view(py, |idx| Ok(idx.calibration().cloned().map(PyCalibration::from))))
    }

    /// Whether ``effort="auto"`` still waits for its first query to calibrate.
    #[getter]
    fn awaits_calibration(&self, py: Python<'_>) -> PyResult<bool> {
        entry(|| self.inner.view(py, |idx| Ok(idx.awaits_calibration())))
    }

    /// Writes the index to ``path`` (versioned header + checksum; atomic rename).
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        entry(|| self.inner.view(py, |idx| idx.save(&path)))
    }

    /// Reads an index written by ``save``.
    #[staticmethod]
    #[pyo3(signature = (path, threads = None))]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        #[pyo3(from_py_with = sizes::threads)] threads: Option<usize>,
    ) -> PyResult<Self> {
        entry(|| {
            let workers = Workers::new(threads)?;
            let inner = run(py, || DciIndex::load(&path))?;
            Ok(PyDciIndex::wrap(inner, workers))
        })
    }

    /// Shape of the tree: ``len``, ``levels`` (points per level), ``cells_per_tier``,
    /// ``mean_leaf_cell``, ``max_leaf_cell``, ``c``, ``bytes``, and the configuration.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        entry(|| {
            let (s, cfg) = self.inner.view(py, |idx| Ok((idx.stats(), idx.config().clone())))?;
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
            d.set_item("promotion", cfg.promotion)?;
            d.set_item("effort", cfg.effort)?;
            Ok(d)
        })
    }
}
