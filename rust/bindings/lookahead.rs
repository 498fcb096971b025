//! `LookAhead` and `LookAheadLayer`: the look-ahead worker (`crate::lookahead`) for the
//! runtime.
//!
//! A `LookAheadLayer` is a `crate::lookahead::LayerJobs`: this file checks the NumPy views of
//! the runtime's torch buffers it is lent (page stores, histories, the pinned queries, flag,
//! flushed tokens and staging) and hands them over with references that keep the arrays alive
//! while a job uses them. The caller must leave a layer's buffers alone while its job runs:
//! the runtime waits for a layer's job before it uses that layer's host state again.

use std::sync::Arc;

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::arrays::{matrix3, numpy_of};
use super::guard::{entry, run, sizes, to_py};
use super::head_forest::PyHeadForest;
use super::resident_pages::PyResidentPages;
use crate::lookahead::{
    Elem, Geometry, HostBuf, KeepAlive, Lane, LaneSource, LayerBuffers, LayerJobs, LookAhead, Outcome, StagingLayout,
    StagingShape,
};
use crate::pages::PageFormat;
use crate::select::SelectParams;

/// A C-contiguous, writable array lent to jobs: its memory, shape and element type (`None`:
/// not a K/V element type), and a reference that keeps it alive.
struct Lent {
    buf: HostBuf,
    shape: Vec<usize>,
    elem: Option<Elem>,
    keep: Py<PyAny>,
}

fn lend(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Lent> {
    let a = numpy_of(obj)?;
    if !a.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{what} must be C-contiguous")));
    }
    let writable: bool = a.getattr("flags")?.getattr("writeable")?.extract()?;
    if !writable {
        return Err(PyValueError::new_err(format!("{what} must be writable")));
    }
    let nbytes: usize = a.getattr("nbytes")?.extract()?;
    let ptr = a.getattr("ctypes")?.getattr("data")?.extract::<usize>()? as *mut u8;
    // SAFETY: the returned reference keeps `a` alive and jobs hold it while they run; `a` is
    // C-contiguous with `nbytes` bytes at `ptr`; the module docs state the caller's part.
    let buf = unsafe { HostBuf::new(ptr, nbytes) };
    Ok(Lent { buf, shape: a.shape().to_vec(), elem: elem_of(&a), keep: a.into_any().unbind() })
}

fn elem_of(a: &Bound<'_, PyUntypedArray>) -> Option<Elem> {
    let (dt, py) = (a.dtype(), a.py());
    if dt.is_equiv_to(&numpy::dtype::<f32>(py)) {
        Some(Elem::F32)
    } else if dt.is_equiv_to(&numpy::dtype::<half::f16>(py)) {
        Some(Elem::F16)
    } else if dt.is_equiv_to(&numpy::dtype::<u16>(py)) {
        Some(Elem::Bf16)
    } else {
        None
    }
}

fn shape_err(what: &str, want: &str, got: &[usize]) -> PyErr {
    PyValueError::new_err(format!("{what} must be {want}, got shape {got:?}"))
}

/// The look-ahead worker: one dispatcher thread and a pool. See ``icecache/_core.pyi``.
#[pyclass(name = "LookAhead", module = "icecache._core", frozen)]
pub struct PyLookAhead {
    inner: Arc<LookAhead>,
}

#[pymethods]
impl PyLookAhead {
    #[new]
    #[pyo3(signature = (threads = None))]
    fn new(#[pyo3(from_py_with = sizes::threads)] threads: Option<usize>) -> PyResult<Self> {
        entry(|| Ok(PyLookAhead { inner: Arc::new(LookAhead::new(threads).map_err(to_py)?) }))
    }

    /// Makes every queued job that has not started yet finish as cancelled.
    fn cancel(&self) -> PyResult<()> {
        entry(|| {
            self.inner.cancel();
            Ok(())
        })
    }
}

