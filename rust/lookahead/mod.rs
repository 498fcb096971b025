//! The look-ahead worker: a layer's decode-time host work, off the device's critical path.
//!
//! One job does, for one IceCache layer and every sequence of the batch, what the layer's next
//! decode step needs from the host: insert the tokens its window flushed (the index and the
//! page stores), select pages for its queries (a superset of the budget, ranked on the device
//! later), plan their device slots, and gather the missing pages with the step's metadata into
//! one staging buffer for a single host-to-device copy. A job waits for its queries to land in
//! host memory: the device copies them there behind the layer's attention and then copies a
//! step number into a flag; the worker polls the flag. So neither the Python thread nor the
//! device ever waits for the host in the steady state, and the worker never needs the GIL.
//!
//! Jobs are dispatched in submission order by one native thread and run on a rayon pool, so
//! the jobs of several layers overlap. Layers that reuse a leader's page layout submit
//! follower jobs: they wait for the leader's job of the same step and load the same pages
//! from their own stores.
//!
//! The buffers a job reads and writes belong to the caller (Python); [`HostBuf`] lends them.
//! The caller must keep them alive and leave them alone until the job is finished (the runtime
//! waits for a layer's job before it touches that layer's host state again).
//!
//! The stages, one module each: [`hostbuf`] (the lent memory), [`lanes`] (one sequence's
//! insert, selection and plan, or a follower's rewrite), [`staging`] (the staging buffer's
//! layout and its gather), [`layer`] (one layer's jobs step after step: its lanes, the pairing
//! with a leader's jobs, when to select anew); this module dispatches and runs jobs.

mod hostbuf;
mod lanes;
mod layer;
mod staging;

pub use hostbuf::HostBuf;
use lanes::{follow_lane, leader_lane, LeaderWork};
pub use layer::{KeepAlive, Lane, LaneSource, LayerBuffers, LayerJobs};
pub use staging::{StagingLayout, StagingShape, ROW_ALIGN};

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::error::{ensure, Error, Result};
use crate::load::{LoadPlan, ResidentPages};
use crate::pages::{HeadForest, PageFormat};
use crate::select::SelectParams;

/// Element type of the K/V page stores (bf16 is carried as its `u16` bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
    Bf16,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16 => 2,
        }
    }
}

/// Shapes shared by the lanes of one job.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    /// KV heads.
    pub heads: usize,
    /// Query heads (a multiple of `heads`).
    pub query_heads: usize,
    pub dim: usize,
    pub page_size: usize,
    /// Element type of the tokens (flushed, histories; and the stores' in `PageFormat::Native`).
    pub elem: Elem,
    pub format: PageFormat,
}

impl Geometry {
    /// Bytes of one K page in the stores and in staging.
    pub fn k_page_bytes(&self) -> usize {
        self.format.k_page_bytes(self.page_size, self.dim, self.elem.size())
    }

    /// Bytes of one V page in the stores and in staging.
    pub fn v_page_bytes(&self) -> usize {
        self.format.v_page_bytes(self.page_size, self.dim, self.elem.size())
    }

    /// The staging layout of a job of `batch` sequences, `width` pages per (sequence, KV
    /// head) and `capacity` device slots for each.
    pub fn staging_layout(&self, batch: usize, width: usize, capacity: usize) -> StagingLayout {
        StagingLayout::new(&StagingShape {
            batch,
            heads: self.heads,
            width,
            capacity,
            page_size: self.page_size,
            k_page_bytes: self.k_page_bytes(),
            v_page_bytes: self.v_page_bytes(),
        })
    }
}

/// Tokens one sequence's window flushed this step: `[H_kv, m, d]` keys and values.
#[derive(Clone, Copy, Debug)]
pub struct Flush {
    pub keys: HostBuf,
    pub values: HostBuf,
    pub tokens: usize,
}

/// One sequence of a layer that owns its index (a reuse group's leader).
pub struct LeaderLane {
    /// `None` while the sequence has offloaded nothing (a prompt within sink and window):
    /// nothing to select, and nothing may be flushed into it.
    pub forest: Option<Arc<RwLock<HeadForest>>>,
    pub resident: Arc<RwLock<ResidentPages>>,
    /// Page stores, `[H_kv, P]` pages of `Geometry::k_page_bytes` (K) and `v_page_bytes` (V).
    pub k_store: HostBuf,
    pub v_store: HostBuf,
    pub flush: Option<Flush>,
}

