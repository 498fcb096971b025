//! NumPy arrays in and out of the core: key arrays (f32, f16, bf16 as uint16), K/V stores read
//! or written in place, integer arrays range-checked into the core's types (never cast).

use half::{bf16, f16};
use numpy::ndarray::Array2;
use numpy::{
    Element, IntoPyArray, PyArray1, PyArray2, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::KeyData;

/// NumPy arrays handed back to Python.
pub(super) type NdArray1<'py, T> = Bound<'py, PyArray1<T>>;
pub(super) type NdArray2<'py, T> = Bound<'py, PyArray2<T>>;

/// `obj` as a NumPy array: arrays pass through; torch tensors and sequences are converted by
/// `icecache._arrays.as_numpy` (zero-copy for CPU tensors).
pub(super) fn numpy_of<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyUntypedArray>> {
    if let Ok(a) = obj.downcast::<PyUntypedArray>() {
        return Ok(a.clone());
    }
    let conv = obj.py().import("icecache._arrays")?.call_method1("as_numpy", (obj,))?;
    conv.downcast_into::<PyUntypedArray>().map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A `[rows, cols]` array from the core's row-major output.
pub(super) fn matrix<'py, T: Element>(
    py: Python<'py>,
    shape: (usize, usize),
    data: Vec<T>,
) -> PyResult<NdArray2<'py, T>> {
    let a = Array2::from_shape_vec(shape, data).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    Ok(a.into_pyarray(py))
}

/// A `[d0, d1, d2]` array from the core's row-major output.
pub(super) fn matrix3<'py, T: Element>(
    py: Python<'py>,
    shape: (usize, usize, usize),
    data: Vec<T>,
) -> PyResult<Bound<'py, numpy::PyArray3<T>>> {
    let a = numpy::ndarray::Array3::from_shape_vec(shape, data).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    Ok(a.into_pyarray(py))
}

/// A 2-D key array borrowed from NumPy: f32, f16, or bf16 given as uint16. C-contiguous arrays
/// are read in place; other layouts are copied. (The core copies what it keeps or validates.)
pub(super) enum Keys<'py> {
    F32(numpy::PyReadonlyArray2<'py, f32>),
    F16(numpy::PyReadonlyArray2<'py, f16>),
    U16(numpy::PyReadonlyArray2<'py, u16>),
    OwnedF32(Vec<f32>),
    OwnedF16(Vec<f16>),
    OwnedBf16(Vec<bf16>),
}

/// A read-only borrow of `a`, or a `ValueError` naming `what` if a running call writes it.
fn borrow_ro<'py, T: Element, D: numpy::ndarray::Dimension>(
    a: &Bound<'py, numpy::PyArray<T, D>>,
    what: &str,
) -> PyResult<numpy::PyReadonlyArray<'py, T, D>> {
    a.try_readonly().map_err(|_| in_use(what))
}

fn in_use(what: &str) -> PyErr {
    PyValueError::new_err(format!(
        "{what} conflicts with another use: an array a call writes may not be another of its arguments, nor be \
         read or written by another running call meanwhile; pass separate arrays (or wait for the other call)"
    ))
}

impl<'py> Keys<'py> {
    /// Reads a `[..., dim]` key array of `ndim` dimensions; returns it and its shape.
    pub fn extract_nd(
        obj: &Bound<'py, PyAny>,
        what: &str,
        dim: usize,
        ndim: usize,
    ) -> PyResult<(Keys<'py>, Vec<usize>)> {
        let arr = numpy_of(obj)?;
        if arr.ndim() != ndim {
            return Err(PyValueError::new_err(format!(
                "{what} must have {ndim} dimensions (last = {dim}), got {}",
                arr.ndim()
            )));
        }
        let shape = arr.shape().to_vec();
        let last = shape[ndim - 1];
        if dim != 0 && last != dim {
            return Err(PyValueError::new_err(format!("{what} has last dimension {last}, expected {dim}")));
        }
        let keys = if ndim == 2 {
            Keys::from_2d(arr.as_any(), what)?
        } else {
            Keys::from_2d(&arr.call_method1("reshape", (-1i64, last))?, what)?
        };
        Ok((keys, shape))
    }

    /// Reads a `[n, dim]` key array; returns it and `n`.
    pub fn extract(obj: &Bound<'py, PyAny>, what: &str, dim: usize) -> PyResult<(Keys<'py>, usize)> {
        let (keys, shape) = Keys::extract_nd(obj, what, dim, 2)?;
        Ok((keys, shape[0]))
    }

