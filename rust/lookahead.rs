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

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{ensure, Error, Result};
use crate::load::{LoadPlan, ResidentPages};
use crate::pages::{int8, HeadForest, PageFormat};
use crate::select::SelectParams;

/// Alignment of the page rows after the metadata in a staging buffer, in bytes.
pub const ROW_ALIGN: usize = 64;

/// A region of host memory lent to a job by its owner.
#[derive(Clone, Copy, Debug)]
pub struct HostBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `HostBuf` is a pointer and a length; `HostBuf::new`'s contract makes the owner keep
// the memory valid and untouched while a job holds it, so it may move to the worker threads.
unsafe impl Send for HostBuf {}
// SAFETY: as for `Send`; jobs write disjoint parts of a buffer from different threads only
// through `slice_mut` calls on disjoint buffers.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// An empty buffer (no memory).
    pub const EMPTY: HostBuf = HostBuf { ptr: std::ptr::null_mut(), len: 0 };

    /// Lends `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes, and nobody but the job that holds
    /// this buffer may access it until that job is finished.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> HostBuf {
        HostBuf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes `at..at + len` of this buffer (clamped to it).
    ///
    /// # Safety
    /// As for [`HostBuf::new`]: the part is lent on the same terms as the whole.
    pub unsafe fn sub(&self, at: usize, len: usize) -> HostBuf {
        let at = at.min(self.len);
        HostBuf { ptr: self.ptr.wrapping_add(at), len: len.min(self.len - at) }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check<T>(&self, what: &str) -> Result<usize> {
        let size = std::mem::size_of::<T>();
        ensure!(
            self.len.is_multiple_of(size),
            "{what}: {} bytes are not a whole number of {size}-byte elements",
            self.len
        );
        ensure!(
            self.len == 0 || (self.ptr as usize).is_multiple_of(std::mem::align_of::<T>()),
            "{what} is not aligned for its element type"
        );
        Ok(self.len / size)
    }

    /// The buffer as elements of `T`.
    fn slice<T>(&self, what: &str) -> Result<&[T]> {
        let n = self.check::<T>(what)?;
        if n == 0 {
            return Ok(&[]);
        }
        // SAFETY: `new`'s contract: valid, exclusively lent memory; size and alignment checked.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, n) })
    }

    /// The buffer as mutable elements of `T`. Each job takes each of its buffers mutably once.
    #[allow(clippy::mut_from_ref)]
    fn slice_mut<T>(&self, what: &str) -> Result<&mut [T]> {
        let n = self.check::<T>(what)?;
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as for `slice`; the job holding the buffer is its only user.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, n) })
    }
}

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
    /// Bytes of one token row of a flush or history.
    fn row_bytes(&self) -> usize {
        self.dim * self.elem.size()
    }

    /// Bytes of one page of K (or V) in the stores and in staging.
    pub fn page_bytes(&self) -> usize {
        self.format.page_bytes(self.page_size, self.dim, self.elem.size())
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
    /// Page stores, `[H_kv, P]` pages of `Geometry::page_bytes`.
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
/// [`StagingLayout`] says (offsets in bytes):
/// - from 0: int64 `load_idx [max_loads]`, the device slot of each loaded page as
///   `(b·H_kv + head)·capacity + slot` (`trash` past `loads`), then int64 `mask_idx
///   [max_masks]`, the slots whose valid-token mask changes: the loaded ones, then those cleared
///   because their page changed and was not selected again (`trash` past `loads + clears`);
/// - from `table_at`: int32 `table [B·H_kv·width]`, the device slot of each selected page in
///   rank order (-1 past the head's count), then int32 `table_len`, its valid tokens;
/// - from `mask_at`: `[max_masks, page_size]` bytes, 1 where the slot holds a token;
/// - from `rows_at`: `[loads, 2, page_bytes]`, each loaded page's K then V page as the stores
///   hold it (`[page_size, d]` elements, or int8 codes and scales: `pages::int8`), up to `end`
///   (the used prefix of the buffer).
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

/// The fixed layout of a layer's staging buffer (see [`Outcome`]): every region has room for
/// the most a job can write, padded entries name the device pool's trash slot, so that the
/// device applies any step with the same operations (one CUDA graph) and only the used prefix
/// of the buffer needs copying.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingLayout {
    /// Load entries: every (sequence, KV head) loads at most `width` pages.
    pub max_loads: usize,
    /// Mask entries: the loads, and at most `capacity` cleared slots per (sequence, KV head).
    pub max_masks: usize,
    /// Slot id of the trash slot, one past the pool's `batch · heads · capacity` slots.
    pub trash: usize,
    pub table_at: usize,
    pub mask_at: usize,
    pub rows_at: usize,
    /// Bytes of the whole buffer.
    pub bytes: usize,
}

