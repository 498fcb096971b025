//! `LookAhead` and `LookAheadLayer`: the look-ahead worker (`crate::lookahead`) for the
//! runtime.
//!
//! A `LookAheadLayer` holds, for one IceCache layer, every host buffer its jobs use (page
//! stores, histories, the pinned queries, flag, flushed tokens and staging), lent once as NumPy
//! views of the runtime's torch buffers, so that starting a step's job costs a few integers.
//! Every job keeps references to the arrays it uses until it has finished, so their memory
//! outlives the job. The caller must leave a layer's buffers alone while its job runs: the
//! runtime waits for a layer's job before it uses that layer's host state again.

use std::sync::{Arc, Mutex, RwLock};

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::arrays::{matrix3, numpy_of};
use super::guard::{entry, sizes, to_py};
use super::head_forest::PyHeadForest;
use super::resident_pages::PyResidentPages;
use crate::lookahead::{
    Elem, Flush, FollowerLane, Geometry, HostBuf, Job, JobState, LeaderLane, LookAhead, Outcome, Ready, StagingLayout,
    StagingShape, Work,
};
use crate::pages::PageFormat;
use crate::select::SelectParams;

type Keep = Arc<Vec<Py<PyAny>>>;

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
            bytes: l.bytes,
        }
    }
}

/// One sequence's buffers.
#[derive(Clone)]
struct Lane {
    forest: Option<Arc<RwLock<crate::pages::HeadForest>>>,
    resident: Option<Arc<RwLock<crate::ResidentPages>>>,
    k_store: HostBuf,
    v_store: HostBuf,
    k_history: HostBuf,
    v_history: HostBuf,
    keep: Keep,
}

struct State {
    lanes: Vec<Option<Lane>>,
    current: Option<Arc<JobState>>,
    /// Jobs started so far, and the last two with their numbers: a following layer's `n`th job
    /// pairs with its leader's `n`th (with look-ahead the leader may have started its next one).
    started: u64,
    recent: std::collections::VecDeque<(u64, Arc<JobState>)>,
}

/// One IceCache layer's look-ahead jobs. See ``icecache/_core.pyi``.
#[pyclass(name = "LookAheadLayer", module = "icecache._core", frozen)]
pub struct PyLookAheadLayer {
    worker: Arc<LookAhead>,
    leader: Option<Py<PyLookAheadLayer>>,
    geometry: Geometry,
    batch: usize,
    select: SelectParams,
    /// Queued jobs select anew every `refresh` steps (and whenever tokens were flushed).
    refresh: u64,
    queries: HostBuf,
    flag: HostBuf,
    flush_k: HostBuf,
    flush_v: HostBuf,
    staging: HostBuf,
    /// The arrays above.
    keep: Keep,
    state: Mutex<State>,
}