/// One sequence of a layer that reuses its leader's page layout.
pub struct FollowerLane {
    /// Page stores, laid out as the leader's.
    pub k_store: HostBuf,
    pub v_store: HostBuf,
    /// `[H_kv, capacity, d]` keys and values of the offloaded tokens in position order.
    pub k_history: HostBuf,
    pub v_history: HostBuf,
    /// Tokens in the history once this job's flush is appended.
    pub history_len: usize,
    pub flush: Option<Flush>,
}

/// What a job does.
pub enum Work {
    /// Insert, select `select.max_pages` pages per KV head for `queries` (`[B, H_q, d]` f32),
    /// plan and gather. Without `reselect`, a sequence that flushed nothing keeps its last
    /// selection: the job loads nothing for it (the device keeps ranking the pages it has).
    Leader { lanes: Vec<LeaderLane>, queries: HostBuf, select: SelectParams, reselect: bool },
    /// Append the flush to the history, rewrite the pages the leader's job changed, and
    /// gather the pages the leader's job planned.
    Follower { lanes: Vec<FollowerLane>, leader: Arc<JobState> },
}

/// A device-written flag: the job may start once the `i64` at `flag` is at least `step`.
#[derive(Clone, Copy, Debug)]
pub struct Ready {
    pub flag: HostBuf,
    pub step: i64,
}

/// One layer's host work for one decode step (see the module docs).
pub struct Job {
    pub geometry: Geometry,
    /// `None`: the inputs are in place already.
    pub ready: Option<Ready>,
    /// Metadata and page rows for the device, written by the job (see [`Outcome`]).
    pub staging: HostBuf,
    pub work: Work,
    /// Whatever keeps the lent buffers alive until the job has finished (the bindings put
    /// references to the arrays here); dropped with the job.
    pub keep_alive: Box<dyn std::any::Any + Send>,
}

/// Per-sequence result a follower job needs from its leader's.
#[derive(Clone, Debug, Default)]
struct LanePlan {
    plan: LoadPlan,
    /// Valid tokens of each loaded page, in `plan` order.
    load_len: Vec<i32>,
    /// `[H_kv, width]` valid tokens of each selected page.
    table_len: Vec<i32>,
    /// `[H_kv, width]` the selected pages, ranked (-1 past each head's count).
    selected: Vec<i32>,
    /// Device page slots per KV head (the residency map's capacity).
    capacity: usize,
    /// Per head: every changed page and its token positions in slot order.
    changed: Vec<Vec<(u32, Vec<u32>)>>,
}

/// What a finished job did; its results are in the staging buffer, laid out as
/// [`StagingLayout`] says (see [`staging`]): `loads` entries of `load_idx`, `loads + clears`
/// of `mask_idx`, the used prefix `end` of the buffer.
#[derive(Debug, Default)]
pub struct Outcome {
    pub loads: usize,
    pub clears: usize,
    pub width: usize,
    pub end: usize,
    /// Pages selected, summed over sequences and KV heads.
    pub selected: usize,
    /// Seconds: waiting for the device's flag (and the leader), inserting, selecting and
    /// planning, gathering.
    pub wait_s: f64,
    pub insert_s: f64,
    pub select_s: f64,
    pub gather_s: f64,
    lanes: Vec<LanePlan>,
}

impl Outcome {
    /// `[B, H_kv, width]` the pages the job selected, ranked (-1 past each head's count).
    pub fn selected_pages(&self) -> Vec<i32> {
        self.lanes.iter().flat_map(|l| l.selected.iter().copied()).collect()
    }
}

/// A submitted job: finished once, with its outcome or an error message.
pub struct JobState {
    done: Mutex<Option<std::result::Result<Arc<Outcome>, String>>>,
    cv: Condvar,
}

impl JobState {
    fn new() -> Arc<JobState> {
        Arc::new(JobState { done: Mutex::new(None), cv: Condvar::new() })
    }

    /// A job that already finished with `r` (one run synchronously).
    pub fn finished_with(r: Result<Arc<Outcome>>) -> Arc<JobState> {
        let s = JobState::new();
        s.finish(r.map_err(|e| e.to_string()));
        s
    }

