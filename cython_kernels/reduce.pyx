# cython: language_level=3
"""Sum reductions for tensor-parallel collectives (C in reduce_impl.h).

`reduce_sum(dst, srcs)` is the backend op (reference.py semantics, f32 or bf16 bits).
`shm_allreduce` and `flag_barrier` are the two primitives numa_runtime.distributed builds its
shared-memory collectives from; they take raw addresses inside an MPI shared window.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport malloc, free

cnp.import_array()

cdef extern from "reduce_impl.h" nogil:
    int NR_F32, NR_BF16
    void nr_reduce(void *dst, const void *const *srcs, int nsrc, int64_t n, int dtype)
    int nr_flag_barrier(int64_t *const *flags, int nranks, int rank, int64_t phase,
                        double timeout_s)
    int nr_shm_allreduce(void *x, int64_t n, int dtype, void *const *slots,
                         int64_t *const *flags, int nranks, int rank, int64_t phase0,
                         int small, double timeout_s)

MAX_RANKS = 256


cdef int _dtype_code(cnp.ndarray a) except -1:
    if a.dtype == np.float32:
        return NR_F32
    if a.dtype == np.uint16:
        return NR_BF16
    raise TypeError("reduce: expected float32 or bf16 bits (uint16), got %s" % a.dtype)


def reduce_sum(cnp.ndarray dst, srcs):
    """dst = sum(srcs) elementwise (f32, or bf16 bits accumulated in f32 and rounded once).

    All arrays C-contiguous with dst's dtype and size; dst may be one of srcs."""
    cdef int dtype = _dtype_code(dst)
    cdef int nsrc = len(srcs)
    cdef int64_t n = dst.size
    cdef cnp.ndarray s
    if not dst.flags.c_contiguous:
        raise ValueError("reduce_sum: dst must be C-contiguous")
    cdef const void **ptrs = <const void **>malloc(max(nsrc, 1) * sizeof(void *))
    if ptrs == NULL:
        raise MemoryError("reduce_sum: cannot allocate %d source pointers" % nsrc)
    try:
        for i in range(nsrc):
            s = srcs[i]
            if s.dtype != dst.dtype or s.size != n or not s.flags.c_contiguous:
                raise ValueError("reduce_sum: every source must be a C-contiguous %s array of "
                                 "%d elements" % (dst.dtype, n))
            ptrs[i] = cnp.PyArray_DATA(s)
        with nogil:
            nr_reduce(cnp.PyArray_DATA(dst), ptrs, nsrc, n, dtype)
    finally:
        free(ptrs)
    return dst


def flag_barrier(const uint64_t[::1] flag_addrs, int rank, int64_t phase, double timeout_s):
    """Set this rank's flag to `phase`, wait for every flag to reach it. 0 or -1-late_rank."""
    cdef int rc
    with nogil:
        rc = nr_flag_barrier(<int64_t *const *>&flag_addrs[0], <int>flag_addrs.shape[0],
                             rank, phase, timeout_s)
    return rc


def shm_allreduce(cnp.ndarray x, const uint64_t[::1] slot_addrs,
                  const uint64_t[::1] flag_addrs, int rank, int64_t phase0, bint small,
                  double timeout_s):
    """In-place sum of x (C-contiguous f32/bf16) over ranks through shared slots.

    Uses flag phases phase0 (small) or phase0, phase0+1. 0 or -1-late_rank."""
    cdef int dtype = _dtype_code(x)
    cdef int rc
    cdef int64_t n = x.size
    cdef void *data = cnp.PyArray_DATA(x)
    with nogil:
        rc = nr_shm_allreduce(data, n, dtype, <void *const *>&slot_addrs[0],
                              <int64_t *const *>&flag_addrs[0], <int>flag_addrs.shape[0],
                              rank, phase0, small, timeout_s)
    return rc
