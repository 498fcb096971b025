//! The guard every entry point goes through.
//!
//! - `entry` wraps each method body: a panic anywhere in binding code becomes `RuntimeError`
//!   (PyO3 would raise `PanicException`, a `BaseException` that `except Exception` misses).
//! - `run` and `Shared` run the core's work with the GIL released, inside `catch_panics`.
//! - `Shared` is the thread-safety model of the Python objects: readers run in parallel,
//!   writers one at a time, behind a lock in the core. A lock is only ever waited for with the
//!   GIL released, so a thread waiting for it never blocks other Python threads, and no thread
//!   holds the GIL while it waits for a lock (a lock holder may wait for the GIL: the GIL's
//!   holder never waits for a lock).
//! - `to_py` maps core errors to exceptions: `ValueError` (bad input), `KeyError` (unknown
//!   id), `IndexFileError` (bad save file), `OSError`, `MemoryError` (an allocation the
//!   arguments ask for that failed), `RuntimeError` (a bug).
//! - The size extractors reject bools, negative and fractional numbers by argument name, and
//!   sizes beyond `usize` (no silent cast).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, RwLock};

use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::error::catch_panics;
use crate::Error;

create_exception!(
    _core,
    IndexFileError,
    PyValueError,
    "A save file is truncated, corrupted, or of an unsupported format version."
);

pub(super) fn to_py(e: Error) -> PyErr {
    match e {
        Error::Invalid(m) => PyValueError::new_err(m),
        Error::UnknownId(id) => PyKeyError::new_err(format!("unknown id {id}")),
        Error::File(m) => IndexFileError::new_err(m),
        Error::Io(e) => e.into(),
        Error::Worker(m) | Error::Order(m) => PyRuntimeError::new_err(m),
        Error::Memory(m) => PyMemoryError::new_err(m),
        e @ Error::Internal(_) => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Runs a method body; a panic in it becomes `RuntimeError`.
pub(super) fn entry<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(PyRuntimeError::new_err("internal error in icecache's bindings (a bug: please report it)"))
    })
}

/// Runs core work `f` with the GIL released; a panic becomes `RuntimeError`.
pub(super) fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    py.allow_threads(|| catch_panics(f)).map_err(to_py)
}

/// A core object shared by Python threads (and by the look-ahead worker's jobs, which take the
/// same lock): any number of readers at once, or one writer. A panic while a writer holds it
/// poisons the lock (the object may be half-changed), and every later call says so instead of
/// trusting it.
pub(super) struct Shared<T> {
    lock: Arc<RwLock<T>>,
    /// The Python type's name, for the error of a poisoned object.
    name: &'static str,
}

impl<T: Send + Sync> Shared<T> {
    pub fn new(value: T, name: &'static str) -> Shared<T> {
        Shared { lock: Arc::new(RwLock::new(value)), name }
    }

    /// The lock itself, for the look-ahead worker's jobs.
    pub fn arc(&self) -> Arc<RwLock<T>> {
        self.lock.clone()
    }

    fn unusable(&self) -> Error {
        Error::Internal(format!(
            "this {} is unusable: an earlier call failed inside icecache while changing it",
            self.name
        ))
    }

    /// `f` on shared access; the wait and the work run without the GIL.
    pub fn view<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&T) -> crate::Result<R> + Send) -> PyResult<R> {
        py.allow_threads(|| catch_panics(|| f(&*self.lock.read().map_err(|_| self.unusable())?))).map_err(to_py)
    }

    /// `f` on exclusive access; the wait and the work run without the GIL. A panic in `f`
    /// unwinds through the lock, which poisons it.
    pub fn update<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut T) -> crate::Result<R> + Send) -> PyResult<R> {
        py.allow_threads(|| catch_panics(|| f(&mut *self.lock.write().map_err(|_| self.unusable())?))).map_err(to_py)
    }

    /// `f` with the GIL, on shared access taken without it (for calls that borrow arrays
    /// after locking). `f` runs the core's work through `release`.
    pub fn with_read<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(Python<'_>, &T) -> PyResult<R> + Send,
    ) -> PyResult<R> {
        let out = py.allow_threads(|| {
            catch_panics(|| {
                let guard = self.lock.read().map_err(|_| self.unusable())?;
                Ok(Python::with_gil(|py| f(py, &guard)))
            })
        });
        out.map_err(to_py)?
    }

    /// `f` with the GIL, on exclusive access taken without it: a second writer waits for the
    /// lock before it borrows the arrays the first one writes. A panic in `f` (the core's work
    /// run through `release` included) poisons the lock.
    pub fn with_write<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(Python<'_>, &mut T) -> PyResult<R> + Send,
    ) -> PyResult<R> {
        let out = py.allow_threads(|| {
            catch_panics(|| {
                let mut guard = self.lock.write().map_err(|_| self.unusable())?;
                Ok(Python::with_gil(|py| f(py, &mut guard)))
            })
        });
        out.map_err(to_py)?
    }
}

/// Core work inside `Shared::with_read`/`with_write`, without the GIL; its panics are caught
/// (and poison a write lock) there.
pub(super) fn release<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    py.allow_threads(f).map_err(to_py)
}

