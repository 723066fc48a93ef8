# cython: language_level=3
"""Token sampling (greedy / temperature / top_k / top_p / min_p) and row log_softmax.

Semantics are reference.sample and reference.log_softmax. Rows of logits must be contiguous
(any row stride); per-row parameter arrays are converted to their dtypes if needed.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, int32_t

cnp.import_array()

cdef extern from "sampling_kernels.h":
    int nr_sample(const float *logits, int64_t ls, int64_t N, int64_t V, const float *temp,
                  const int32_t *top_k, const float *top_p, const float *min_p,
                  const double *uniform, int64_t *ids) nogil
    void nr_log_softmax(const float *x, int64_t xs, int64_t N, int64_t V, float *out,
                        int64_t os) nogil


cdef cnp.ndarray _rows(a, str name, bint writable=False):
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 2:
        raise TypeError("%s must be a [N, V] float32 array" % name)
    if (a.shape[1] > 1 and a.strides[1] != 4) or a.strides[0] % 4:
        raise ValueError("%s rows must be contiguous" % name)
    if writable and not a.flags.writeable:
        raise ValueError("%s must be writable" % name)
    return a


cdef cnp.ndarray _param(x, dtype, int64_t n, str name):
    cdef cnp.ndarray a = np.ascontiguousarray(x, dtype=dtype).reshape(-1)
    if a.shape[0] != n:
        raise ValueError("%s has %d entries for %d rows of logits" % (name, a.shape[0], n))
    return a


def sample(logits, temperature, top_k, top_p, min_p, uniform):
    """One token per row of logits [N, V] f32 with per-row temperature [N] f32 (0 = greedy,
    lowest index on ties), top_k [N] int32 (<= 0 off), top_p [N] f32 (1 off), min_p [N] f32
    (0 off), uniform [N] f64 in [0, 1). See reference.sample for the exact procedure.
    Returns [N] int64."""
    cdef cnp.ndarray x = _rows(logits, "logits")
    cdef int64_t N = x.shape[0], V = x.shape[1]
    cdef cnp.ndarray t = _param(temperature, np.float32, N, "temperature")
    cdef cnp.ndarray k = _param(top_k, np.int32, N, "top_k")
    cdef cnp.ndarray tp = _param(top_p, np.float32, N, "top_p")
    cdef cnp.ndarray mp = _param(min_p, np.float32, N, "min_p")
    cdef cnp.ndarray u = _param(uniform, np.float64, N, "uniform")
    cdef cnp.ndarray ids = np.empty(N, dtype=np.int64)
    if N == 0:
        return ids
    if V == 0:
        raise ValueError("sample: logits have no columns")
    cdef const float *px = <const float *>cnp.PyArray_DATA(x)
    cdef int64_t xs = x.strides[0] // 4
    cdef const float *pt = <const float *>cnp.PyArray_DATA(t)
    cdef const int32_t *pk = <const int32_t *>cnp.PyArray_DATA(k)
    cdef const float *ptp = <const float *>cnp.PyArray_DATA(tp)
    cdef const float *pmp = <const float *>cnp.PyArray_DATA(mp)
    cdef const double *pu = <const double *>cnp.PyArray_DATA(u)
    cdef int64_t *pids = <int64_t *>cnp.PyArray_DATA(ids)
    cdef int err
    with nogil:
        err = nr_sample(px, xs, N, V, pt, pk, ptp, pmp, pu, pids)
    if err:
        raise MemoryError("sample: no memory for a vocabulary of %d" % V)
    return ids


def log_softmax(logits, out):
    """Row-wise log-softmax in f32. logits, out: [N, V] (out may be logits)."""
    cdef cnp.ndarray x = _rows(logits, "logits")
    cdef cnp.ndarray o = _rows(out, "out", True)
    if o.shape[0] != x.shape[0] or o.shape[1] != x.shape[1]:
        raise ValueError("out %s must have the shape of logits %s" % (out.shape, logits.shape))
    cdef const float *px = <const float *>cnp.PyArray_DATA(x)
    cdef float *po = <float *>cnp.PyArray_DATA(o)
    cdef int64_t xs = x.strides[0] // 4, os_ = o.strides[0] // 4, N = x.shape[0], V = x.shape[1]
    if V == 0:
        return out
    with nogil:
        nr_log_softmax(px, xs, N, V, po, os_)
    return out
