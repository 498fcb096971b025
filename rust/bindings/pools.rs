//! The thread pools behind the Python objects' parallel work.
//!
//! One pool per thread count, made on first use and shared by every object that asks for that
//! count: a build then runs on warm threads (and their warm allocator arenas) instead of
//! spawning fresh ones per object, and objects working at once share the cores they asked for.
//! `threads=None` is a pool of rayon's default size (`RAYON_NUM_THREADS`, else every core).
//!
//! Background pools (a separate pool per count) run work that nothing waits for at once, such
//! as the runtime's index builds, on threads of lower scheduling priority (on Linux, nice
//! raised by [`BACKGROUND_NICE`]): where they share the cores with a decode step's threads, the step's
//! threads run first, and the builds still take every core nothing else wants.
//!
//! Fork safety: a child of `fork()` inherits the parent's pools without their threads, so work
//! handed to them would never return. Objects therefore keep only their thread count and look
//! their pool up at each call; the lookup notices a new process id and starts new pools. In a
//! forked child every call runs inside its pool (`on_pool`), never on the calling thread, so
//! nested parallel work cannot reach rayon's global pool, which may be such an inherited pool.

use std::sync::{Arc, Mutex, OnceLock};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::Error;

/// The most threads an object may ask for: far beyond any machine's cores, and a clear error
/// instead of the OS refusing to start a million threads.
pub(super) const MAX_THREADS: usize = 4096;

/// How much a background pool's threads raise their nice value (Linux; 19 is the lowest priority).
pub(super) const BACKGROUND_NICE: i32 = 10;

/// An object's worker threads: its thread count and priority, resolved to the shared pool at
/// each call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Workers {
    threads: Option<usize>,
    background: bool,
}

impl Workers {
    /// Checks `threads` (`None`: rayon's default size) and starts its pool, so that a count
    /// the OS cannot serve fails in the constructor.
    pub fn new(threads: Option<usize>) -> PyResult<Workers> {
        Workers::with_priority(threads, false)
    }

    /// As [`Workers::new`], on a background pool if `background` (see the module docs).
    pub fn with_priority(threads: Option<usize>, background: bool) -> PyResult<Workers> {
        match threads {
            Some(0) => return Err(PyValueError::new_err("threads must be at least 1 (or None for all cores)")),
            Some(n) if n > MAX_THREADS => {
                return Err(PyValueError::new_err(format!("threads must be at most {MAX_THREADS}, got {n}")))
            }
            _ => {}
        }
        let workers = Workers { threads, background };
        workers.pool().map_err(super::guard::to_py)?;
        Ok(workers)
    }

    /// The same thread count at the priority `background` asks for. Its pool starts at the
    /// first call that uses it.
    pub fn with_background(self, background: bool) -> Workers {
        Workers { background, ..self }
    }

    /// The pool of rayon's default size, for free functions.
    pub fn default_size() -> Workers {
        Workers { threads: None, background: false }
    }

    /// This process's pool for the thread count.
    fn pool(self) -> crate::Result<Arc<rayon::ThreadPool>> {
        struct Pools {
            pid: u32,
            pools: Vec<(Workers, Arc<rayon::ThreadPool>)>,
        }
        static POOLS: Mutex<Pools> = Mutex::new(Pools { pid: 0, pools: Vec::new() });
        // A panic elsewhere cannot leave the list half-changed (a push or a drain is the only change).
        let mut p = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        let pid = std::process::id();
        if p.pid != pid {
            // Inherited from the parent: their threads do not exist here. Dropping them would
            // signal those threads through locks the fork may have copied held; leak them.
            for (_, pool) in p.pools.drain(..) {
                std::mem::forget(pool);
            }
            p.pid = pid;
        }
        if let Some((_, pool)) = p.pools.iter().find(|(m, _)| *m == self) {
            return Ok(Arc::clone(pool));
        }
        let mut builder = rayon::ThreadPoolBuilder::new();
        let kind = if self.background { "icecache-bg" } else { "icecache" };
        if let Some(n) = self.threads {
            builder = builder.num_threads(n).thread_name(move |i| format!("{kind}-{n}-{i}"));
        } else {
            builder = builder.thread_name(move |i| format!("{kind}-all-{i}"));
        }
        if self.background {
            builder = builder.start_handler(|_| lower_this_threads_priority());
        }
        let pool = builder.build().map(Arc::new).map_err(|e| {
            let n = self.threads.map_or_else(|| "the default number of".to_string(), |n| n.to_string());
            Error::Invalid(format!("threads: could not start {n} threads: {e}"))
        })?;
        p.pools.push((self, Arc::clone(&pool)));
        Ok(pool)
    }
}

/// Raises the calling thread's nice value by [`BACKGROUND_NICE`], to at most 19 (Linux's nice
/// value is per thread; a new thread has its creator's). Best effort: where the OS refuses, the
/// thread keeps its priority and the work is only less polite.
fn lower_this_threads_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread's own id.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        libc::setpriority(libc::PRIO_PROCESS, tid, (now + BACKGROUND_NICE).min(19));
    }
}

/// Whether this process is a child forked after the module was loaded.
fn forked() -> bool {
    static LOADED_IN: OnceLock<u32> = OnceLock::new();
    *LOADED_IN.get_or_init(std::process::id) != std::process::id()
}

/// Records the process that loaded the module (the parent of any later fork).
pub(super) fn note_loading_process() {
    let _ = forked();
}

/// `f` on the workers' pool when `parallel` work is coming (handing a small call to a pool
/// thread costs more than the call), on the calling thread otherwise; in a forked child always
/// on the pool (see the module doc).
pub(super) fn on_pool<T: Send>(
    workers: Workers,
    parallel: bool,
    f: impl FnOnce() -> crate::Result<T> + Send,
) -> crate::Result<T> {
    if parallel || forked() {
        workers.pool()?.install(f)
    } else {
        f()
    }
}