    fn finish(&self, r: std::result::Result<Arc<Outcome>, String>) {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        if done.is_none() {
            *done = Some(r);
        }
        self.cv.notify_all();
    }

    /// Whether the job has finished.
    pub fn is_done(&self) -> bool {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Blocks until the job has finished; its outcome, or its error.
    pub fn wait(&self) -> Result<Arc<Outcome>> {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while done.is_none() {
            done = self.cv.wait(done).unwrap_or_else(|e| e.into_inner());
        }
        done.as_ref().expect("finished").clone().map_err(Error::Worker)
    }
}

enum Msg {
    Job(Box<Job>, Arc<JobState>, u64),
    Stop,
}

/// The worker: a dispatcher thread and a rayon pool. See the module docs.
pub struct LookAhead {
    tx: Mutex<Sender<Msg>>,
    pool: Arc<rayon::ThreadPool>,
    /// Bumped by [`LookAhead::cancel`]; jobs submitted before a bump finish as cancelled.
    generation: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl LookAhead {
    /// A worker whose jobs run on `threads` threads (`None`: one per core).
    pub fn new(threads: Option<usize>) -> Result<LookAhead> {
        let mut builder = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("icecache-lookahead-{i}"));
        if let Some(n) = threads {
            ensure!(n >= 1, "threads must be at least 1");
            builder = builder.num_threads(n);
        }
        let pool = Arc::new(builder.build().map_err(|e| Error::Invalid(e.to_string()))?);
        let generation = Arc::new(AtomicU64::new(0));
        let (tx, rx) = channel::<Msg>();
        let (p, gen) = (pool.clone(), generation.clone());
        let thread = std::thread::Builder::new()
            .name("icecache-lookahead".into())
            .spawn(move || {
                while let Ok(Msg::Job(job, state, job_gen)) = rx.recv() {
                    dispatch(*job, state, job_gen, &gen, &p);
                }
            })
            .map_err(Error::Io)?;
        Ok(LookAhead { tx: Mutex::new(tx), pool, generation, thread: Some(thread) })
    }

    /// Queues `job`; it starts once its flag is set (and its leader has finished).
    pub fn submit(&self, job: Job) -> Result<Arc<JobState>> {
        check_job(&job)?;
        let state = JobState::new();
        let gen = self.generation.load(Ordering::SeqCst);
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.send(Msg::Job(Box::new(job), state.clone(), gen))
            .map_err(|_| Error::Invalid("the worker has stopped".into()))?;
        Ok(state)
    }

    /// Runs `job` now, on the calling thread (with the worker's pool), without waiting for a
    /// flag: the synchronous path (fresh selection, the first step after a prompt).
    pub fn run(&self, job: Job) -> Result<Arc<Outcome>> {
        check_job(&job)?;
        self.pool.install(|| process(job, Duration::ZERO)).map(Arc::new)
    }