/// What a finished job did and where it left its results. See ``icecache/_core.pyi``.
#[pyclass(name = "LookAheadOutcome", module = "icecache._core", frozen, get_all)]
pub struct PyOutcome {
    loads: usize,
    clears: usize,
    width: usize,
    end: usize,
    selected: usize,
    wait_s: f64,
    insert_s: f64,
    select_s: f64,
    gather_s: f64,
}

impl From<&Outcome> for PyOutcome {
    fn from(o: &Outcome) -> PyOutcome {
        PyOutcome {
            loads: o.loads,
            clears: o.clears,
            width: o.width,
            end: o.end,
            selected: o.selected,
            wait_s: o.wait_s,
            insert_s: o.insert_s,
            select_s: o.select_s,
            gather_s: o.gather_s,
        }
    }
}

#[pymethods]
impl PyOutcome {
    fn __repr__(&self) -> String {
        format!(
            "LookAheadOutcome(loads={}, clears={}, width={}, selected={}, end={})",
            self.loads, self.clears, self.width, self.selected, self.end
        )
    }
}

/// Byte offsets and sizes of a layer's staging buffer. See ``icecache/_core.pyi``.
#[pyclass(name = "StagingLayout", module = "icecache._core", frozen, get_all)]
pub struct PyStagingLayout {
    max_loads: usize,
    max_masks: usize,
    table_entries: usize,
    trash: usize,
    load_idx_at: usize,
    mask_idx_at: usize,
    table_at: usize,
    table_len_at: usize,
    mask_at: usize,
    rows_at: usize,
    k_page_bytes: usize,
    v_page_bytes: usize,
    bytes: usize,
}

impl From<StagingLayout> for PyStagingLayout {
    fn from(l: StagingLayout) -> PyStagingLayout {
        PyStagingLayout {
            max_loads: l.max_loads,
            max_masks: l.max_masks,
            table_entries: l.table_entries,
            trash: l.trash,
            load_idx_at: l.load_idx_at,
            mask_idx_at: l.mask_idx_at,
            table_at: l.table_at,
            table_len_at: l.table_len_at,
            mask_at: l.mask_at,
            rows_at: l.rows_at,
            k_page_bytes: l.k_page_bytes,
            v_page_bytes: l.v_page_bytes,
            bytes: l.bytes,
        }
    }
}

/// One IceCache layer's look-ahead jobs (`crate::lookahead::LayerJobs`). See
/// ``icecache/_core.pyi``.
#[pyclass(name = "LookAheadLayer", module = "icecache._core", frozen)]
pub struct PyLookAheadLayer {
    inner: Arc<LayerJobs>,
}

/// The references that keep arrays lent to jobs alive.
fn keep_alive(arrays: Vec<Py<PyAny>>) -> KeepAlive {
    Arc::new(arrays)
}

