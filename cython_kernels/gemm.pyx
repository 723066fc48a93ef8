# distutils: language = c
"""Linear layer y = x @ W.T + b: the hot path of decode (small M) and prefill (large M).

One copy of the weights: the constructor reorders W [N, K] once, with oneDNN, into the layout
oneDNN's brgemm matmul itself picks under format_tag_any on AVX-512 (bf16: BA16a64b2a =
[ceil(N/64)][Kp/2][64][2], f32: BA16a64b = [ceil(N/64)][Kp][64]). Both paths read that buffer:
  - M <= small_m_max: our kernel (gemm_kernels.h) streams each 64-column block once for all M
    rows, OpenMP over blocks, AVX-512 vdpbf16ps / FMA;
  - larger M: a oneDNN matmul primitive (bf16 x bf16 -> f32, or f32), one per M, cached.
NOTE: the layout is what format_tag_any picks on AVX-512 for every M (probed: M = 1, 16, 512,
bf16 and f32, odd shapes), so prefill pays nothing for sharing it; and each 64-column block is
one contiguous stream of k-pair rows of 4 cache lines, exactly what a GEMV wants (M = 1 reached
the DRAM read probe's 61-64 GB/s on lm_head on a quiet Zen4). A second, "GEMV-friendly" copy
would only double the memory, so there is none. The tag is given explicitly (not "any"), so a
machine whose oneDNN would prefer another layout still shares this one (tests check the chosen
implementation is not a reference kernel).
Threads: OpenMP (set_num_threads / OMP_NUM_THREADS) for both paths; compute runs without the GIL.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport free

cnp.import_array()

include "arrays.pxi"

cdef extern from "dnnl.h" nogil:
    ctypedef int dnnl_status_t
    ctypedef void* dnnl_engine_t
    ctypedef void* dnnl_stream_t
    ctypedef void* dnnl_memory_t
    ctypedef void* dnnl_memory_desc_t
    ctypedef void* const_dnnl_memory_desc_t
    ctypedef void* dnnl_primitive_desc_t
    ctypedef void* dnnl_primitive_t
    ctypedef void* dnnl_primitive_attr_t
    ctypedef enum dnnl_engine_kind_t:
        dnnl_cpu
    ctypedef enum dnnl_stream_flags_t:
        dnnl_stream_default_flags
    ctypedef enum dnnl_data_type_t:
        dnnl_f32
        dnnl_bf16
    ctypedef enum dnnl_format_tag_t:
        dnnl_ab
        dnnl_ba
        dnnl_BA16a64b2a
        dnnl_BA16a64b
    ctypedef enum dnnl_query_t:
        dnnl_query_impl_info_str
        dnnl_query_padded_dims
    ctypedef struct dnnl_exec_arg_t:
        int arg
        dnnl_memory_t memory
    enum:
        dnnl_success
        DNNL_ARG_SRC
        DNNL_ARG_WEIGHTS
        DNNL_ARG_BIAS
        DNNL_ARG_DST
        DNNL_ARG_FROM
        DNNL_ARG_TO

    dnnl_status_t dnnl_engine_create(dnnl_engine_t* engine, dnnl_engine_kind_t kind, size_t index)
    dnnl_status_t dnnl_stream_create(dnnl_stream_t* stream, dnnl_engine_t engine, unsigned flags)
    dnnl_status_t dnnl_stream_wait(dnnl_stream_t stream)
    dnnl_status_t dnnl_memory_desc_create_with_tag(dnnl_memory_desc_t* md, int ndims,
                                                   const int64_t* dims, dnnl_data_type_t dt,
                                                   dnnl_format_tag_t tag)
    dnnl_status_t dnnl_memory_desc_destroy(dnnl_memory_desc_t md)
    size_t dnnl_memory_desc_get_size(const_dnnl_memory_desc_t md)
    dnnl_status_t dnnl_memory_desc_query(const_dnnl_memory_desc_t md, dnnl_query_t what,
                                         void* result)
    dnnl_status_t dnnl_memory_create(dnnl_memory_t* mem, const_dnnl_memory_desc_t md,
                                     dnnl_engine_t engine, void* handle)
    dnnl_status_t dnnl_memory_set_data_handle(dnnl_memory_t mem, void* handle)
    dnnl_status_t dnnl_memory_destroy(dnnl_memory_t mem)
    dnnl_status_t dnnl_matmul_primitive_desc_create(
        dnnl_primitive_desc_t* pd, dnnl_engine_t engine, const_dnnl_memory_desc_t src,
        const_dnnl_memory_desc_t weights, const_dnnl_memory_desc_t bias,
        const_dnnl_memory_desc_t dst, dnnl_primitive_attr_t attr)
    dnnl_status_t dnnl_reorder_primitive_desc_create(
        dnnl_primitive_desc_t* pd, const_dnnl_memory_desc_t src, dnnl_engine_t src_engine,
        const_dnnl_memory_desc_t dst, dnnl_engine_t dst_engine, dnnl_primitive_attr_t attr)
    dnnl_status_t dnnl_primitive_desc_query(dnnl_primitive_desc_t pd, dnnl_query_t what,
                                            int index, void* result)
    dnnl_status_t dnnl_primitive_desc_destroy(dnnl_primitive_desc_t pd)
    dnnl_status_t dnnl_primitive_create(dnnl_primitive_t* prim, dnnl_primitive_desc_t pd)
    dnnl_status_t dnnl_primitive_execute(dnnl_primitive_t prim, dnnl_stream_t stream, int nargs,
                                         const dnnl_exec_arg_t* args)
    dnnl_status_t dnnl_primitive_destroy(dnnl_primitive_t prim)

cdef extern from "gemm_kernels.h" nogil:
    enum:
        GEMM_MMAX
    int gemm_cpu_level()
    long gemm_pf_bytes
    void* gemm_alloc(size_t nbytes)
    void gemm_rows_to_bf16(const float* x, long m, long k, uint16_t* y, long ldy)
    void gemm_copy_rows(const float* src, long m, long n, float* dst, long ldd)
    int gemm_small_bf16(const uint16_t* w, long K, long N, long kp, const float* x, long M,
                        const float* bias, float* out, void* xs, int level, int whole_k)
    int gemm_small_f32(const float* w, long K, long N, long kp, const float* x, long M,
                       const float* bias, float* out, float* xs, int level, int whole_k)

# NOTE: at M = 16 the streaming kernel already runs at the FMA / vdpbf16ps peak of a Zen4 core
# (~220 bf16, ~100 f32 GFLOP/s per core with the weights in cache), so oneDNN cannot win much
# below that, and above it oneDNN's cache blocking of x wins. `bench_gemm.py --sweep` times both.
def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return False


# NOTE: measured crossovers (bench/bench_gemm.py --sweep and a Sapphire Rapids probe):
# without AMX the streaming kernel wins up to M = 16 (one core's FMA peak is reached there);
# with AMX oneDNN's brgemm:amx path is faster from M = 8 (at M = 16: 149 us vs 357 us on
# 896x9728 with 16 cores), so the streaming kernel keeps only M <= 4.
SMALL_M_MAX = 4 if _has_amx() else 16
_PRIM_CACHE_SIZE = 16

cdef int _level = gemm_cpu_level()
cdef dnnl_engine_t _engine = NULL
cdef dnnl_stream_t _stream = NULL


cdef int _check(dnnl_status_t st, str what) except -1:
    if st != dnnl_success:
        raise RuntimeError("oneDNN %s failed with status %d" % (what, st))
    return 0


cdef inline dnnl_status_t _execute(dnnl_primitive_t prim, int nargs,
                                   const dnnl_exec_arg_t* args) noexcept nogil:
    """Run a primitive on the stream and wait: the first failing status (checked by the caller
    once it holds the GIL), so no failure leaves an output silently unwritten."""
    cdef dnnl_status_t st = dnnl_primitive_execute(prim, _stream, nargs, args)
    if st != dnnl_success:
        return st
    return dnnl_stream_wait(_stream)


cdef void _init_dnnl() except *:
    global _engine, _stream
    if _engine == NULL:
        _check(dnnl_engine_create(&_engine, dnnl_cpu, 0), "engine_create")
        _check(dnnl_stream_create(&_stream, _engine, dnnl_stream_default_flags), "stream_create")


# NOTE: the thread count is numa_runtime._kernels.ops.set_num_threads: every extension shares
# one OpenMP runtime, and oneDNN (the gomp build) follows it.


def cpu_level():
    """2: AVX-512 BF16 dot products; 1: AVX-512F, bf16 widened in registers; 0: AVX2 + FMA."""
    return _level


def _set_prefetch(long nbytes):
    """Tests and benchmarks: the software prefetch distance of the bf16/f32 GEMV tiles in bytes
    (0: off; default 4096, gemm_avx512.h). Same results either way. Returns the old value."""
    global gemm_pf_bytes
    old = gemm_pf_bytes
    gemm_pf_bytes = nbytes
    return old


def _force_cpu_level(int level):
    """Tests only: use a lower kernel level than detected (returns the previous one)."""
    global _level
    old = _level
    _level = min(max(level, 0), gemm_cpu_level())
    return old


_DNNL_USABLE = {}


def _dnnl_usable(bint bf16):
    """Whether oneDNN has a non-reference matmul for this weight dtype on this CPU (decided
    once per process by building a small primitive). Without one (bf16 below AVX-512, or a
    `ref:` implementation) every M runs our own kernel."""
    ok = _DNNL_USABLE.get(bf16)
    if ok is None:
        probe = Linear(np.zeros((64, 64), dtype=np.uint16 if bf16 else np.float32))
        try:
            ok = "ref" not in probe.impl_info(32)
        except RuntimeError:
            ok = False
        _DNNL_USABLE[bf16] = ok
    return ok


cdef dnnl_memory_desc_t _md(int64_t d0, int64_t d1, dnnl_data_type_t dt,
                            dnnl_format_tag_t tag) except NULL:
    cdef dnnl_memory_desc_t md = NULL
    cdef int64_t dims[12]  # dnnl_dims_t: the API reads DNNL_MAX_NDIMS entries
    dims[0] = d0
    dims[1] = d1
    _check(dnnl_memory_desc_create_with_tag(&md, 2, dims, dt, tag), "memory_desc_create")
    return md


cdef class _Matmul:
    """A oneDNN matmul primitive for one M, with its src/dst memory objects (handles reset
    on every call)."""
    cdef dnnl_primitive_t prim
    cdef dnnl_memory_t src, dst, bias, weights
    cdef readonly str impl

    def __dealloc__(self):
        if self.prim != NULL:
            dnnl_primitive_destroy(self.prim)
        if self.weights != NULL:
            dnnl_memory_destroy(self.weights)
        if self.src != NULL:
            dnnl_memory_destroy(self.src)
        if self.dst != NULL:
            dnnl_memory_destroy(self.dst)
        if self.bias != NULL:
            dnnl_memory_destroy(self.bias)


cdef class Linear:
    """y = x @ W.T + b, same contract as numa_runtime.backend.reference.Linear.

    weight: [N, K] C-contiguous float32 or uint16 (bf16 bits); bias: None or float32 [N].
    bf16 weights: x is rounded to bf16 (nearest-even) and the products accumulate in f32.
    `nbytes` is the packed weight memory held (the only copy; K padded to 32 (bf16) or 16
    (f32), N to 64, with zeros). `small_m_max` picks the path: M <= it runs the streaming
    kernel, larger M oneDNN. forward() is not re-entrant on one object (shared scratch).
    """
    cdef readonly int in_features, out_features
    cdef readonly str dtype
    cdef readonly size_t nbytes
    cdef public int small_m_max
    # NOTE: rank_invariant: every output in one pass over k on our kernel whatever M (no oneDNN, no
    # split k), so that its bits do not depend on the thread count: ranks of different thread
    # counts (serve's reserved core) compute a replicated MoE router alike
    cdef public bint rank_invariant
    cdef void* w
    cdef long kp
    cdef bint bf16
    cdef dnnl_memory_desc_t wmd
    cdef dnnl_memory_t wmem
    cdef object bias_arr, xs_small, xs_big
    cdef dict prims

    def __cinit__(self):
        self.w = NULL
        self.wmd = NULL
        self.wmem = NULL

    def __init__(self, weight, bias=None):
        _init_dnnl()
        weight = np.asarray(weight)
        if weight.ndim != 2:
            raise ValueError("Linear weight must be 2-D [out_features, in_features], got shape %s"
                             % (weight.shape,))
        self.bf16 = weight.dtype == np.uint16
        weight = np.ascontiguousarray(weight, dtype=np.uint16 if self.bf16 else np.float32)
        self.out_features, self.in_features = weight.shape
        if self.out_features < 1 or self.in_features < 1:
            raise ValueError("Linear weight shape %s is empty" % (weight.shape,))
        self.dtype = "bfloat16" if self.bf16 else "float32"
        if bias is not None:
            bias = np.ascontiguousarray(bias, dtype=np.float32)
            if bias.shape != (self.out_features,):
                raise ValueError("Linear bias must have shape (%d,), got %s"
                                 % (self.out_features, bias.shape))
        self.bias_arr = bias
        self.small_m_max = SMALL_M_MAX
        self.prims = {}
        self._pack(weight)
        self.xs_small = np.zeros(GEMM_MMAX * self.kp, dtype=np.float32)  # [GEMM_MMAX, Kp]
        self.xs_big = np.zeros(0, dtype=np.uint16)                  # [M, K] bf16 x for oneDNN

    cdef _pack(self, cnp.ndarray weight):
        cdef int64_t K = self.in_features, N = self.out_features
        cdef dnnl_data_type_t dt = dnnl_bf16 if self.bf16 else dnnl_f32
        cdef dnnl_memory_desc_t src_md = NULL
        cdef dnnl_memory_t src_mem = NULL
        cdef dnnl_primitive_desc_t rpd = NULL
        cdef dnnl_primitive_t reorder = NULL
        cdef dnnl_exec_arg_t args[2]
        cdef dnnl_status_t st
        cdef int64_t* padded
        self.wmd = _md(K, N, dt, dnnl_BA16a64b2a if self.bf16 else dnnl_BA16a64b)
        self.nbytes = dnnl_memory_desc_get_size(self.wmd)
        _check(dnnl_memory_desc_query(self.wmd, dnnl_query_padded_dims, &padded), "md_query")
        self.kp = padded[0]
        if self.nbytes != <size_t>(padded[0] * padded[1] * (2 if self.bf16 else 4)):
            raise RuntimeError("unexpected oneDNN packed weight size %d" % self.nbytes)
        self.w = gemm_alloc(self.nbytes)
        if self.w == NULL:
            raise MemoryError("cannot allocate %d bytes of packed weights" % self.nbytes)
        try:
            # W [N, K] row-major is B = W^T [K, N] in "ba" order.
            src_md = _md(K, N, dt, dnnl_ba)
            _check(dnnl_memory_create(&src_mem, src_md, _engine, cnp.PyArray_DATA(weight)),
                   "memory_create")
            _check(dnnl_memory_create(&self.wmem, self.wmd, _engine, self.w), "memory_create")
            _check(dnnl_reorder_primitive_desc_create(&rpd, src_md, _engine, self.wmd, _engine,
                                                      NULL), "reorder_pd")
            _check(dnnl_primitive_create(&reorder, rpd), "reorder")
            args[0].arg = DNNL_ARG_FROM
            args[0].memory = src_mem
            args[1].arg = DNNL_ARG_TO
            args[1].memory = self.wmem
            with nogil:
                st = _execute(reorder, 2, args)
            _check(st, "weight reorder")
        finally:
            if reorder != NULL:
                dnnl_primitive_destroy(reorder)
            if rpd != NULL:
                dnnl_primitive_desc_destroy(rpd)
            if src_mem != NULL:
                dnnl_memory_destroy(src_mem)
            if src_md != NULL:
                dnnl_memory_desc_destroy(src_md)

    @property
    def data_ptr(self):
        """Address of the packed weights (numa.memory_report checks which node holds them)."""
        return <size_t>self.w

    def __dealloc__(self):
        if self.wmem != NULL:
            dnnl_memory_destroy(self.wmem)
        if self.wmd != NULL:
            dnnl_memory_desc_destroy(self.wmd)
        if self.w != NULL:
            free(self.w)

    def forward(self, x, out=None):
        """x: [M, K] f32 C-contiguous -> [M, N] f32 (into `out` when given, no allocation)."""
        cdef cnp.ndarray xa = x, oa
        cdef long M, K = self.in_features, N = self.out_features
        if not _is_c(xa, cnp.NPY_FLOAT32, 2) or xa.shape[1] != K:
            raise ValueError("Linear.forward expects x as C-contiguous float32 [M, %d], got %s %s"
                             % (K, xa.dtype, (<object>xa).shape))
        M = xa.shape[0]
        if out is None:
            oa = np.empty((M, N), dtype=np.float32)
        else:
            oa = out
            if not _is_c(oa, cnp.NPY_FLOAT32, 2) or oa.shape[0] != M or oa.shape[1] != N:
                raise ValueError("Linear.forward out must be C-contiguous float32 [%d, %d]"
                                 % (M, N))
        if M == 0:
            return oa
        if M <= self.small_m_max or self.rank_invariant or not _dnnl_usable(self.bf16):
            self._small(xa, oa, M)
        else:
            self._dnnl(xa, oa, M)
        return oa

    cdef _small(self, cnp.ndarray xa, cnp.ndarray oa, long M):
        cdef long K = self.in_features, N = self.out_features
        cdef const float* bias = NULL
        cdef const float* xp = <const float*>cnp.PyArray_DATA(xa)
        cdef float* op = <float*>cnp.PyArray_DATA(oa)
        cdef void* xs = cnp.PyArray_DATA(self.xs_small)
        if self.bias_arr is not None:
            bias = <const float*>cnp.PyArray_DATA(self.bias_arr)
        cdef int rc
        with nogil:
            if self.bf16:
                rc = gemm_small_bf16(<const uint16_t*>self.w, K, N, self.kp, xp, M, bias, op,
                                     xs, _level, self.rank_invariant)
            else:
                rc = gemm_small_f32(<const float*>self.w, K, N, self.kp, xp, M, bias, op,
                                    <float*>xs, _level, self.rank_invariant)
        if rc != 0:
            raise MemoryError("Linear.forward: cannot allocate split-k scratch")

    cdef _Matmul _prim(self, long M):
        cdef _Matmul p = self.prims.pop(M, None)
        if p is None:
            p = self._create_prim(M)
            if len(self.prims) >= _PRIM_CACHE_SIZE:
                del self.prims[next(iter(self.prims))]  # least recently used
        self.prims[M] = p
        return p

    cdef _Matmul _create_prim(self, long M):
        cdef long K = self.in_features, N = self.out_features
        cdef dnnl_data_type_t dt = dnnl_bf16 if self.bf16 else dnnl_f32
        cdef dnnl_memory_desc_t src_md = NULL, dst_md = NULL, bias_md = NULL
        cdef dnnl_primitive_desc_t pd = NULL
        cdef const char* impl = NULL
        cdef _Matmul p = _Matmul()
        try:
            src_md = _md(M, K, dt, dnnl_ab)
            dst_md = _md(M, N, dnnl_f32, dnnl_ab)
            if self.bias_arr is not None:
                bias_md = _md(1, N, dnnl_f32, dnnl_ab)
            _check(dnnl_matmul_primitive_desc_create(&pd, _engine, src_md, self.wmd, bias_md,
                                                     dst_md, NULL), "matmul_pd")
            _check(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl), "query")
            p.impl = impl.decode()
            _check(dnnl_primitive_create(&p.prim, pd), "matmul")
            _check(dnnl_memory_create(&p.src, src_md, _engine, NULL), "memory_create")
            _check(dnnl_memory_create(&p.dst, dst_md, _engine, NULL), "memory_create")
            if bias_md != NULL:
                _check(dnnl_memory_create(&p.bias, bias_md, _engine,
                                          cnp.PyArray_DATA(self.bias_arr)), "memory_create")
        finally:
            if pd != NULL:
                dnnl_primitive_desc_destroy(pd)
            if src_md != NULL:
                dnnl_memory_desc_destroy(src_md)
            if dst_md != NULL:
                dnnl_memory_desc_destroy(dst_md)
            if bias_md != NULL:
                dnnl_memory_desc_destroy(bias_md)
        return p

    cdef _dnnl(self, cnp.ndarray xa, cnp.ndarray oa, long M):
        cdef long K = self.in_features
        cdef _Matmul p = self._prim(M)
        cdef void* src = cnp.PyArray_DATA(xa)
        cdef dnnl_exec_arg_t args[4]
        cdef int nargs = 3
        if self.bf16:
            if self.xs_big.shape[0] < M * K:
                self.xs_big = np.empty(M * K, dtype=np.uint16)
            src = cnp.PyArray_DATA(self.xs_big)
        args[0].arg = DNNL_ARG_SRC
        args[0].memory = p.src
        args[1].arg = DNNL_ARG_WEIGHTS
        args[1].memory = self.wmem
        args[2].arg = DNNL_ARG_DST
        args[2].memory = p.dst
        if p.bias != NULL:
            args[3].arg = DNNL_ARG_BIAS
            args[3].memory = p.bias
            nargs = 4
        cdef void* dst = cnp.PyArray_DATA(oa)
        cdef dnnl_status_t st
        with nogil:
            if self.bf16:
                gemm_rows_to_bf16(<const float*>cnp.PyArray_DATA(xa), M, K, <uint16_t*>src, K)
            st = dnnl_memory_set_data_handle(p.src, src)
            if st == dnnl_success:
                st = dnnl_memory_set_data_handle(p.dst, dst)
            if st == dnnl_success:
                st = _execute(p.prim, nargs, args)
        _check(st, "matmul")

    def impl_info(self, long M):
        """oneDNN implementation name used for this M on the large-M path (e.g. brg:...)."""
        return self._prim(M).impl


cdef class BF16Panels:
    """out[:, n0:n0+n] = bf16(x) @ P (+ bias[n0:n0+n]) for weight panels P [K, n] that the caller
    writes in Linear's bf16 layout (BA16a64b2a = [ceil(n/64)][Kp/2][64][2], zero beyond K and
    n): the large-M path of quantized linears (qgemm.pyx), which dequantize their weights panel
    by panel into `panel_ptr` and run oneDNN's bf16 matmul (AMX or AVX-512 BF16) over each.

    set_input(x) rounds x [M, K] to bf16 once; run(out, n0, n, bias) multiplies it by the panel
    now in the buffer into columns n0..n0+n of out [M, N]. Primitives are cached per (M, n,
    bias). Not re-entrant.
    NOTE: oneDNN 2023.2 runs a matmul whose dst rows are strided (ldo > n) on its reference
    kernel (~1000x slower), so a panel narrower than out lands in a dense [M, n] buffer and is
    copied into out's columns (M n 4 bytes against 2 M n K flops).
    """
    cdef readonly long in_features, kp, max_cols
    cdef void* panel
    cdef object xs, tmp
    cdef long m
    cdef dict prims

    def __cinit__(self):
        self.panel = NULL

    def __init__(self, long in_features, long max_cols):
        cdef dnnl_memory_desc_t md
        cdef int64_t* padded
        _init_dnnl()
        if in_features < 1 or max_cols < 64 or max_cols % 64:
            raise ValueError("BF16Panels: in_features %d, max_cols %d (a multiple of 64)"
                             % (in_features, max_cols))
        md = _md(in_features, max_cols, dnnl_bf16, dnnl_BA16a64b2a)
        try:
            _check(dnnl_memory_desc_query(md, dnnl_query_padded_dims, &padded), "md_query")
            self.kp = padded[0]
        finally:
            dnnl_memory_desc_destroy(md)
        self.in_features, self.max_cols = in_features, max_cols
        self.panel = gemm_alloc(sizeof(uint16_t) * self.kp * max_cols)
        if self.panel == NULL:
            raise MemoryError("cannot allocate a %d x %d bf16 weight panel" % (self.kp, max_cols))
        self.xs = np.zeros(0, dtype=np.uint16)
        self.tmp = np.zeros(0, dtype=np.float32)
        self.m = 0
        self.prims = {}

    def __dealloc__(self):
        if self.panel != NULL:
            free(self.panel)

    @property
    def panel_ptr(self):
        return <size_t>self.panel

    def set_input(self, cnp.ndarray x):
        """x: C-contiguous float32 [M, in_features], rounded to bf16 for the next run() calls."""
        cdef long M = x.shape[0], K = self.in_features
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != K or not x.flags.c_contiguous:
            raise ValueError("BF16Panels.set_input expects C-contiguous float32 [M, %d]" % K)
        if self.xs.shape[0] < M * K:
            self.xs = np.empty(M * K, dtype=np.uint16)
        cdef uint16_t* xb = <uint16_t*>cnp.PyArray_DATA(self.xs)
        cdef const float* xp = <const float*>cnp.PyArray_DATA(x)
        with nogil:
            gemm_rows_to_bf16(xp, M, K, xb, K)
        self.m = M

    def run(self, cnp.ndarray out, long n0, long n, bias=None):
        """out[:, n0:n0+n] (=) input @ panel (+ bias[n0:n0+n]); out: C-contiguous float32 [M, N]."""
        cdef long M = self.m, N = out.shape[1]
        if out.dtype != np.float32 or out.ndim != 2 or out.shape[0] != M or \
                not out.flags.c_contiguous or n < 1 or n > self.max_cols or n0 < 0 or n0 + n > N:
            raise ValueError("BF16Panels.run: out must be C-contiguous float32 [%d, >= %d + %d]"
                             % (M, n0, n))
        key = (M, n, bias is not None)
        cdef _Matmul p = self.prims.get(key)
        if p is None:
            if len(self.prims) >= 4 * _PRIM_CACHE_SIZE:
                self.prims.clear()
            p = self.prims[key] = self._create_prim(M, n, bias is not None)
        cdef dnnl_exec_arg_t args[4]
        cdef int nargs = 3
        cdef bint dense = n == N
        cdef float* final = <float*>cnp.PyArray_DATA(out) + n0
        cdef char* dst = <char*>final
        if not dense:
            if self.tmp.shape[0] < M * n:
                self.tmp = np.empty(M * n, dtype=np.float32)
            dst = <char*>cnp.PyArray_DATA(self.tmp)
        cdef char* bp = NULL
        cdef void* src = cnp.PyArray_DATA(self.xs)
        if bias is not None:
            bp = <char*>cnp.PyArray_DATA(bias) + sizeof(float) * n0
        args[0].arg = DNNL_ARG_SRC
        args[0].memory = p.src
        args[1].arg = DNNL_ARG_WEIGHTS
        args[1].memory = p.weights
        args[2].arg = DNNL_ARG_DST
        args[2].memory = p.dst
        if bp != NULL:
            args[3].arg = DNNL_ARG_BIAS
            args[3].memory = p.bias
            nargs = 4
        cdef dnnl_status_t st
        with nogil:
            st = dnnl_memory_set_data_handle(p.src, src)
            if st == dnnl_success:
                st = dnnl_memory_set_data_handle(p.dst, dst)
            if st == dnnl_success and bp != NULL:
                st = dnnl_memory_set_data_handle(p.bias, bp)
            if st == dnnl_success:
                st = _execute(p.prim, nargs, args)
            if st == dnnl_success and not dense:
                gemm_copy_rows(<const float*>dst, M, n, final, N)
        _check(st, "matmul")

    def impl_info(self, long M, long n):
        return self._create_prim(M, n, False).impl

    cdef _Matmul _create_prim(self, long M, long n, bint bias):
        cdef long K = self.in_features
        cdef dnnl_memory_desc_t src_md = NULL, w_md = NULL, dst_md = NULL, bias_md = NULL
        cdef dnnl_primitive_desc_t pd = NULL
        cdef const char* impl = NULL
        cdef _Matmul p = _Matmul()
        try:
            src_md = _md(M, K, dnnl_bf16, dnnl_ab)
            w_md = _md(K, n, dnnl_bf16, dnnl_BA16a64b2a)
            dst_md = _md(M, n, dnnl_f32, dnnl_ab)
            if bias:
                bias_md = _md(1, n, dnnl_f32, dnnl_ab)
            _check(dnnl_matmul_primitive_desc_create(&pd, _engine, src_md, w_md, bias_md,
                                                     dst_md, NULL), "matmul_pd")
            _check(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl), "query")
            p.impl = impl.decode()
            if p.impl.startswith("ref"):
                raise RuntimeError("oneDNN offers only its reference bf16 matmul for a %d x %d x %d "
                                   "panel on this CPU" % (M, K, n))
            _check(dnnl_primitive_create(&p.prim, pd), "matmul")
            _check(dnnl_memory_create(&p.src, src_md, _engine, NULL), "memory_create")
            _check(dnnl_memory_create(&p.weights, w_md, _engine, self.panel), "memory_create")
            _check(dnnl_memory_create(&p.dst, dst_md, _engine, NULL), "memory_create")
            if bias:
                _check(dnnl_memory_create(&p.bias, bias_md, _engine, NULL), "memory_create")
        finally:
            if pd != NULL:
                dnnl_primitive_desc_destroy(pd)
            if src_md != NULL:
                dnnl_memory_desc_destroy(src_md)
            if w_md != NULL:
                dnnl_memory_desc_destroy(w_md)
            if dst_md != NULL:
                dnnl_memory_desc_destroy(dst_md)
            if bias_md != NULL:
                dnnl_memory_desc_destroy(bias_md)
        return p