impl StagingLayout {
    pub fn new(g: &Geometry, batch: usize, width: usize, capacity: usize) -> StagingLayout {
        let lanes = batch * g.heads;
        let (max_loads, max_masks) = (lanes * width, lanes * (width + capacity));
        let table_at = 8 * (max_loads + max_masks);
        let mask_at = table_at + 8 * lanes * width;
        let rows_at = (mask_at + max_masks * g.page_size).div_ceil(ROW_ALIGN) * ROW_ALIGN;
        let bytes = rows_at + 2 * max_loads * g.page_bytes();
        StagingLayout { max_loads, max_masks, trash: lanes * capacity, table_at, mask_at, rows_at, bytes }
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
    ensure!(crate::pages::PAGE_SIZES.contains(&g.page_size), "page_size {} outside 8..=64", g.page_size);
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
        let flag = r.flag.ptr as *const i64;
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
    match job.work {
        Work::Leader { lanes, queries, select, reselect } => {
            let q = queries.slice::<f32>("queries")?;
            let per_seq = g.query_heads * g.dim;
            let results: Vec<Result<(LanePlan, f64, f64)>> = lanes
                .par_iter()
                .zip(q.par_chunks(per_seq))
                .map(|(lane, q)| leader_lane(&g, lane, q, select, reselect))
                .collect();
            for r in results {
                let (plan, insert_s, select_s) = r?;
                out.insert_s += insert_s;
                out.select_s += select_s;
                out.lanes.push(plan);
            }
            out.width = select.max_pages;
            let t = Instant::now();
            let stores: Vec<(HostBuf, HostBuf)> = lanes.iter().map(|l| (l.k_store, l.v_store)).collect();
            write_staging(&g, &mut out, &stores, job.staging)?;
            out.gather_s = secs(t);
        }
        Work::Follower { lanes, leader } => {
            let lead = leader.wait()?;
            ensure!(lead.lanes.len() == lanes.len(), "follower and leader jobs differ in batch size");
            let t = Instant::now();
            lanes.par_iter().zip(&lead.lanes).try_for_each(|(lane, lp)| follow_lane(&g, lane, lp))?;
            out.insert_s = secs(t);
            let t = Instant::now();
            out.width = lead.width;
            out.lanes = lead.lanes.iter().map(|l| LanePlan { changed: Vec::new(), ..l.clone() }).collect();
            let stores: Vec<(HostBuf, HostBuf)> = lanes.iter().map(|l| (l.k_store, l.v_store)).collect();
            write_staging(&g, &mut out, &stores, job.staging)?;
            out.gather_s = secs(t);
        }
    }
    Ok(out)
}

/// Inserts, selects and plans for one leader sequence; returns its plan and the seconds spent
/// inserting and selecting.
fn leader_lane(
    g: &Geometry,
    lane: &LeaderLane,
    q: &[f32],
    select: SelectParams,
    reselect: bool,
) -> Result<(LanePlan, f64, f64)> {
    let h = g.heads;
    let width = select.max_pages;
    let capacity = lane.resident.read().map_err(|_| poisoned())?.capacity();
    let nothing = || LanePlan {
        plan: LoadPlan { table: vec![-1; h * width], ..LoadPlan::default() },
        table_len: vec![0; h * width],
        selected: vec![-1; h * width],
        changed: vec![Vec::new(); h],
        capacity,
        ..LanePlan::default()
    };
    let Some(lane_forest) = &lane.forest else {
        ensure!(lane.flush.is_none(), "tokens were flushed into a sequence that has no index yet");
        return Ok((nothing(), 0.0, 0.0));
    };
    if !reselect && lane.flush.is_none() {
        return Ok((nothing(), 0.0, 0.0));
    }
    let t = Instant::now();
    let mut changed = vec![Vec::new(); h];
    if let Some(flush) = &lane.flush {
        let mut forest = lane_forest.write().map_err(|_| poisoned())?;
        check_store_dims(g, &forest)?;
        let pages = insert_flush(g, &mut forest, flush, lane.k_store, lane.v_store)?;
        let mut resident = lane.resident.write().map_err(|_| poisoned())?;
        for (head, pages) in pages.into_iter().enumerate() {
            let ids: Vec<i64> = pages.iter().map(|&p| p as i64).collect();
            resident.invalidate(head, &ids)?;
            changed[head] = pages
                .into_iter()
                .map(|p| Ok((p, forest.page_tokens(head, p as usize)?.to_vec())))
                .collect::<Result<_>>()?;
        }
    }
    let insert_s = secs(t);
    let t = Instant::now();
    let forest = lane_forest.read().map_err(|_| poisoned())?;
    check_store_dims(g, &forest)?;
    let (pages, counts) = if forest.max_pages() <= width {
        // Everything fits: every page, no search (and exact).
        let mut pages = vec![-1i32; h * width];
        let mut counts = vec![0i32; h];
        for head in 0..h {
            let n = forest.num_pages(head)?;
            for (p, o) in pages[head * width..head * width + n].iter_mut().enumerate() {
                *o = p as i32;
            }
            counts[head] = n as i32;
        }
        (pages, counts)
    } else {
        // An 8-bit forest's keys are its K store's rows.
        let k_codes = match g.format {
            PageFormat::Native => None,
            PageFormat::Int8 => Some(lane.k_store.slice::<u8>("k_store")?),
        };
        forest.select(q, select, k_codes)?
    };
    let plan = lane.resident.write().map_err(|_| poisoned())?.plan(&pages, &counts)?;
    let len =
        |head: i32, page: i32| -> Result<i32> { Ok(forest.page_tokens(head as usize, page as usize)?.len() as i32) };
    let load_len = plan.heads.iter().zip(&plan.pages).map(|(&hd, &p)| len(hd, p)).collect::<Result<Vec<_>>>()?;
    let mut table_len = vec![0i32; h * width];
    for (i, (&p, tl)) in pages.iter().zip(table_len.iter_mut()).enumerate() {
        if p >= 0 {
            *tl = len((i / width) as i32, p)?;
        }
    }
    Ok((LanePlan { plan, load_len, table_len, selected: pages, changed, capacity }, insert_s, secs(t)))
}

fn poisoned() -> Error {
    Error::Invalid("an earlier failure left this layer's index unusable; reset the cache".into())
}

fn check_store_dims(g: &Geometry, forest: &HeadForest) -> Result<()> {
    ensure!(
        forest.num_heads() == g.heads && forest.dim() == g.dim && forest.page_size() == g.page_size,
        "the index has {} heads of dim {} with pages of {}, the job {} / {} / {}",
        forest.num_heads(),
        forest.dim(),
        forest.page_size(),
        g.heads,
        g.dim,
        g.page_size
    );
    Ok(())
}

/// `forest.insert` for the job's element type; returns the changed pages per head.
fn insert_flush(
    g: &Geometry,
    forest: &mut HeadForest,
    flush: &Flush,
    k_store: HostBuf,
    v_store: HostBuf,
) -> Result<Vec<Vec<u32>>> {
    let want = g.heads * flush.tokens * g.dim;
    macro_rules! typed {
        ($t:ty) => {{
            let k = flush.keys.slice::<$t>("flushed keys")?;
            let v = flush.values.slice::<$t>("flushed values")?;
            ensure!(
                k.len() == want && v.len() == want,
                "flushed keys/values must be [{}, {}, {}]",
                g.heads,
                flush.tokens,
                g.dim
            );
            match g.format {
                PageFormat::Native => {
                    forest.insert(k, v, k_store.slice_mut::<$t>("k_store")?, v_store.slice_mut::<$t>("v_store")?)
                }
                PageFormat::Int8 => {
                    forest.insert_int8(k, v, k_store.slice_mut::<u8>("k_store")?, v_store.slice_mut::<u8>("v_store")?)
                }
            }
        }};
    }
    match g.elem {
        Elem::F32 => typed!(f32),
        Elem::F16 => typed!(f16),
        Elem::Bf16 => typed!(u16),
    }
}

/// A follower sequence: appends the flush to its history and rewrites the pages its leader's
/// insert changed, from the history (as bytes: every element type alike; 8-bit pages quantise
/// the rows).
fn follow_lane(g: &Geometry, lane: &FollowerLane, lead: &LanePlan) -> Result<()> {
    let rb = g.row_bytes();
    let hk = lane.k_history.slice_mut::<u8>("k_history")?;
    let hv = lane.v_history.slice_mut::<u8>("v_history")?;
    ensure!(
        hk.len() == hv.len() && hk.len() % (g.heads * rb) == 0,
        "histories must both be [{}, n, {}]",
        g.heads,
        g.dim
    );
    let cap = hk.len() / (g.heads * rb);
    ensure!(lane.history_len <= cap, "history_len {} exceeds the history's {cap} tokens", lane.history_len);
    if let Some(f) = &lane.flush {
        let (k, v) = (f.keys.slice::<u8>("flushed keys")?, f.values.slice::<u8>("flushed values")?);
        ensure!(
            k.len() == g.heads * f.tokens * rb && v.len() == k.len(),
            "flushed keys/values must be [{}, {}, {}]",
            g.heads,
            f.tokens,
            g.dim
        );
        ensure!(
            f.tokens <= lane.history_len,
            "history_len {} is below the {} flushed tokens",
            lane.history_len,
            f.tokens
        );
        let at = lane.history_len - f.tokens;
        for head in 0..g.heads {
            let dst = (head * cap + at) * rb;
            let src = head * f.tokens * rb;
            hk[dst..dst + f.tokens * rb].copy_from_slice(&k[src..src + f.tokens * rb]);
            hv[dst..dst + f.tokens * rb].copy_from_slice(&v[src..src + f.tokens * rb]);
        }
    }
    let ks = lane.k_store.slice_mut::<u8>("k_store")?;
    let vs = lane.v_store.slice_mut::<u8>("v_store")?;
    let pb = g.page_bytes();
    ensure!(
        ks.len() == vs.len() && ks.len() % (g.heads * pb) == 0,
        "stores must both be [{}, P] pages of {pb} bytes",
        g.heads
    );
    let p = ks.len() / (g.heads * pb);
    for (head, pages) in lead.changed.iter().enumerate() {
        for (page, tokens) in pages {
            ensure!((*page as usize) < p, "page {page} beyond the store's {p} pages");
            let at = (head * p + *page as usize) * pb;
            let (kp, vp) = (&mut ks[at..at + pb], &mut vs[at..at + pb]);
            kp.fill(0);
            vp.fill(0);
            ensure!(tokens.len() <= g.page_size, "page {page} holds more than {} tokens", g.page_size);
            for (slot, &t) in tokens.iter().enumerate() {
                ensure!((t as usize) < lane.history_len, "token {t} is not in the history ({})", lane.history_len);
                let src = (head * cap + t as usize) * rb;
                let (k, v) = (&hk[src..src + rb], &hv[src..src + rb]);
                match g.format {
                    PageFormat::Native => {
                        kp[slot * rb..(slot + 1) * rb].copy_from_slice(k);
                        vp[slot * rb..(slot + 1) * rb].copy_from_slice(v);
                    }
                    PageFormat::Int8 => {
                        for (page, row) in [(&mut *kp, k), (&mut *vp, v)] {
                            let row = row_f32(g.elem, row);
                            ensure!(row.iter().all(|x| x.is_finite()), "8-bit pages hold finite values only");
                            int8::put_row(page, slot, &row, g.page_size);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// A history row's bytes as f32 values.
fn row_f32(elem: Elem, bytes: &[u8]) -> Vec<f32> {
    match elem {
        Elem::F32 => bytes.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Elem::F16 => bytes.chunks_exact(2).map(|b| f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()).collect(),
        Elem::Bf16 => {
            bytes.chunks_exact(2).map(|b| bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()).collect()
        }
    }
}

/// Writes the metadata and gathers every lane's loaded pages into the staging buffer (layout
/// in [`Outcome`]); fills the counts of `out`.
fn write_staging(g: &Geometry, out: &mut Outcome, stores: &[(HostBuf, HostBuf)], staging: HostBuf) -> Result<()> {
    let (h, s) = (g.heads, g.page_size);
    let lanes = &out.lanes;
    let capacity = lanes.first().map_or(1, |l| l.capacity);
    let layout = StagingLayout::new(g, lanes.len(), out.width, capacity);
    let (n, c) = (lanes.iter().map(|l| l.plan.pages.len()).sum(), lanes.iter().map(|l| l.plan.cleared.len()).sum());
    ensure!(n <= layout.max_loads && n + c <= layout.max_masks, "a job planned more loads than its layout holds");
    out.loads = n;
    out.clears = c;
    out.selected = lanes.iter().map(|l| l.plan.table.iter().filter(|&&x| x >= 0).count()).sum();
    let pb = g.page_bytes();
    out.end = layout.rows_at + 2 * n * pb;
    let buf = staging.slice_mut::<u8>("staging")?;
    ensure!(layout.bytes <= buf.len(), "staging holds {} bytes, this layer's jobs need {}", buf.len(), layout.bytes);
    let (meta, rows) = buf.split_at_mut(layout.rows_at);
    let slot_id = |b: usize, head: i32, slot: i32| ((b * h + head as usize) * capacity) as i64 + slot as i64;
    let trash = layout.trash as i64;
    let mut ids: Vec<i64> = Vec::with_capacity(layout.max_loads + layout.max_masks);
    for (b, l) in lanes.iter().enumerate() {
        ids.extend(l.plan.heads.iter().zip(&l.plan.slots).map(|(&hd, &sl)| slot_id(b, hd, sl)));
    }
    ids.resize(layout.max_loads, trash);
    ids.extend_from_within(..n);
    for (b, l) in lanes.iter().enumerate() {
        ids.extend(l.plan.cleared.iter().map(|&(hd, sl)| slot_id(b, hd, sl)));
    }
    ids.resize(layout.max_loads + layout.max_masks, trash);
    for (o, x) in meta[..layout.table_at].chunks_exact_mut(8).zip(&ids) {
        o.copy_from_slice(&x.to_ne_bytes());
    }
    let tables = lanes.iter().flat_map(|l| l.plan.table.iter()).chain(lanes.iter().flat_map(|l| l.table_len.iter()));
    for (o, x) in meta[layout.table_at..layout.mask_at].chunks_exact_mut(4).zip(tables) {
        o.copy_from_slice(&x.to_ne_bytes());
    }
    let lens = lanes.iter().flat_map(|l| l.load_len.iter().copied()).chain(std::iter::repeat_n(0, c));
    for (row, len) in meta[layout.mask_at..layout.mask_at + (n + c) * s].chunks_exact_mut(s).zip(lens) {
        row.iter_mut().enumerate().for_each(|(i, x)| *x = u8::from((i as i32) < len));
    }
    // Page rows: K then V of each loaded page, in plan order (sorted by store address).
    let mut sources = Vec::with_capacity(n);
    for (l, (ks, vs)) in lanes.iter().zip(stores) {
        let (ks, vs) = (ks.slice::<u8>("k_store")?, vs.slice::<u8>("v_store")?);
        ensure!(ks.len() == vs.len() && ks.len() % (h * pb) == 0, "stores must be [{h}, P] pages of {pb} bytes");
        let p = ks.len() / (h * pb);
        for (&hd, &pg) in l.plan.heads.iter().zip(&l.plan.pages) {
            ensure!((pg as usize) < p, "page {pg} out of range (stores hold {p})");
            let at = (hd as usize * p + pg as usize) * pb;
            sources.push((&ks[at..at + pb], &vs[at..at + pb]));
        }
    }
    rows[..2 * n * pb].par_chunks_mut(2 * pb).zip(sources).for_each(|(row, (k, v))| {
        row[..pb].copy_from_slice(k);
        row[pb..].copy_from_slice(v);
    });
    Ok(())
}
