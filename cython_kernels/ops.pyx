# cython: language_level=3
"""Elementwise and row ops: bf16 conversion, embedding, rms_norm, add_rms_norm, silu_and_mul,
add_, rotary. Semantics are those of numa_runtime.backend.reference (read its docstrings).

Layout contract: every array must be contiguous in its last dimension; rows (and, for
rotary, heads) may have any stride, so slices of a fused qkv buffer can be passed directly.
bf16 tensors are uint16 arrays of bf16 bits.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint16_t, uint64_t

cnp.import_array()

include "arrays.pxi"

cdef extern from "omp.h":
    void omp_set_num_threads(int n) nogil
    int omp_get_max_threads() nogil

cdef extern from "ops_kernels.h":
    void nr_f32_to_bf16_n(const float *x, uint16_t *y, int64_t n) nogil
    void nr_bf16_to_f32_n(const uint16_t *x, float *y, int64_t n) nogil
    void nr_embedding(const int64_t *ids, int64_t T, const void *table, int is_bf16,
                      int64_t ts, int64_t H, float *out, int64_t os) nogil
    void nr_rms_norm(const float *x, int64_t xs, const float *w, double eps, int64_t R,
                     int64_t H, float *out, int64_t os) nogil
    void nr_add_rms_norm(const float *x, int64_t xs, float *res, int64_t rs, const float *w,
                         double eps, int64_t R, int64_t H, float *out, int64_t os) nogil
    void nr_silu_and_mul(const float *x, int64_t xs, int64_t T, int64_t n_inter, float *out,
                         int64_t os) nogil
    void nr_add(float *a, int64_t as_, const float *b, int64_t bs, int64_t R, int64_t H) nogil
    void nr_rotary(float *x, int64_t T, int64_t H, int64_t st, int64_t sh, const int64_t *pos,
                   const float *cs, int64_t rot) nogil
    uint64_t nr_read_words(const uint64_t *p, int64_t n) nogil


def set_num_threads(int n):
    """Threads used by every OpenMP kernel of this process (all _kernels share one runtime)."""
    if n < 1:
        raise ValueError("set_num_threads needs n >= 1, got %d" % n)
    omp_set_num_threads(n)


def get_num_threads():
    return omp_get_max_threads()


def read_words(a):
    """The sum (mod 2**64) of a C-contiguous uint64 array, read on the OpenMP threads: the
    DRAM read probe of bench/limits.py (reads as the decode kernels read, every thread a
    contiguous share with vector loads)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.uint64 or a.ndim != 1 or not a.flags.c_contiguous:
        raise TypeError("read_words needs a 1-D C-contiguous uint64 array")
    cdef const uint64_t *p = <const uint64_t *>cnp.PyArray_DATA(a)
    cdef int64_t n = a.shape[0]
    cdef uint64_t s
    with nogil:
        s = nr_read_words(p, n)
    return s


cdef inline void *_ptr(cnp.ndarray a):
    return cnp.PyArray_DATA(a)


cdef cnp.ndarray _rows(a, str name, dtype, int typenum, bint writable=False):
    """A 2-D view [R, H] of `a` (last axis contiguous, any row stride), never a copy.
    `typenum` is `dtype`'s number (a 2-D array of it is returned as it is)."""
    if _is_rows(a, typenum, writable):
        return a
    if not isinstance(a, np.ndarray) or a.dtype != dtype:
        raise TypeError("%s must be a numpy array of %s, got %r"
                        % (name, np.dtype(dtype).name, getattr(a, "dtype", type(a))))
    if a.ndim == 1:
        a = a[None, :]
    elif a.ndim > 2:
        v = a.view()
        try:
            v.shape = (-1, a.shape[a.ndim - 1])
        except AttributeError:
            raise ValueError("%s: leading axes of a %d-D array must be collapsible without a "
                             "copy" % (name, a.ndim))
        a = v
    if a.ndim != 2 or (a.shape[1] > 1 and a.strides[1] != a.itemsize) \
            or a.strides[0] % a.itemsize:
        raise ValueError("%s must be contiguous in its last axis" % name)
    if writable and not a.flags.writeable:
        raise ValueError("%s must be writable" % name)
    return a


cdef inline int64_t _rs(cnp.ndarray a):
    return a.strides[0] // cnp.PyArray_ITEMSIZE(a)


def f32_to_bf16(x):
    """Round-to-nearest-even f32 -> bf16 bits (uint16), same shape. NaN -> 0x7FC0."""
    cdef cnp.ndarray xc = np.ascontiguousarray(x, dtype=np.float32)
    cdef cnp.ndarray y = np.empty_like(xc, dtype=np.uint16)
    cdef float *src = <float *>_ptr(xc)
    cdef uint16_t *dst = <uint16_t *>_ptr(y)
    cdef int64_t n = xc.size
    with nogil:
        nr_f32_to_bf16_n(src, dst, n)
    return y


