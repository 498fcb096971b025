//! One IceCache layer's jobs, step after step: its sequences' lanes, the pairing of a following
//! layer's jobs with its leader's, and when a queued job selects anew.
//!
//! A [`LayerJobs`] holds every buffer its jobs use, lent once, so that starting a step's job
//! costs a few integers. Every job keeps the layer's and its lanes' keep-alives until it has
//! finished, so their memory outlives the job whatever the owner drops meanwhile.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use super::{Flush, FollowerLane, Geometry, HostBuf, Job, JobState, LeaderLane, LookAhead, Ready, Work};
use crate::error::{ensure, Error, Result};
use crate::load::ResidentPages;
use crate::pages::HeadForest;
use crate::select::SelectParams;

/// Whatever keeps lent memory alive (the bindings put references to the arrays here); shared
/// by a lane and the jobs that use it.
pub type KeepAlive = Arc<dyn Any + Send + Sync>;

/// The buffers every job of a layer uses.
pub struct LayerBuffers {
    /// `[B, H_q, d]` f32: the step's queries.
    pub queries: HostBuf,
    /// One int64: the step number the device writes behind the queries.
    pub flag: HostBuf,
    /// `[B, H_kv, page_size, d]` each: the tokens each sequence's window flushed.
    pub flush_k: HostBuf,
    pub flush_v: HostBuf,
    /// The staging buffer (`Geometry::staging_layout`).
    pub staging: HostBuf,
    pub keep_alive: KeepAlive,
}

/// What a lane's pages come from.
#[derive(Clone)]
pub enum LaneSource {
    /// A leading layer's: its index (`None` while the sequence has offloaded nothing) and the
    /// device residency of its pages.
    Index { forest: Option<Arc<RwLock<HeadForest>>>, resident: Arc<RwLock<ResidentPages>> },
    /// A following layer's: `[H_kv, capacity, d]` keys and values in position order, from which
    /// it rewrites the pages its leader's inserts change.
    History { k_history: HostBuf, v_history: HostBuf },
}

/// One sequence's buffers.
#[derive(Clone)]
pub struct Lane {
    /// Page stores, `[H_kv, P]` pages of `Geometry::k_page_bytes` (K) and `v_page_bytes` (V).
    pub k_store: HostBuf,
    pub v_store: HostBuf,
    pub source: LaneSource,
    pub keep_alive: KeepAlive,
}

/// Jobs started so far, and the last two with their numbers: a following layer's `n`th job
/// pairs with its leader's `n`th (with look-ahead the leader may have started its next one).
#[derive(Default)]
struct Started {
    count: u64,
    recent: VecDeque<(u64, Arc<JobState>)>,
}

struct State {
    lanes: Vec<Option<Lane>>,
    current: Option<Arc<JobState>>,
    started: Started,
}

/// One layer's look-ahead jobs. See the module docs.
pub struct LayerJobs {
    worker: Arc<LookAhead>,
    leader: Option<Arc<LayerJobs>>,
    geometry: Geometry,
    batch: usize,
    select: SelectParams,
    /// Queued jobs select anew every `refresh` jobs (and whenever tokens were flushed).
    refresh: u64,
    buffers: LayerBuffers,
    state: Mutex<State>,
}

/// The job-order errors: a call that must wait for (or come after) another.
fn out_of_order(why: &str) -> Error {
    Error::Order(why.into())
}