/// An int argument's value (a Python int or anything with `__index__`, such as a NumPy
/// integer): a bool or a non-integer is a `TypeError`.
fn int_value(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
    let not_int = || {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        // PyO3 prefixes a TypeError from an argument's extraction with the argument's name.
        PyTypeError::new_err(format!("expected an int, not {ty}"))
    };
    if obj.is_instance_of::<PyBool>() {
        return Err(not_int());
    }
    obj.extract::<i128>().map_err(|e| {
        if e.is_instance_of::<PyTypeError>(obj.py()) {
            not_int()
        } else {
            PyValueError::new_err(format!("{name} is too large"))
        }
    })
}

/// A non-negative int argument as `usize`; a negative one, or one beyond `usize`, is a
/// `ValueError` that names the argument (no silent cast).
fn size(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let v = int_value(obj, name)?;
    if v < 0 {
        return Err(PyValueError::new_err(format!("{name} must be a non-negative int, got {v}")));
    }
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{name} = {v} is too large")))
}

/// Extractors of size arguments, for `#[pyo3(from_py_with = ...)]` (which passes the value
/// alone, so there is one function per argument name).
pub(super) mod sizes {
    use super::*;

    macro_rules! sizes {
        ($($name:ident),* $(,)?) => {
            $(
                pub(in crate::bindings) fn $name(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
                    size(obj, stringify!($name))
                }
            )*
        };
    }
    sizes!(dim, page_size, head, page, num_heads, capacity, successors, kv_heads, b, batch, itemsize);

    /// Counts that must be at least 1.
    macro_rules! counts {
        ($($name:ident),* $(,)?) => {
            $(
                pub(in crate::bindings) fn $name(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
                    match size(obj, stringify!($name))? {
                        0 => Err(PyValueError::new_err(concat!(stringify!($name), " must be at least 1, got 0"))),
                        v => Ok(v),
                    }
                }
            )*
        };
    }
    counts!(k, max_pages, refresh);

    /// Optional sizes: `None` passes through.
    macro_rules! optional_sizes {
        ($($name:ident),* $(,)?) => {
            $(
                pub(in crate::bindings) fn $name(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
                    if obj.is_none() { Ok(None) } else { size(obj, stringify!($name)).map(Some) }
                }
            )*
        };
    }
    optional_sizes!(num_simple, num_composite, threads);

    /// A seed: `None` or an int in `0..2**64`.
    pub(in crate::bindings) fn seed(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        if obj.is_none() {
            return Ok(None);
        }
        let v = int_value(obj, "seed")?;
        u64::try_from(v).map(Some).map_err(|_| PyValueError::new_err(format!("seed must be in 0..2**64, got {v}")))
    }

    /// A real number argument: an int or a float, not a bool (which Python would take as 0
    /// or 1) and not None; a `TypeError` that names the argument otherwise.
    fn real(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
        let not_number = || PyTypeError::new_err(format!("{name} must be a number, not {}", type_name(obj)));
        if obj.is_instance_of::<PyBool>() || obj.is_none() {
            return Err(not_number());
        }
        obj.extract::<f64>().map_err(|_| not_number())
    }

    fn type_name(obj: &Bound<'_, PyAny>) -> String {
        obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "this type".to_string())
    }

    /// Real-number arguments (their ranges are checked by the core).
    macro_rules! reals {
        ($($name:ident: $t:ty),* $(,)?) => {
            $(
                pub(in crate::bindings) fn $name(obj: &Bound<'_, PyAny>) -> PyResult<$t> {
                    real(obj, stringify!($name)).map(|v| v as $t)
                }
            )*
        };
    }
    reals!(effort: f32, target_recall: f64, min_effort: f32, max_effort: f32, scale: f32);

    /// Optional real numbers: `None` (the callee's default: each index's own effort, the
    /// scale `1/sqrt(d)`) passes through.
    macro_rules! optional_reals {
        ($($name:ident => $real:ident: $t:ty),* $(,)?) => {
            $(
                pub(in crate::bindings) fn $name(obj: &Bound<'_, PyAny>) -> PyResult<Option<$t>> {
                    if obj.is_none() { Ok(None) } else { $real(obj).map(Some) }
                }
            )*
        };
    }
    optional_reals!(optional_effort => effort: f32, optional_scale => scale: f32);

    /// `DCIIndex`'s `effort`: a number, or `"auto"` (`None` here: calibrate on the first query).
    pub(in crate::bindings) fn effort_or_auto(obj: &Bound<'_, PyAny>) -> PyResult<Option<f32>> {
        if let Ok(w) = obj.extract::<String>() {
            return if w == "auto" {
                Ok(None)
            } else {
                Err(PyValueError::new_err(format!("effort must be a number or \"auto\", not {w:?}")))
            };
        }
        real(obj, "effort")
            .map(|v| Some(v as f32))
            .map_err(|_| PyTypeError::new_err(format!("effort must be a number or \"auto\", not {}", type_name(obj))))
    }
}