    /// Makes every job submitted so far finish as cancelled once it would start (jobs already
    /// running finish normally). Used when a step was abandoned, so its flags never come.
    pub fn cancel(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for LookAhead {
    fn drop(&mut self) {
        self.cancel();
        if let Ok(tx) = self.tx.lock() {
            let _ = tx.send(Msg::Stop);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Checks what can be checked before a job is queued, so that a bad job fails at `submit`.
fn check_job(job: &Job) -> Result<()> {
    let g = &job.geometry;
    ensure!(g.heads >= 1 && g.dim >= 1, "a job needs at least one KV head and dimension");
    ensure!(
        g.query_heads >= g.heads && g.query_heads.is_multiple_of(g.heads),
        "{} query heads are not a multiple of {} KV heads",
        g.query_heads,
        g.heads
    );
    ensure!(
        crate::pages::PAGE_SIZES.contains(&g.page_size),
        "page_size {} outside {:?}",
        g.page_size,
        crate::pages::PAGE_SIZES
    );
    if let Some(r) = &job.ready {
        r.flag.slice::<i64>("flag")?;
        ensure!(r.flag.len() == 8, "the flag must be one int64");
    }
    match &job.work {
        Work::Leader { lanes, queries, select, .. } => {
            ensure!(!lanes.is_empty(), "a job needs at least one sequence");
            let q = queries.slice::<f32>("queries")?;
            ensure!(
                q.len() == lanes.len() * g.query_heads * g.dim,
                "queries hold {} values, expected [{}, {}, {}]",
                q.len(),
                lanes.len(),
                g.query_heads,
                g.dim
            );
            ensure!(select.max_pages >= 1, "max_pages must be at least 1");
        }
        Work::Follower { lanes, .. } => ensure!(!lanes.is_empty(), "a job needs at least one sequence"),
    }
    Ok(())
}

/// Dispatcher side of one job: waits for its flag and leader, then hands it to the pool.
fn dispatch(job: Job, state: Arc<JobState>, job_gen: u64, generation: &AtomicU64, pool: &rayon::ThreadPool) {
    let t = Instant::now();
    let cancelled = || generation.load(Ordering::SeqCst) != job_gen;
    if let Some(r) = job.ready {
        let flag = r.flag.as_ptr() as *const i64;
        let mut spins = 0u32;
        // SAFETY: the flag is a lent, aligned int64 (checked at submit); the device writes it
        // by DMA, so it is read volatile, never cached in a register.
        while unsafe { std::ptr::read_volatile(flag) } < r.step {
            if cancelled() {
                state.finish(Err("cancelled: the decode step was abandoned".into()));
                return;
            }
            // Spin, then yield: the flag usually comes within a layer's time (tens of
            // microseconds), and a sleeping thread wakes up too late on some hosts.
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // The queries were copied before the flag (same device stream): read them after it.
        std::sync::atomic::fence(Ordering::Acquire);
    }
    if let Work::Follower { leader, .. } = &job.work {
        // Followers wait for their leader's job of the same step (it was submitted earlier).
        let mut done = leader.done.lock().unwrap_or_else(|e| e.into_inner());
        while done.is_none() {
            if cancelled() {
                drop(done);
                state.finish(Err("cancelled: the decode step was abandoned".into()));
                return;
            }
            done = leader.cv.wait_timeout(done, Duration::from_millis(5)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
    let waited = t.elapsed();
    pool.spawn(move || {
        let r = catch_unwind(AssertUnwindSafe(|| process(job, waited)));
        state.finish(match r {
            Ok(Ok(o)) => Ok(Arc::new(o)),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("internal error in the icecache look-ahead worker (a bug: please report it)".into()),
        });
    });
}

fn secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

/// Does one job (see [`Work`]).
fn process(job: Job, waited: Duration) -> Result<Outcome> {
    let g = job.geometry;
    let mut out = Outcome { wait_s: waited.as_secs_f64(), ..Outcome::default() };
    let stores: Vec<(HostBuf, HostBuf)> = match job.work {
        Work::Leader { lanes, queries, select, reselect } => {
            let q = queries.slice::<f32>("queries")?;
            let per_seq = g.query_heads * g.dim;
            let results: Vec<Result<LeaderWork>> = lanes
                .par_iter()
                .zip(q.par_chunks(per_seq))
                .map(|(lane, q)| leader_lane(&g, lane, q, select, reselect))
                .collect();
            for r in results {
                let done = r?;
                out.insert_s += done.insert_s;
                out.select_s += done.select_s;
                out.lanes.push(done.plan);
            }
            out.width = select.max_pages;
            lanes.iter().map(|l| (l.k_store, l.v_store)).collect()
        }
        Work::Follower { lanes, leader } => {
            let lead = leader.wait()?;
            ensure!(lead.lanes.len() == lanes.len(), "follower and leader jobs differ in batch size");
            let t = Instant::now();
            lanes.par_iter().zip(&lead.lanes).try_for_each(|(lane, lp)| follow_lane(&g, lane, lp))?;
            out.insert_s = secs(t);
            out.width = lead.width;
            out.lanes = lead.lanes.iter().map(|l| LanePlan { changed: Vec::new(), ..l.clone() }).collect();
            lanes.iter().map(|l| (l.k_store, l.v_store)).collect()
        }
    };
    let t = Instant::now();
    let staged = staging::write_staging(&g, &out.lanes, out.width, &stores, job.staging)?;
    (out.loads, out.clears, out.selected, out.end) = (staged.loads, staged.clears, staged.selected, staged.end);
    out.gather_s = secs(t);
    Ok(out)
}