#[pymethods]
impl PyLookAheadLayer {
    /// See ``icecache/_core.pyi``.
    #[new]
    #[pyo3(signature = (worker, queries, flag, flush_k, flush_v, staging, *, kv_heads, page_size, max_pages, scale, effort = None, successors = 0, refresh = 1, leader = None, page_format = "native", group_view = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        worker: PyRef<'_, PyLookAhead>,
        queries: &Bound<'_, PyAny>,
        flag: &Bound<'_, PyAny>,
        flush_k: &Bound<'_, PyAny>,
        flush_v: &Bound<'_, PyAny>,
        staging: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = sizes::kv_heads)] kv_heads: usize,
        #[pyo3(from_py_with = sizes::page_size)] page_size: usize,
        #[pyo3(from_py_with = sizes::max_pages)] max_pages: usize,
        #[pyo3(from_py_with = sizes::scale)] scale: f32,
        #[pyo3(from_py_with = sizes::optional_effort)] effort: Option<f32>,
        #[pyo3(from_py_with = sizes::successors)] successors: usize,
        #[pyo3(from_py_with = sizes::refresh)] refresh: usize,
        leader: Option<PyRef<'_, PyLookAheadLayer>>,
        page_format: &str,
        group_view: bool,
    ) -> PyResult<Self> {
        entry(|| {
            let format = PageFormat::parse(page_format).map_err(to_py)?;
            let Lent { buf: qb, shape: qs, elem: qe, keep: qk } = lend(queries, "queries")?;
            if qe != Some(Elem::F32) || qs.len() != 3 || qs[0] == 0 || kv_heads == 0 || qs[1] % kv_heads != 0 {
                return Err(shape_err("queries", "float32 [B, H_q, d] with H_q a multiple of kv_heads", &qs));
            }
            let (batch, query_heads, dim) = (qs[0], qs[1], qs[2]);
            let Lent { buf: fb, shape: fs, keep: fk, .. } = lend(flag, "flag")?;
            if fs != [1] || fb.len() != 8 {
                return Err(shape_err("flag", "int64 [1]", &fs));
            }
            let Lent { buf: kb, shape: ks, elem: ke, keep: kk } = lend(flush_k, "flush_k")?;
            let Lent { buf: vb, shape: vs, elem: ve, keep: vk } = lend(flush_v, "flush_v")?;
            let elem = ke.ok_or_else(|| PyValueError::new_err("flush_k must be float32, float16 or bf16 (uint16)"))?;
            let want = [batch, kv_heads, page_size, dim];
            if ks != want || vs != want || ve != ke {
                return Err(shape_err("flush_k and flush_v", &format!("{want:?} of one dtype"), &ks));
            }
            let Lent { buf: sb, keep: sk, .. } = lend(staging, "staging")?;
            if !crate::pages::PAGE_SIZES.contains(&page_size) || max_pages == 0 {
                return Err(PyValueError::new_err(format!(
                    "page_size must be in {:?} and max_pages at least 1",
                    crate::pages::PAGE_SIZES
                )));
            }
            // `effort=None`: each KV head searches at its own effort (`HeadForest.efforts`).
            if !(scale.is_finite() && scale > 0.0 && effort.is_none_or(|e| e.is_finite() && e > 0.0)) {
                return Err(PyValueError::new_err("scale and effort must be positive numbers"));
            }
            let geometry = Geometry { heads: kv_heads, query_heads, dim, page_size, elem, format };
            let select = SelectParams { max_pages, scale, effort, exact: false, successors, group_view };
            let buffers = LayerBuffers {
                queries: qb,
                flag: fb,
                flush_k: kb,
                flush_v: vb,
                staging: sb,
                keep_alive: keep_alive(vec![qk, fk, kk, vk, sk]),
            };
            let leader = leader.map(|l| l.inner.clone());
            let inner = LayerJobs::new(worker.inner.clone(), geometry, batch, select, refresh, buffers, leader);
            Ok(PyLookAheadLayer { inner: Arc::new(inner.map_err(to_py)?) })
        })
    }

    /// Lends sequence ``b``'s page stores (and index, or history for followers). See
    /// ``icecache/_core.pyi``.
    #[pyo3(signature = (b, k_store, v_store, *, forest = None, resident = None, k_history = None, v_history = None))]
    #[allow(clippy::too_many_arguments)]
    fn set_lane(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = sizes::b)] b: usize,
        k_store: &Bound<'_, PyAny>,
        v_store: &Bound<'_, PyAny>,
        forest: Option<PyRef<'_, PyHeadForest>>,
        resident: Option<PyRef<'_, PyResidentPages>>,
        k_history: Option<&Bound<'_, PyAny>>,
        v_history: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        entry(|| {
            let g = *self.inner.geometry();
            let Lent { buf: kb, shape: ks, elem: ke, keep: kk } = lend(k_store, "k_store")?;
            let Lent { buf: vb, shape: vs, elem: ve, keep: vk } = lend(v_store, "v_store")?;
            match g.format {
                PageFormat::Native => {
                    if ks.len() != 4 || ks[0] != g.heads || ks[2] != g.page_size || ks[3] != g.dim || vs != ks {
                        return Err(shape_err(
                            "k_store and v_store",
                            &format!("[{}, P, {}, {}]", g.heads, g.page_size, g.dim),
                            &ks,
                        ));
                    }
                    if ke != Some(g.elem) || ve != Some(g.elem) {
                        return Err(PyValueError::new_err("the stores must have the flushed tokens' dtype"));
                    }
                }
                PageFormat::Int8 | PageFormat::K8V4 => {
                    let (kb, vb) = (g.k_page_bytes(), g.v_page_bytes());
                    let bytes = |a: &Bound<'_, PyAny>| -> PyResult<bool> {
                        let a = numpy_of(a)?;
                        Ok(a.dtype().is_equiv_to(&numpy::dtype::<u8>(a.py())))
                    };
                    if ks.len() != 3
                        || ks[0] != g.heads
                        || ks[2] != kb
                        || vs != [g.heads, ks[1], vb]
                        || !bytes(k_store)?
                        || !bytes(v_store)?
                    {
                        return Err(shape_err(
                            "k_store and v_store (quantised pages)",
                            &format!("uint8 [{}, P, {kb}] and [{}, P, {vb}]", g.heads, g.heads),
                            &ks,
                        ));
                    }
                }
            }
            let mut keep = vec![kk, vk];
            let source = if self.inner.leads() {
                let Some(r) = resident else {
                    return Err(PyValueError::new_err("a leading layer's lane needs its resident pages"));
                };
                LaneSource::Index { forest: forest.map(|f| f.inner.arc()), resident: r.inner.arc() }
            } else {
                let (Some(hk), Some(hv)) = (k_history, v_history) else {
                    return Err(PyValueError::new_err("a following layer's lane needs its histories"));
                };
                let Lent { buf: hkb, shape: hks, elem: hke, keep: hkk } = lend(hk, "k_history")?;
                let Lent { buf: hvb, shape: hvs, elem: hve, keep: hvk } = lend(hv, "v_history")?;
                if hks.len() != 3
                    || hks[0] != g.heads
                    || hks[2] != g.dim
                    || hvs != hks
                    || hke != Some(g.elem)
                    || hve != hke
                {
                    return Err(shape_err(
                        "k_history and v_history",
                        &format!("[{}, n, {}] in the stores' dtype", g.heads, g.dim),
                        &hks,
                    ));
                }
                keep.extend([hkk, hvk]);
                LaneSource::History { k_history: hkb, v_history: hvb }
            };
            let lane = Lane { k_store: kb, v_store: vb, source, keep_alive: keep_alive(keep) };
            // Without the GIL: the core reads the forest's shape behind its lock.
            run(py, || self.inner.set_lane(b, lane))
        })
    }

    /// Starts this layer's job for one step. See ``icecache/_core.pyi``.
    #[pyo3(signature = (flushed, *, step = None, history_lens = None))]
    fn start(
        &self,
        py: Python<'_>,
        flushed: Vec<usize>,
        step: Option<i64>,
        history_lens: Option<Vec<usize>>,
    ) -> PyResult<()> {
        entry(|| run(py, || self.inner.start(&flushed, step, history_lens.as_deref())))
    }

    /// Starts one step's jobs of several layers, in order, with the GIL released once. See
    /// ``icecache/_core.pyi``.
    #[staticmethod]
    #[pyo3(signature = (layers, flushed, *, steps, history_lens))]
    fn start_all(
        py: Python<'_>,
        layers: Vec<PyRef<'_, PyLookAheadLayer>>,
        flushed: Vec<Vec<usize>>,
        steps: Vec<i64>,
        history_lens: Vec<Option<Vec<usize>>>,
    ) -> PyResult<()> {
        entry(|| {
            let n = layers.len();
            if flushed.len() != n || steps.len() != n || history_lens.len() != n {
                return Err(PyValueError::new_err(format!(
                    "flushed, steps and history_lens need one entry per layer ({n}), got {}, {} and {}",
                    flushed.len(),
                    steps.len(),
                    history_lens.len()
                )));
            }
            let jobs: Vec<Arc<LayerJobs>> = layers.iter().map(|l| l.inner.clone()).collect();
            run(py, || {
                for (j, (f, h)) in jobs.iter().zip(flushed.iter().zip(&history_lens)) {
                    j.check_start(f, h.as_deref())?;
                }
                for (j, ((f, s), h)) in jobs.iter().zip(flushed.iter().zip(&steps).zip(&history_lens)) {
                    j.start(f, Some(*s), h.as_deref())?;
                }
                Ok(())
            })
        })
    }

    /// Waits (without the GIL, released once) for the current jobs of several layers; their
    /// outcomes. See ``icecache/_core.pyi``.
    #[staticmethod]
    fn wait_all(py: Python<'_>, layers: Vec<PyRef<'_, PyLookAheadLayer>>) -> PyResult<Vec<PyOutcome>> {
        entry(|| {
            let jobs = layers
                .iter()
                .map(|l| l.inner.current().ok_or_else(|| PyRuntimeError::new_err("no job was started")))
                .collect::<PyResult<Vec<_>>>()?;
            let outs = py.allow_threads(move || jobs.iter().map(|j| j.wait()).collect::<crate::Result<Vec<_>>>());
            Ok(outs.map_err(to_py)?.iter().map(|o| PyOutcome::from(&**o)).collect())
        })
    }

    /// Whether this layer's current job has finished (``True`` when there is none).
    fn done(&self) -> PyResult<bool> {
        entry(|| Ok(self.inner.done()))
    }

    /// Waits (without the GIL) for this layer's current job; its outcome. See ``icecache/_core.pyi``.
    fn wait(&self, py: Python<'_>) -> PyResult<PyOutcome> {
        entry(|| {
            let job = self.inner.current().ok_or_else(|| PyRuntimeError::new_err("no job was started"))?;
            let out = py.allow_threads(move || job.wait()).map_err(to_py)?;
            Ok(PyOutcome::from(&*out))
        })
    }

    /// ``[B, kv_heads, max_pages]`` int32: the pages the current job selected (waits for it).
    fn selected<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, numpy::PyArray3<i32>>> {
        entry(|| {
            let job = self.inner.current().ok_or_else(|| PyRuntimeError::new_err("no job was started"))?;
            let out = py.allow_threads(move || job.wait()).map_err(to_py)?;
            matrix3(py, (self.inner.batch(), self.inner.geometry().heads, out.width), out.selected_pages())
        })
    }

    /// Forgets the current job (after it finished or was cancelled) and every lane.
    fn clear(&self) -> PyResult<()> {
        entry(|| {
            self.inner.clear();
            Ok(())
        })
    }

    /// The fixed layout of a layer's staging buffer. See ``icecache/_core.pyi``.
    #[staticmethod]
    #[pyo3(signature = (*, batch, kv_heads, dim, page_size, itemsize, max_pages, capacity, page_format = "native"))]
    #[allow(clippy::too_many_arguments)]
    fn staging_layout(
        #[pyo3(from_py_with = sizes::batch)] batch: usize,
        #[pyo3(from_py_with = sizes::kv_heads)] kv_heads: usize,
        #[pyo3(from_py_with = sizes::dim)] dim: usize,
        #[pyo3(from_py_with = sizes::page_size)] page_size: usize,
        #[pyo3(from_py_with = sizes::itemsize)] itemsize: usize,
        #[pyo3(from_py_with = sizes::max_pages)] max_pages: usize,
        #[pyo3(from_py_with = sizes::capacity)] capacity: usize,
        page_format: &str,
    ) -> PyResult<PyStagingLayout> {
        entry(|| {
            let format = PageFormat::parse(page_format).map_err(to_py)?;
            if itemsize != 2 && itemsize != 4 {
                return Err(PyValueError::new_err(format!("itemsize must be 2 or 4, got {itemsize}")));
            }
            let shape = StagingShape {
                batch,
                heads: kv_heads,
                width: max_pages,
                capacity,
                page_size,
                k_page_bytes: format.k_page_bytes(page_size, dim, itemsize),
                v_page_bytes: format.v_page_bytes(page_size, dim, itemsize),
            };
            Ok(PyStagingLayout::from(StagingLayout::new(&shape)))
        })
    }
}
