# Fast argument checks of the kernel wrappers (`include "arrays.pxi"` after `cimport numpy as cnp`).
#
# Each answers, through the numpy C API and without a Python attribute lookup, whether an
# argument is already in the form a kernel takes. A wrapper takes its kernel's pointers directly
# when the answer is yes and otherwise runs its full checks (views, conversions, the error
# messages), so the answer only decides how fast a call is, never what it accepts. Decode calls
# every wrapper about ten times per layer, where the Python-level checks cost microseconds.

cdef inline bint _is_array(object a, int typenum):
    """a is an ndarray of `typenum` (cnp.NPY_FLOAT32, ...) in native byte order."""
    return (cnp.PyArray_Check(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == typenum
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>a))


cdef inline bint _is_rows(object a, int typenum, bint writable):
    """a is [R, H] of `typenum`, contiguous in its last axis, rows at any stride (a multiple
    of the item size), and writable if asked."""
    if not _is_array(a, typenum):
        return False
    cdef cnp.ndarray x = <cnp.ndarray>a
    if x.ndim != 2:
        return False
    cdef cnp.npy_intp item = cnp.PyArray_ITEMSIZE(x)
    if (x.shape[1] > 1 and x.strides[1] != item) or x.strides[0] % item:
        return False
    return not writable or cnp.PyArray_ISWRITEABLE(x)


cdef inline bint _is_thd(object a, bint writable):
    """a is [T, H, D] float32, contiguous in its last axis, tokens and heads at any stride (a
    multiple of 4 bytes), and writable if asked."""
    if not _is_array(a, cnp.NPY_FLOAT32):
        return False
    cdef cnp.ndarray x = <cnp.ndarray>a
    if x.ndim != 3:
        return False
    # NOTE: an empty array's strides may be 0 (numpy 2.4): nothing is read from it
    if cnp.PyArray_SIZE(x) and ((x.shape[2] > 1 and x.strides[2] != 4) or x.strides[0] % 4 or x.strides[1] % 4):
        return False
    return not writable or cnp.PyArray_ISWRITEABLE(x)


cdef inline bint _is_c(object a, int typenum, int ndim):
    """a is a C-contiguous `ndim`-D array of `typenum`."""
    return (_is_array(a, typenum) and (<cnp.ndarray>a).ndim == ndim
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a))


cdef cnp.ndarray _int_array(a, dtype, int typenum, int ndim):
    """`a` as a C-contiguous array of `dtype` (converted only if it is not one already); 1-D
    when ndim is 1."""
    if _is_c(a, typenum, ndim):
        return a
    a = np.ascontiguousarray(a, dtype=dtype)
    return a.reshape(-1) if ndim == 1 else a