impl LayerJobs {
    /// A layer of `batch` sequences whose jobs run on `worker`; with a `leader`, a layer that
    /// reuses the leader's page layout (the leader must lead: reuse is one level deep).
    pub fn new(
        worker: Arc<LookAhead>,
        geometry: Geometry,
        batch: usize,
        select: SelectParams,
        refresh: usize,
        buffers: LayerBuffers,
        leader: Option<Arc<LayerJobs>>,
    ) -> Result<LayerJobs> {
        let g = geometry;
        ensure!(batch >= 1 && refresh >= 1, "a layer needs at least one sequence, and refresh at least 1");
        let flush_bytes = batch * g.heads * g.page_size * g.dim * g.elem.size();
        ensure!(
            buffers.flush_k.len() == flush_bytes && buffers.flush_v.len() == flush_bytes,
            "flush_k and flush_v must be [{batch}, {}, {}, {}] of the tokens' element type",
            g.heads,
            g.page_size,
            g.dim
        );
        if let Some(l) = &leader {
            ensure!(
                l.batch == batch
                    && (l.geometry.heads, l.geometry.page_size) == (g.heads, g.page_size)
                    && l.leader.is_none(),
                "leader must be a leading layer of the same batch, heads and pages"
            );
        }
        Ok(LayerJobs {
            worker,
            leader,
            geometry,
            batch,
            select,
            refresh: refresh as u64,
            buffers,
            state: Mutex::new(State { lanes: vec![None; batch], current: None, started: Started::default() }),
        })
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Whether this layer owns its index (it has no leader).
    pub fn leads(&self) -> bool {
        self.leader.is_none()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding it; a poisoned lock still guards consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lends sequence `b`'s buffers (again after the owner reallocated any); not while a job
    /// runs.
    pub fn set_lane(&self, b: usize, lane: Lane) -> Result<()> {
        let g = &self.geometry;
        ensure!(b < self.batch, "b = {b} outside the batch of {}", self.batch);
        match (&lane.source, self.leads()) {
            (LaneSource::Index { forest, resident }, true) => {
                let forest_fits = match forest {
                    None => true,
                    Some(f) => {
                        let f = f.read().map_err(|_| super::lanes::poisoned())?;
                        (f.num_heads(), f.dim(), f.page_size(), f.format()) == (g.heads, g.dim, g.page_size, g.format)
                    }
                };
                let resident_heads = resident.read().map_err(|_| super::lanes::poisoned())?.num_heads();
                ensure!(
                    forest_fits && resident_heads == g.heads,
                    "the forest or resident pages do not match the layer's heads, pages and page format"
                );
            }
            (LaneSource::History { .. }, true) => {
                return Err(Error::Invalid("a leading layer's lane needs its resident pages".into()))
            }
            (LaneSource::Index { .. }, false) => {
                return Err(Error::Invalid("a following layer's lane needs its histories".into()))
            }
            (LaneSource::History { .. }, false) => {}
        }
        let mut st = self.state();
        if st.current.as_ref().is_some_and(|j| !j.is_done()) {
            return Err(out_of_order("a job of this layer is running: wait for it before changing its buffers"));
        }
        st.lanes[b] = Some(lane);
        Ok(())
    }

    /// Sequence `b`'s first `m` flushed tokens, `[H_kv, m, d]` each.
    fn flush(&self, b: usize, m: usize) -> Option<Flush> {
        if m == 0 {
            return None;
        }
        let g = &self.geometry;
        let per_seq = g.heads * g.page_size * g.dim * g.elem.size();
        let take = |buf: &HostBuf| {
            // SAFETY: a sub-range of a lent buffer (its size checked in `new`, `m` in `start`);
            // the job that gets it is the only user until it finishes.
            unsafe { buf.sub(b * per_seq, g.heads * m * g.dim * g.elem.size()) }
        };
        Some(Flush { keys: take(&self.buffers.flush_k), values: take(&self.buffers.flush_v), tokens: m })
    }

    /// Starts this layer's job for one step: `flushed[b]` tokens of sequence `b` wait in the
    /// flush buffers. `step`: queue it until the flag reaches `step`; `None`: run it now, on
    /// this thread (its errors, as a queued job's, come from [`JobState::wait`]).
    /// `history_lens` (following layers): each history's length once the flush is appended.
    pub fn start(&self, flushed: &[usize], step: Option<i64>, history_lens: Option<&[usize]>) -> Result<()> {
        self.check_start(flushed, history_lens)?;
        let g = self.geometry;
        let mut st = self.state();
        let number = st.started.count;
        let leader_job = match &self.leader {
            None => None,
            Some(l) => {
                let ls = l.state();
                let job = ls.started.recent.iter().find(|(n, _)| *n == number).map(|(_, j)| j.clone());
                Some(job.ok_or_else(|| out_of_order("the leading layer has not started this step's job"))?)
            }
        };
        if st.current.as_ref().is_some_and(|j| !j.is_done()) {
            return Err(out_of_order("this layer's previous job has not finished: wait for it first"));
        }
        let lanes: Vec<&Lane> = st
            .lanes
            .iter()
            .enumerate()
            .map(|(b, l)| l.as_ref().ok_or_else(|| Error::Invalid(format!("sequence {b} has no buffers (set_lane)"))))
            .collect::<Result<_>>()?;
        let keep: Vec<KeepAlive> = std::iter::once(self.buffers.keep_alive.clone())
            .chain(lanes.iter().map(|l| l.keep_alive.clone()))
            .collect();
        let work = match leader_job {
            None => Work::Leader {
                lanes: lanes
                    .iter()
                    .enumerate()
                    .map(|(b, l)| match &l.source {
                        LaneSource::Index { forest, resident } => Ok(LeaderLane {
                            forest: forest.clone(),
                            resident: resident.clone(),
                            k_store: l.k_store,
                            v_store: l.v_store,
                            flush: self.flush(b, flushed[b]),
                        }),
                        LaneSource::History { .. } => Err(Error::Internal("a leading lane holds histories".into())),
                    })
                    .collect::<Result<_>>()?,
                queries: self.buffers.queries,
                select: self.select,
                reselect: self.reselects(number, step),
            },
            Some(leader) => {
                let lens = history_lens.unwrap_or_default(); // one per sequence: check_start
                Work::Follower {
                    lanes: lanes
                        .iter()
                        .enumerate()
                        .map(|(b, l)| match &l.source {
                            LaneSource::History { k_history, v_history } => Ok(FollowerLane {
                                k_store: l.k_store,
                                v_store: l.v_store,
                                k_history: *k_history,
                                v_history: *v_history,
                                history_len: lens[b],
                                flush: self.flush(b, flushed[b]),
                            }),
                            LaneSource::Index { .. } => Err(Error::Internal("a following lane holds an index".into())),
                        })
                        .collect::<Result<_>>()?,
                    leader,
                }
            }
        };
        let job = Job {
            geometry: g,
            ready: step.map(|s| Ready { flag: self.buffers.flag, step: s }),
            staging: self.buffers.staging,
            work,
            keep_alive: Box::new(keep),
        };
        let state = match step {
            None => JobState::finished_with(self.worker.run(job)),
            Some(_) => self.worker.submit(job)?,
        };
        st.current = Some(state.clone());
        st.started.recent.push_back((number, state));
        if st.started.recent.len() > 2 {
            st.started.recent.pop_front();
        }
        st.started.count += 1;
        Ok(())
    }

    /// The checks of [`LayerJobs::start`]'s arguments, which change nothing: so that a caller
    /// starting several layers can check every layer's before it starts any.
    pub fn check_start(&self, flushed: &[usize], history_lens: Option<&[usize]>) -> Result<()> {
        let g = self.geometry;
        ensure!(
            flushed.len() == self.batch && flushed.iter().all(|&m| m <= g.page_size),
            "flushed must give 0..={} tokens for each of {} sequences",
            g.page_size,
            self.batch
        );
        if self.leader.is_some() {
            let lens = history_lens.ok_or_else(|| Error::Invalid("a following layer needs history_lens".into()))?;
            ensure!(lens.len() == self.batch, "history_lens needs one entry per sequence");
        }
        Ok(())
    }

    /// Whether the job numbered `number` selects anew even where nothing was flushed: every
    /// `refresh`th job, and every job run now (it serves the step it runs in).
    fn reselects(&self, number: u64, step: Option<i64>) -> bool {
        step.is_none() || number.is_multiple_of(self.refresh)
    }

    /// The job started last, if any.
    pub fn current(&self) -> Option<Arc<JobState>> {
        self.state().current.clone()
    }

    /// Whether the current job has finished (`true` when there is none).
    pub fn done(&self) -> bool {
        self.state().current.as_ref().is_none_or(|j| j.is_done())
    }

    /// Forgets the current job (after it finished or was cancelled), the job count and every
    /// lane.
    pub fn clear(&self) {
        let mut st = self.state();
        st.current = None;
        st.started = Started::default();
        st.lanes.iter_mut().for_each(|l| *l = None);
    }
}