impl PyLookAheadLayer {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing panics while holding it; a poisoned lock still guards consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sequence `b`'s first `m` flushed tokens, `[H_kv, m, d]` each.
    fn flush(&self, b: usize, m: usize) -> Option<Flush> {
        if m == 0 {
            return None;
        }
        let g = &self.geometry;
        let per_seq = g.heads * g.page_size * g.dim * g.elem.size();
        let take = |buf: &HostBuf| {
            // SAFETY: a sub-range of a lent buffer (bounds checked in `start`); the job that gets
            // it is the only user until it finishes.
            unsafe { buf.sub(b * per_seq, g.heads * m * g.dim * g.elem.size()) }
        };
        Some(Flush { keys: take(&self.flush_k), values: take(&self.flush_v), tokens: m })
    }
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
        scale: f32,
        effort: Option<f32>,
        #[pyo3(from_py_with = sizes::successors)] successors: usize,
        #[pyo3(from_py_with = sizes::refresh)] refresh: usize,
        leader: Option<Py<PyLookAheadLayer>>,
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
                return Err(PyValueError::new_err("page_size must be in 8..=64 and max_pages at least 1"));
            }
            // `effort=None`: each KV head searches at its own effort (`HeadForest.efforts`).
            if !(scale.is_finite() && scale > 0.0 && effort.is_none_or(|e| e.is_finite() && e > 0.0)) {
                return Err(PyValueError::new_err("scale and effort must be positive numbers"));
            }
            let geometry = Geometry { heads: kv_heads, query_heads, dim, page_size, elem, format };
            if let Some(l) = &leader {
                let l = l.get();
                if l.batch != batch
                    || (l.geometry.heads, l.geometry.page_size) != (kv_heads, page_size)
                    || l.leader.is_some()
                {
                    return Err(PyValueError::new_err(
                        "leader must be a leading layer of the same batch, heads and pages",
                    ));
                }
            }
            Ok(PyLookAheadLayer {
                worker: worker.inner.clone(),
                leader,
                geometry,
                batch,
                select: SelectParams { max_pages, scale, effort, exact: false, successors, group_view },
                refresh: refresh as u64,
                queries: qb,
                flag: fb,
                flush_k: kb,
                flush_v: vb,
                staging: sb,
                keep: Arc::new(vec![qk, fk, kk, vk, sk]),
                state: Mutex::new(State {
                    lanes: vec![None; batch],
                    current: None,
                    started: 0,
                    recent: Default::default(),
                }),
            })
        })
    }

    /// Lends sequence ``b``'s page stores (and index, or history for followers). See
    /// ``icecache/_core.pyi``.
    #[pyo3(signature = (b, k_store, v_store, *, forest = None, resident = None, k_history = None, v_history = None))]
    #[allow(clippy::too_many_arguments)]
    fn set_lane(
        &self,
        #[pyo3(from_py_with = sizes::b)] b: usize,
        k_store: &Bound<'_, PyAny>,
        v_store: &Bound<'_, PyAny>,
        forest: Option<PyRef<'_, PyHeadForest>>,
        resident: Option<PyRef<'_, PyResidentPages>>,
        k_history: Option<&Bound<'_, PyAny>>,
        v_history: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        entry(|| {
            let g = self.geometry;
            if b >= self.batch {
                return Err(PyValueError::new_err(format!("b = {b} outside the batch of {}", self.batch)));
            }
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
                PageFormat::Int8 => {
                    let pb = g.page_bytes();
                    let bytes = |a: &Bound<'_, PyAny>| -> PyResult<bool> {
                        let a = numpy_of(a)?;
                        Ok(a.dtype().is_equiv_to(&numpy::dtype::<u8>(a.py())))
                    };
                    if ks.len() != 3
                        || ks[0] != g.heads
                        || ks[2] != pb
                        || vs != ks
                        || !bytes(k_store)?
                        || !bytes(v_store)?
                    {
                        return Err(shape_err(
                            "k_store and v_store (8-bit pages)",
                            &format!("uint8 [{}, P, {pb}]", g.heads),
                            &ks,
                        ));
                    }
                }
            }
            let mut lane = Lane {
                forest: None,
                resident: None,
                k_store: kb,
                v_store: vb,
                k_history: HostBuf::EMPTY,
                v_history: HostBuf::EMPTY,
                keep: Arc::new(Vec::new()),
            };
            let mut keep = vec![kk, vk];
            if self.leader.is_none() {
                let Some(r) = resident else {
                    return Err(PyValueError::new_err("a leading layer's lane needs its resident pages"));
                };
                let ok =
                    forest.as_ref().is_none_or(|f| (f.num_heads, f.dim, f.page_size) == (g.heads, g.dim, g.page_size));
                if !ok || r.num_heads != g.heads {
                    return Err(PyValueError::new_err(
                        "the forest or resident pages do not match the layer's heads and pages",
                    ));
                }
                lane.forest = forest.map(|f| f.inner.arc());
                lane.resident = Some(r.inner.arc());
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
                lane.k_history = hkb;
                lane.v_history = hvb;
                keep.extend([hkk, hvk]);
            }
            lane.keep = Arc::new(keep);
            let mut st = self.state();
            if st.current.as_ref().is_some_and(|j| !j.is_done()) {
                return Err(PyRuntimeError::new_err(
                    "a job of this layer is running: wait for it before changing its buffers",
                ));
            }
            st.lanes[b] = Some(lane);
            Ok(())
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
        entry(|| {
            let g = self.geometry;
            if flushed.len() != self.batch || flushed.iter().any(|&m| m > g.page_size) {
                return Err(PyValueError::new_err(format!(
                    "flushed must give 0..={} tokens for each of {} sequences",
                    g.page_size, self.batch
                )));
            }
            let mut st = self.state();
            let number = st.started;
            let leader_job =
                match &self.leader {
                    None => None,
                    Some(l) => {
                        let ls = l.get().state();
                        let job = ls.recent.iter().find(|(n, _)| *n == number).map(|(_, j)| j.clone());
                        Some(job.ok_or_else(|| {
                            PyRuntimeError::new_err("the leading layer has not started this step's job")
                        })?)
                    }
                };
            if st.current.as_ref().is_some_and(|j| !j.is_done()) {
                return Err(PyRuntimeError::new_err("this layer's previous job has not finished: wait for it first"));
            }
            let lanes: Vec<Lane> = st
                .lanes
                .iter()
                .enumerate()
                .map(|(b, l)| {
                    l.clone().ok_or_else(|| PyValueError::new_err(format!("sequence {b} has no buffers (set_lane)")))
                })
                .collect::<PyResult<_>>()?;
            let keep: Vec<Keep> =
                std::iter::once(self.keep.clone()).chain(lanes.iter().map(|l| l.keep.clone())).collect();
            let work = match leader_job {
                None => Work::Leader {
                    lanes: lanes
                        .iter()
                        .enumerate()
                        .map(|(b, l)| -> PyResult<LeaderLane> {
                            Ok(LeaderLane {
                                forest: l.forest.clone(),
                                resident: l.resident.clone().ok_or_else(|| {
                                    PyRuntimeError::new_err("a leading layer's lane has no resident pages")
                                })?,
                                k_store: l.k_store,
                                v_store: l.v_store,
                                flush: self.flush(b, flushed[b]),
                            })
                        })
                        .collect::<PyResult<_>>()?,
                    queries: self.queries,
                    select: self.select,
                    // Run-now jobs always select: they serve the step they run in.
                    reselect: step.is_none() || number.is_multiple_of(self.refresh),
                },
                Some(leader) => {
                    let lens =
                        history_lens.ok_or_else(|| PyValueError::new_err("a following layer needs history_lens"))?;
                    if lens.len() != self.batch {
                        return Err(PyValueError::new_err("history_lens needs one entry per sequence"));
                    }
                    Work::Follower {
                        lanes: lanes
                            .iter()
                            .enumerate()
                            .map(|(b, l)| FollowerLane {
                                k_store: l.k_store,
                                v_store: l.v_store,
                                k_history: l.k_history,
                                v_history: l.v_history,
                                history_len: lens[b],
                                flush: self.flush(b, flushed[b]),
                            })
                            .collect(),
                        leader,
                    }
                }
            };
            let job = Job {
                geometry: g,
                ready: step.map(|s| Ready { flag: self.flag, step: s }),
                staging: self.staging,
                work,
                keep_alive: Box::new(keep),
            };
            let state = match step {
                None => {
                    let worker = self.worker.clone();
                    JobState::finished_with(py.allow_threads(move || worker.run(job)))
                }
                Some(_) => self.worker.submit(job).map_err(to_py)?,
            };
            st.current = Some(state.clone());
            st.recent.push_back((number, state));
            if st.recent.len() > 2 {
                st.recent.pop_front();
            }
            st.started += 1;
            Ok(())
        })
    }

    /// Whether this layer's current job has finished (``True`` when there is none).
    fn done(&self) -> PyResult<bool> {
        entry(|| Ok(self.state().current.as_ref().is_none_or(|j| j.is_done())))
    }

    /// Waits (without the GIL) for this layer's current job; its outcome. See ``icecache/_core.pyi``.
    fn wait(&self, py: Python<'_>) -> PyResult<PyOutcome> {
        entry(|| {
            let job = self.state().current.clone().ok_or_else(|| PyRuntimeError::new_err("no job was started"))?;
            let out = py.allow_threads(move || job.wait()).map_err(to_py)?;
            Ok(PyOutcome::from(&*out))
        })
    }

    /// ``[B, kv_heads, max_pages]`` int32: the pages the current job selected (waits for it).
    fn selected<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, numpy::PyArray3<i32>>> {
        entry(|| {
            let job = self.state().current.clone().ok_or_else(|| PyRuntimeError::new_err("no job was started"))?;
            let out = py.allow_threads(move || job.wait()).map_err(to_py)?;
            matrix3(py, (self.batch, self.geometry.heads, out.width), out.selected_pages())
        })
    }

    /// Forgets the current job (after it finished or was cancelled) and every lane.
    fn clear(&self) -> PyResult<()> {
        entry(|| {
            let mut st = self.state();
            st.current = None;
            st.recent.clear();
            st.started = 0;
            st.lanes.iter_mut().for_each(|l| *l = None);
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
            let page_bytes = format.page_bytes(page_size, dim, itemsize);
            let shape = StagingShape { batch, heads: kv_heads, width: max_pages, capacity, page_size, page_bytes };
            Ok(PyStagingLayout::from(StagingLayout::new(&shape)))
        })
    }
}