    fn from_2d(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Keys<'py>> {
        let arr = obj.downcast::<PyUntypedArray>()?;
        let contiguous = arr.is_c_contiguous();
        // Small blocks (one decode step's keys, one query) are copied under the GIL: cheaper
        // than registering a borrow, which dominates calls that take a few microseconds.
        let small = arr.len() <= 4096;
        let keys = if let Ok(a) = obj.downcast::<PyArray2<f32>>() {
            if contiguous && small {
                Keys::OwnedF32(a.to_vec()?)
            } else if contiguous {
                Keys::F32(borrow_ro(a, what)?)
            } else {
                Keys::OwnedF32(borrow_ro(a, what)?.as_array().iter().copied().collect())
            }
        } else if let Ok(a) = obj.downcast::<PyArray2<f16>>() {
            if contiguous {
                Keys::F16(borrow_ro(a, what)?)
            } else {
                Keys::OwnedF16(borrow_ro(a, what)?.as_array().iter().copied().collect())
            }
        } else if let Ok(a) = obj.downcast::<PyArray2<u16>>() {
            if contiguous {
                Keys::U16(borrow_ro(a, what)?)
            } else {
                Keys::OwnedBf16(borrow_ro(a, what)?.as_array().iter().map(|&b| bf16::from_bits(b)).collect())
            }
        } else {
            return Err(PyValueError::new_err(format!(
                "{what} must be float32, float16, or bfloat16 as a uint16 view, got {}; \
                 convert with .astype(np.float32)",
                arr.dtype()
            )));
        };
        Ok(keys)
    }

    pub fn data(&self) -> PyResult<KeyData<'_>> {
        Ok(match self {
            Keys::F32(a) => KeyData::F32(a.as_slice()?),
            Keys::F16(a) => KeyData::F16(a.as_slice()?),
            Keys::U16(a) => KeyData::Bf16(half::slice::HalfBitsSliceExt::reinterpret_cast(a.as_slice()?)),
            Keys::OwnedF32(f) => KeyData::F32(f),
            Keys::OwnedF16(h) => KeyData::F16(h),
            Keys::OwnedBf16(b) => KeyData::Bf16(b),
        })
    }
}

/// Point ids: a 1-D integer array that fits int64.
pub(super) fn extract_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    // The common case, an int64 array, without a round trip through Python.
    if let Ok(a) = obj.downcast::<PyArray1<i64>>() {
        if let Ok(v) = a.to_vec() {
            return Ok(v);
        }
    }
    let (ids, _) = ints::<i64>(obj, "ids", 1)?;
    Ok(ids)
}

/// An integer array of `ndim` dimensions and its shape, each value converted to `T` with a
/// range check: a value outside `T` is a `ValueError`, never a wrap-around.
pub(super) fn ints<T: TryFrom<i64>>(obj: &Bound<'_, PyAny>, what: &str, ndim: usize) -> PyResult<(Vec<T>, Vec<usize>)> {
    let py = obj.py();
    let arr = match obj.downcast::<PyUntypedArray>() {
        Ok(a) => a.clone(),
        Err(_) => py.import("numpy")?.call_method1("asarray", (obj,))?.downcast_into::<PyUntypedArray>()?,
    };
    let dtype = arr.dtype();
    let kind = dtype.kind();
    if kind != b'i' && kind != b'u' {
        return Err(PyValueError::new_err(format!("{what} must hold integers, got dtype {dtype}")));
    }
    if arr.ndim() != ndim {
        return Err(PyValueError::new_err(format!(
            "{what} must have {ndim} dimension(s), got shape {:?}",
            arr.shape()
        )));
    }
    let shape = arr.shape().to_vec();
    // Contiguous int64 and int32 arrays (what callers pass) are copied without registering a
    // borrow, which would cost more than the copy.
    let values: Vec<i64> = if let Ok(a) = arr.downcast::<PyArrayDyn<i64>>() {
        match a.to_vec() {
            Ok(v) => v,
            Err(_) => borrow_ro(a, what)?.as_array().iter().copied().collect(),
        }
    } else if let Ok(a) = arr.downcast::<PyArrayDyn<i32>>() {
        match a.to_vec() {
            Ok(v) => v.into_iter().map(i64::from).collect(),
            Err(_) => borrow_ro(a, what)?.as_array().iter().map(|&v| v as i64).collect(),
        }
    } else if let Ok(a) = arr.downcast::<PyArrayDyn<u64>>() {
        let a = borrow_ro(a, what)?;
        let mut out = Vec::with_capacity(a.len());
        for &v in a.as_array().iter() {
            out.push(i64::try_from(v).map_err(|_| out_of_range(what, v, "int64"))?);
        }
        out
    } else {
        // Any other integer type fits int64.
        let wide = arr.call_method1("astype", ("int64",))?;
        let wide: PyReadonlyArrayDyn<i64> = wide.extract()?;
        wide.as_array().iter().copied().collect()
    };
    let target = match std::any::type_name::<T>() {
        "i32" => "int32",
        "u32" => "uint32",
        other => other,
    };
    let mut out = Vec::with_capacity(values.len());
    for v in values {
        out.push(T::try_from(v).map_err(|_| out_of_range(what, v, target))?);
    }
    Ok((out, shape))
}