def bf16_to_f32(x):
    """bf16 bits (uint16) -> f32, exact, same shape."""
    cdef cnp.ndarray xc = np.ascontiguousarray(x, dtype=np.uint16)
    cdef cnp.ndarray y = np.empty_like(xc, dtype=np.float32)
    cdef uint16_t *src = <uint16_t *>_ptr(xc)
    cdef float *dst = <float *>_ptr(y)
    cdef int64_t n = xc.size
    with nogil:
        nr_bf16_to_f32_n(src, dst, n)
    return y


def embedding(ids, table, out):
    """out[t] = table[ids[t]] as f32. ids: [T] int64, table: [V, H] f32|bf16, out: [T, H] f32.
    Negative ids count from the end (numpy indexing); others out of range raise IndexError."""
    cdef cnp.ndarray idc = _vector(ids, np.int64, cnp.NPY_INT64)
    cdef cnp.ndarray tb = _rows(table, "table", table.dtype,
                                cnp.PyArray_TYPE(table) if cnp.PyArray_Check(table) else -1)
    cdef int tn = cnp.PyArray_TYPE(tb)
    if tn != cnp.NPY_FLOAT32 and tn != cnp.NPY_UINT16 or not cnp.PyArray_ISNOTSWAPPED(tb):
        raise TypeError("table must be float32 or bf16 (uint16), got %s" % tb.dtype)
    cdef cnp.ndarray o = _rows(out, "out", np.float32, cnp.NPY_FLOAT32, True)
    cdef int64_t V = tb.shape[0], H = tb.shape[1], T = idc.shape[0], i, lo = 0, hi = -1
    if o.shape[0] != T or o.shape[1] != H:
        raise ValueError("out must be [%d, %d], got %s" % (T, H, out.shape))
    cdef const int64_t *pid = <const int64_t *>_ptr(idc)
    for i in range(T):  # the id range, without two numpy reductions
        if i == 0 or pid[i] < lo:
            lo = pid[i]
        if i == 0 or pid[i] > hi:
            hi = pid[i]
    if T and (lo < -V or hi >= V):
        raise IndexError("embedding: token id out of range for a vocabulary of %d" % V)
    if T and lo < 0:
        idc = np.where(idc < 0, idc + V, idc)
    cdef int is_bf16 = tn == cnp.NPY_UINT16
    cdef int64_t *pi = <int64_t *>_ptr(idc)
    cdef void *pt = _ptr(tb)
    cdef float *po = <float *>_ptr(o)
    cdef int64_t ts = _rs(tb), os_ = _rs(o)
    with nogil:
        nr_embedding(pi, T, pt, is_bf16, ts, H, po, os_)
    return out


cdef cnp.ndarray _vector(a, dtype, int typenum):
    """`a` as a contiguous 1-D array of `dtype` (converted only if it is not one already)."""
    if _is_c(a, typenum, 1):
        return a
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1)


cdef cnp.ndarray _weight(weight, int64_t H):
    if _is_c(weight, cnp.NPY_FLOAT32, 1) and (<cnp.ndarray>weight).shape[0] == H:
        return weight
    cdef cnp.ndarray w = np.asarray(weight)
    if w.dtype != np.float32:
        raise TypeError("norm weight must be float32 (convert bf16 weights once at load with "
                        "bf16_to_f32), got %s" % w.dtype)
    w = np.ascontiguousarray(w.reshape(-1))
    if w.shape[0] != H:
        raise ValueError("norm weight has %d elements for rows of %d" % (w.shape[0], H))
    return w


def rms_norm(x, weight, double eps, out):
    """out = x / sqrt(mean(x^2) + eps) * weight over the last axis. x, out: [R, H] f32."""
    cdef cnp.ndarray xr = _rows(x, "x", np.float32, cnp.NPY_FLOAT32)
    cdef cnp.ndarray o = _rows(out, "out", np.float32, cnp.NPY_FLOAT32, True)
    cdef int64_t R = xr.shape[0], H = xr.shape[1]
    if o.shape[0] != R or o.shape[1] != H:
        raise ValueError("out shape %s does not match x %s" % (out.shape, x.shape))
    cdef cnp.ndarray w = _weight(weight, H)
    cdef float *px = <float *>_ptr(xr)
    cdef float *pw = <float *>_ptr(w)
    cdef float *po = <float *>_ptr(o)
    cdef int64_t xs = _rs(xr), os_ = _rs(o)
    with nogil:
        nr_rms_norm(px, xs, pw, eps, R, H, po, os_)
    return out