fn out_of_range(what: &str, v: impl std::fmt::Display, target: &str) -> PyErr {
    PyValueError::new_err(format!("{what} holds {v}, outside the range of {target}"))
}

/// Runs `$body` with `$T` bound to the element type of `$arr` (f32, f16, or u16 = bf16 bits).
macro_rules! with_elem {
    ($arr:expr, $what:expr, |$T:ident| $body:expr) => {{
        let a = $crate::bindings::arrays::numpy_of($arr)?;
        let dt = a.dtype();
        if dt.is_equiv_to(&numpy::dtype::<f32>(a.py())) {
            type $T = f32;
            $body
        } else if dt.is_equiv_to(&numpy::dtype::<half::f16>(a.py())) {
            type $T = half::f16;
            $body
        } else if dt.is_equiv_to(&numpy::dtype::<u16>(a.py())) {
            type $T = u16;
            $body
        } else {
            Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{} must be float32, float16, or bfloat16 as a uint16 view, got {dt}",
                $what
            )))
        }
    }};
}
pub(super) use with_elem;

/// An array of element `T` and its shape, read-only; copied to C order if it is not already.
pub(super) fn ro<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<(PyReadonlyArrayDyn<'py, T>, Vec<usize>)> {
    let mut a = numpy_of(obj)?;
    if !a.is_c_contiguous() {
        let np = a.py().import("numpy")?;
        a = np.call_method1("ascontiguousarray", (a,))?.downcast_into()?;
    }
    let arr = a.downcast::<PyArrayDyn<T>>().map_err(|_| {
        PyValueError::new_err(format!("{what} has dtype {}; all K/V arrays of a call must share one dtype", a.dtype()))
    })?;
    let shape = arr.shape().to_vec();
    Ok((borrow_ro(arr, what)?, shape))
}

/// A C-contiguous, writable array of element `T` and its shape.
pub(super) fn rw<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<(PyReadwriteArrayDyn<'py, T>, Vec<usize>)> {
    let a = numpy_of(obj)?;
    let arr = a.downcast::<PyArrayDyn<T>>().map_err(|_| {
        PyValueError::new_err(format!("{what} has dtype {}; all K/V arrays of a call must share one dtype", a.dtype()))
    })?;
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{what} must be C-contiguous")));
    }
    let shape = arr.shape().to_vec();
    let w = arr.try_readwrite().map_err(|e| match e {
        numpy::BorrowError::NotWriteable => PyValueError::new_err(format!("{what} is not writable")),
        _ => in_use(what),
    })?;
    Ok((w, shape))
}

/// `Err` unless `shape` matches `want` (`None` = any size).
pub(super) fn check_shape(what: &str, shape: &[usize], want: &[Option<usize>]) -> PyResult<()> {
    let ok = shape.len() == want.len() && shape.iter().zip(want).all(|(s, w)| w.is_none_or(|w| *s == w));
    if ok {
        return Ok(());
    }
    let w: Vec<String> = want.iter().map(|w| w.map_or("*".to_string(), |x| x.to_string())).collect();
    Err(PyValueError::new_err(format!("{what} has shape {shape:?}, expected [{}]", w.join(", "))))
}

/// Page ids and counts go back to Python as int32.
pub(super) fn to_i32(values: impl IntoIterator<Item = u32>, what: &str) -> PyResult<Vec<i32>> {
    values
        .into_iter()
        .map(|v| i32::try_from(v).map_err(|_| PyRuntimeError::new_err(format!("{what} {v} does not fit int32"))))
        .collect()
}