def add_rms_norm(x, residual, weight, double eps, out):
    """residual += x (in place); out = rms_norm(residual). All [T, H] f32; out may be x."""
    cdef cnp.ndarray xr = _rows(x, "x", np.float32, cnp.NPY_FLOAT32)
    cdef cnp.ndarray r = _rows(residual, "residual", np.float32, cnp.NPY_FLOAT32, True)
    cdef cnp.ndarray o = _rows(out, "out", np.float32, cnp.NPY_FLOAT32, True)
    cdef int64_t R = xr.shape[0], H = xr.shape[1]
    if r.shape[0] != R or r.shape[1] != H or o.shape[0] != R or o.shape[1] != H:
        raise ValueError("x %s, residual %s and out %s must have one shape"
                         % (x.shape, residual.shape, out.shape))
    cdef cnp.ndarray w = _weight(weight, H)
    cdef float *px = <float *>_ptr(xr)
    cdef float *pr = <float *>_ptr(r)
    cdef float *pw = <float *>_ptr(w)
    cdef float *po = <float *>_ptr(o)
    cdef int64_t xs = _rs(xr), rs = _rs(r), os_ = _rs(o)
    with nogil:
        nr_add_rms_norm(px, xs, pr, rs, pw, eps, R, H, po, os_)
    return out


def silu_and_mul(x, out):
    """x: [T, 2*I] = [gate | up]; out: [T, I] = silu(gate) * up (f32)."""
    cdef cnp.ndarray xr = _rows(x, "x", np.float32, cnp.NPY_FLOAT32)
    cdef cnp.ndarray o = _rows(out, "out", np.float32, cnp.NPY_FLOAT32, True)
    cdef int64_t T = xr.shape[0], n_inter = xr.shape[1] // 2
    if o.shape[0] != T or o.shape[1] != n_inter:
        raise ValueError("out must be [%d, %d], got %s" % (T, n_inter, out.shape))
    cdef float *px = <float *>_ptr(xr)
    cdef float *po = <float *>_ptr(o)
    cdef int64_t xs = _rs(xr), os_ = _rs(o)
    with nogil:
        nr_silu_and_mul(px, xs, T, n_inter, po, os_)
    return out


def add_(a, b):
    """a += b, same shape f32 (b may broadcast only if it has a's shape)."""
    cdef cnp.ndarray ar = _rows(a, "a", np.float32, cnp.NPY_FLOAT32, True)
    cdef cnp.ndarray br = _rows(b, "b", np.float32, cnp.NPY_FLOAT32)
    if ar.shape[0] != br.shape[0] or ar.shape[1] != br.shape[1]:
        raise ValueError("add_: shapes %s and %s differ" % (a.shape, b.shape))
    cdef float *pa = <float *>_ptr(ar)
    cdef float *pb = <float *>_ptr(br)
    cdef int64_t as_ = _rs(ar), bs = _rs(br), R = ar.shape[0], H = ar.shape[1]
    with nogil:
        nr_add(pa, as_, pb, bs, R, H)
    return a


cdef _rotate(cnp.ndarray t, str name, cnp.ndarray pos, cnp.ndarray cs, int64_t rot):
    if not _is_thd(t, True):
        if t.dtype != np.float32 or t.ndim != 3:
            raise TypeError("%s must be a [T, H, D] float32 array" % name)
        if t.shape[2] > 1 and t.strides[2] != 4 or t.strides[0] % 4 or t.strides[1] % 4:
            raise ValueError("%s must be contiguous in its last axis" % name)
        if not t.flags.writeable:
            raise ValueError("%s must be writable" % name)
    if t.shape[0] != pos.shape[0]:
        raise ValueError("%s has %d tokens, positions %d" % (name, t.shape[0], pos.shape[0]))
    if rot > t.shape[2]:
        raise ValueError("rotary dim %d exceeds head dim %d" % (rot, t.shape[2]))
    cdef float *px = <float *>_ptr(t)
    cdef int64_t *pp = <int64_t *>_ptr(pos)
    cdef float *pc = <float *>_ptr(cs)
    cdef int64_t T = t.shape[0], H = t.shape[1], st = t.strides[0] // 4, sh = t.strides[1] // 4
    with nogil:
        nr_rotary(px, T, H, st, sh, pp, pc, rot)


def rotary(q, k, positions, cos_sin):
    """In-place neox-style rotary on q: [T, Hq, D] and k: [T, Hk, D] f32 (any token/head
    stride, last axis contiguous); positions: [T] int64 in [0, max_pos);
    cos_sin: [max_pos, rot_dim] f32 = [cos | sin]; dims past rot_dim are untouched."""
    cdef cnp.ndarray pos = _vector(positions, np.int64, cnp.NPY_INT64)
    cdef cnp.ndarray cs = cos_sin if _is_c(cos_sin, cnp.NPY_FLOAT32, 2) else \
        np.ascontiguousarray(cos_sin, dtype=np.float32)
    cdef int64_t rot = cs.shape[1], n = cs.shape[0], i
    cdef const int64_t *pp = <const int64_t *>_ptr(pos)
    for i in range(pos.shape[0]):
        if pp[i] < 0 or pp[i] >= n:
            raise IndexError("rotary: position out of range [0, %d)" % n)
    _rotate(q, "q", pos, cs, rot)
    _rotate(k, "k", pos, cs, rot)
