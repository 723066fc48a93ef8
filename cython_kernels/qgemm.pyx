# distutils: language = c
"""Quantized linear layer y = x @ W.T + b over int8/int4 weights in groups (qgemm_kernels.h).

The weights arrive packed (numa_runtime/quant/packing.py: blocks of 16 output columns, each one
contiguous stream of groups = f16 scales [+ f16 offsets] + 64-byte rows of 32-bit lanes) and
are kept as that one copy. Both paths read it:
  - M <= 3 (AVX2) / 8 (AVX-512) rows: each block is streamed once, dequantized in registers
    (shift, mask, convert, one FMA with scale and offset) and multiplied into all rows (decode);
  - more rows: each block is dequantized chunk by chunk (256 k) into an f32 tile in L1 and an FMA
    register tile runs all rows over it (prefill).
Threads: OpenMP over 16-column blocks (set_num_threads); compute runs without the GIL.
Levels: 2 = AVX-512 with VNNI, 1 = AVX-512 (F/BW/VL/DQ), 0 = AVX2 + FMA + F16C, chosen at run
time (the f32 paths use AVX-512 at 1 and 2).

Linears flagged `act8` (the engine's dtype is bf16; f32 engines keep the exact path): decode
rows (M <= ACT8_M_MAX = 8) are quantized to int8 in blocks of 32 k (absmax / 127, as llama.cpp's
Q8 activations) and meet the packed weights in integer dot products (qgemm_q8.h: vpdpbusd with
VNNI, vpmaddubsw + vpmaddwd without): several times fewer instructions per weight byte than
dequantizing to f32, so decode stays bound by memory bandwidth on few cores. The kernel takes
any M (8 rows per pass over a weight block; on VNNI more rows run in register tiles of 8 rows,
qgemm_q8tile.h, and on AMX-INT8 in 16 x 16 matrix tiles, qgemm_amx.h, with bitwise the same
results). Prefill rows take it where the model sets
`prefill_act8` (EngineConfig.prefill_activations; see the NOTE at ACT8_M_MAX). With
`act8_residual` too (the lm_head), each row runs as two int8 rows, x and its rounding residual,
whose products are added: about 15 bits of activation for twice the integer work on the same
weight bytes (for a few rows in a step of prompt rows too: see _path). The numpy specification is numa_runtime.quant.reference.quantize_activations.

Large M on CPUs with AVX-512 BF16, for linears flagged `prefill_bf16` (the engine's dtype is
bf16): the dequantized weights are rounded to bf16, as the bf16 engine rounds its activations,
and multiplied on the matrix units. With AMX-BF16 (Sapphire Rapids and later) each thread
dequantizes its own columns into AMX tiles in its L2 and runs every row over them
(qgemm_amxbf16.h); elsewhere the weights are dequantized panel by panel (about 2 MiB of bf16 a
thread, in cache) into gemm.BF16Panels and multiplied by oneDNN's bf16 matmul. f32 engines keep
the exact f32 path. forward_silu takes the MLP's [gate | up] rows: on the AMX-BF16 tiles
silu(gate) * up is computed as x is rounded to bf16 (the model's down projection skips the
separate silu_and_mul), elsewhere silu_and_mul runs first.
"""
import threading

import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint16_t

from numa_runtime._kernels import gemm as _gemm
from numa_runtime._kernels import ops as _ops

cnp.import_array()

include "arrays.pxi"

cdef extern from "omp.h" nogil:
    int omp_get_max_threads()


cdef extern from "qgemm_kernels.h" nogil:
    ctypedef struct qg_format:
        int bits
        int kind
        long group
        long kp
        long n
        long ks
    int qg_cpu_level()
    long qg_block_bytes(const qg_format* f)
    int qg_forward(const uint8_t* w, const qg_format* f, const float* x, long M, long ldx,
                   const float* bias, float* out, int level)
    int qg_forward_q8(const uint8_t* w, const qg_format* f, const float* x, long M, long ldx,
                      const float* bias, float* out, int level, int resid)
    enum: QG_MR_Q8
    enum: QG_MR_AMX
    int qg_q8_tiles
    int qg_q8t_lean_on
    int qg_q8_lean_on
    int qg_q8t_lean_takes(const qg_format* f)
    long qg_pf_bytes
    int qg_amx
    int qg_amx_init()
    size_t qg_tiles_bytes(const qg_format* f, long Q)
    size_t qg_amx_rows_bytes(const qg_format* f, long Q)
    int qg_decode_step
    int qg_dequant_panel_bf16(const uint8_t* w, const qg_format* f, long K, long n0, long n1,
                              long kpp, uint16_t* panel)
    int qg_amxbf16
    int qg_amxbf16_init()
    size_t qg_amxbf16_bytes(const qg_format* f, long M, int nt)
    void qg_amxbf16_forward(const uint8_t* w, const qg_format* f, const float* x, long M, long K,
                            long ldx, const float* bias, float* out, long ldo, char* scratch,
                            int nthreads, int gated)

_KINDS = {"sym": 0, "zero": 1, "min": 2, "nl": 3}
cdef int _level = qg_cpu_level()
cdef int _amx_present = qg_amx_init()
qg_amx = _amx_present
cdef int _amxbf16_present = qg_amxbf16_init()
qg_amxbf16 = _amxbf16_present
# NOTE: decode rows (M <= 8) by default; longer prefills only with prefill_act8 (the model's
# prefill_activations="int8"). With every prefill linear in int8, SmolLM2-135M's perplexity rose
# 0.5% (18.30 to 18.40); with qkv_proj kept at bf16 precision (prefill_act8 = 2), 0.16%. Its
# greedy answer to "What is the capital of France?" is a near tie ("The" over "L" by 0.12
# logits) that int8 prefill flips on two ranks, so bf16 stays the engine's default.
cdef long _act8_m_max = QG_MR_Q8
ACT8_M_MAX = QG_MR_Q8


# NOTE: a step of decode rows only (set_decode_step) takes int8 activations up to this many rows:
# a decode batch. There the integer path beats both the f32 tile path (9..31 rows) and the bf16
# panels (32+), AMX included: 896 x 9728 int4 at 64 rows, SPR-16 (16 threads, AMX) 0.72 ms
# against 1.10 (f32) and 1.36 (panels); 2-core Zen 4 1.84 against 3.20 and 1.78.
ACT8_DECODE_M_MAX = 64


cdef inline bint _decode_rows(long M):
    """Rows the decode rule gives int8 activations (linears flagged act8): a few rows, or a
    decode batch in a step of decode rows only; none in a step of prompt rows only."""
    if qg_decode_step == 2:
        return False
    return M <= _act8_m_max or (qg_decode_step != 0 and M <= ACT8_DECODE_M_MAX)


def set_decode_step(int mode):
    """The model, before each step on its compute thread: 1 (True) when every row of the step
    is a decode row (one token of a running sequence), so a decode batch of up to
    ACT8_DECODE_M_MAX rows takes int8 activations; 2 when every row is a prompt row, and they
    keep exact activations however few they are (the NOTE at ACT8_M_MAX: a prompt's logits then
    do not switch path when the prefix cache held most of it); 0 (False): a mixed step, or not
    said, and a few rows take int8. Per thread: engines on other threads keep their own.
    Returns the old mode."""
    global qg_decode_step
    if mode not in (0, 1, 2):
        raise ValueError("set_decode_step takes 0, 1 or 2, got %d" % mode)
    old = qg_decode_step
    qg_decode_step = mode
    return old


def _set_act8_m_max(long m):
    """Tests and benchmarks: the most rows a linear flagged act8 quantizes (returns the old)."""
    global _act8_m_max
    old = _act8_m_max
    _act8_m_max = m
    return old

def has_amx():
    """Whether int8 activations of many rows run on AMX-INT8 matrix tiles (qgemm_amx.h): the
    CPU has AMX-INT8 and the kernel granted this process the tile state."""
    return _amx_present != 0


def _set_amx(bint on):
    """Tests and benchmarks: False runs many int8 rows on the VNNI row tiles even where AMX-INT8
    is present (bitwise the same results). Returns the old value; a no-op without AMX."""
    global qg_amx
    old = qg_amx != 0
    qg_amx = 1 if on and _amx_present else 0
    return old


def _set_prefetch(long nbytes):
    """Tests and benchmarks: the software prefetch distance of the int8-activation decode kernels
    in bytes (0: off; default 4096, qgemm_q8.h). Same results either way. Returns the old value."""
    global qg_pf_bytes
    old = qg_pf_bytes
    qg_pf_bytes = nbytes
    return old


def _set_q8t_lean(bint on):
    """Tests and benchmarks: False runs the row tiles of every format on the generic kernel
    (qg_q8t_vnni_mr) instead of the lean one of int4/int8 with f16 group scales (same results).
    Returns the old value."""
    global qg_q8t_lean_on
    old = qg_q8t_lean_on != 0
    qg_q8t_lean_on = 1 if on else 0
    return old


def _set_q8_lean(bint on):
    """Tests and benchmarks: False runs decode rows (up to QG_MR_Q8 a pass) of every format on the
    generic VNNI kernel (qg_q8_vnni_mr) instead of the lean one of int4/int8 with f16 group scales
    (qg_q8_lean_mr; same results). Returns the old value."""
    global qg_q8_lean_on
    old = qg_q8_lean_on != 0
    qg_q8_lean_on = 1 if on else 0
    return old


def _set_q8_tiles(bint on):
    """Tests and benchmarks: False runs int8 activations of more than ACT8_M_MAX rows on the
    decode kernel instead of row tiles (qgemm_q8tile.h; same results). Returns the old value."""
    global qg_q8_tiles
    old = qg_q8_tiles != 0
    qg_q8_tiles = 1 if on else 0
    return old


# NOTE: rows from which the bf16 panel path wins. Dequantizing a panel costs about 5 passes
# over the packed bytes, so it needs enough rows to share it.
PANEL_M_MIN = 32
# NOTE: a panel of about PANEL_BYTES_PER_THREAD per OpenMP thread (at least _PANEL_MIN_BYTES): each
# thread's share stays in its L2 between the dequantization and the matmul, and the panels are
# few enough that oneDNN's calls stay large. M = 512 on Qwen2.5-0.5B's linears (bench_quant.py
# --bf16-prefill --panel-mib): SPR-16, 16 threads: 8 MiB panels 1.0-1.45x as fast as 2 MiB; a
# 2-core Zen 4: 2 MiB as fast as or faster than 8 MiB.
PANEL_BYTES_PER_THREAD = 1 << 19
_PANEL_MIN_BYTES = 1 << 21
_PANEL_BYTES = None  # benchmarks: a fixed panel size instead of the rule above
_PANELS = {}


def _panel_bytes():
    if _PANEL_BYTES is not None:
        return _PANEL_BYTES
    return max(_PANEL_MIN_BYTES, PANEL_BYTES_PER_THREAD * omp_get_max_threads())


def _panel_usable():
    """The bf16 panel path needs AVX-512 BF16 (conversion) and a non-reference oneDNN bf16 matmul."""
    return _level >= 1 and _gemm.cpu_level() >= 2 and _gemm._dnnl_usable(True)


def _panels(long K, long N):
    """The shared panel buffer for K input features: columns per panel so that one panel is
    about _panel_bytes() (a multiple of 64, at least 64, at most N rounded up)."""
    cols = max(64, min((N + 63) // 64 * 64, _panel_bytes() // (2 * ((K + 31) // 32 * 32)) // 64 * 64))
    p = _PANELS.get((K, cols))
    if p is None:
        p = _PANELS[(K, cols)] = _gemm.BF16Panels(K, cols)
    return p




_SCRATCH = threading.local()


def _scratch(size_t nbytes):
    """This thread's scratch bytes for the AMX-BF16 prefill (kept and grown, so that a prefill's
    linears do not map fresh pages on every call; per thread, as engines on other threads run
    their own linears concurrently)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.shape[0] < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf


def has_amx_bf16():
    """Whether prefill rows over quantized weights run on AMX-BF16 tiles (qgemm_amxbf16.h): the
    CPU has AMX-BF16 and AVX512-BF16 and the tile state was granted."""
    return _amxbf16_present != 0


def _set_amx_bf16(bint on):
    """Tests and benchmarks: False runs the bf16 prefill on oneDNN panels even where AMX-BF16 is
    present (the same products, other f32 summation order). Returns the old value."""
    global qg_amxbf16
    old = qg_amxbf16 != 0
    qg_amxbf16 = 1 if on and _amxbf16_present else 0
    return old


def prefill_int8_wins():
    """Whether a prefill over quantized weights runs faster on int8 activations than on bf16
    weights: AVX-512 VNNI (row tiles) without AMX-BF16. The `bench_llamacpp.py --prefill-int8`
    rows of bench/RESULTS.md: on 2-core Zen 4 the int8 prefill beat the oneDNN bf16 panels; on
    SPR-16 the int8 prefill on AMX-INT8 tiles did not beat the panels, and the AMX-BF16 tiles
    (qgemm_amxbf16.h) later beat both there and on the 2-core Sapphire Rapids-class VM. Below
    VNNI the int8 path was not measured faster."""
    return _level >= 2 and _amxbf16_present == 0


def cpu_level():
    """2: AVX-512 with VNNI, 1: AVX-512 kernels, 0: AVX2 + FMA + F16C."""
    return _level


def _force_cpu_level(int level):
    """Tests only: use a lower kernel level than detected (returns the previous one)."""
    global _level
    old = _level
    _level = min(max(level, 0), qg_cpu_level())
    return old


cdef class QLinear:
    """y = x @ W.T + b, the contract of numa_runtime.backend.reference.Linear, for a quantized W.

    packed: uint8 stream from numa_runtime.quant.packing.pack; bits 2|3|4|5|6|8; kind 'sym'|'zero'|'min'|'nl' (int4);
    group: k per group (the padded in_features for per-row int8); bias None or f32 [N]; ks: k per
    super-block of int8 sub-scales (GGUF K-quants: 256), 0 for f16 group scales.
    `nbytes` is the packed weight memory held (the only copy).
    """
    cdef readonly int in_features, out_features, bits, group
    cdef readonly str kind
    cdef readonly size_t nbytes
    cdef qg_format fmt
    cdef object packed, bias_arr
    cdef public bint prefill_bf16
    cdef public bint act8
    cdef public bint act8_residual
    # Rows beyond the decode rule: 0 the exact f32 path or the bf16 panels; 1 int8 activations;
    # 2 at least bf16's precision: the bf16 panels where usable, else int8 activations as two rows
    # (x and its rounding residual, about 15 bits, as act8_residual)
    cdef public int prefill_act8

    def __init__(self, packed, int bits, str kind, int group, int in_features, int out_features,
                 bias=None, int ks=0):
        if bits not in (2, 3, 4, 5, 6, 8) or kind not in _KINDS or (bits == 8 and kind != "sym") or (kind == "nl" and bits != 4):
            raise ValueError("QLinear: unsupported format bits=%d kind=%r" % (bits, kind))
        if ks and (ks != 256 or bits == 8 or kind == "zero" or ks % group or in_features % ks
                   or (bits == 2 and kind != "min")):
            raise ValueError("QLinear: super-block scales (ks=%d) need int2-6 sym, min or nl groups (int2: min) "
                             "dividing 256 and in_features a multiple of 256" % ks)
        pk = {2: 16, 3: 16, 4: 8, 8: 4, 5: 32, 6: 16}[bits]  # k per packed unit (qg_pack_k)
        kp = (in_features + pk - 1) // pk * pk  # NOTE: C division (cdivision)
        if group < pk or group % pk or kp % group or out_features < 1:
            raise ValueError("QLinear: group %d does not tile in_features %d" % (group, in_features))
        self.fmt.bits, self.fmt.kind, self.fmt.group = bits, _KINDS[kind], group
        self.fmt.kp, self.fmt.n, self.fmt.ks = kp, out_features, ks
        packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
        nblocks = (out_features + 15) // 16
        if packed.shape[0] != nblocks * qg_block_bytes(&self.fmt):
            raise ValueError("QLinear: packed weights have %d bytes, the format needs %d"
                             % (packed.shape[0], nblocks * qg_block_bytes(&self.fmt)))
        if bias is not None:
            bias = np.ascontiguousarray(bias, dtype=np.float32)
            if bias.shape != (out_features,):
                raise ValueError("QLinear bias must have shape (%d,), got %s"
                                 % (out_features, bias.shape))
        self.packed, self.bias_arr = packed, bias
        self.in_features, self.out_features, self.bits, self.group = in_features, out_features, bits, group
        self.kind = kind
        self.nbytes = packed.nbytes

    @property
    def dtype(self):
        return "int%d" % self.bits

    @property
    def lean_tiles(self):
        """Whether decode rows and row tiles of this format run the lean kernels (qgemm_q8.h
        qg_q8_lean_mr, qgemm_q8tile.h qg_q8t_lean_mr; _set_q8_lean, _set_q8t_lean)."""
        return qg_q8t_lean_takes(&self.fmt) != 0

    @property
    def packed_k(self):
        """in_features rounded up to the packing unit (zero-padded k; FusedDecoder takes none)."""
        return self.fmt.kp

    @property
    def ks(self):
        """k per super-block of int8 sub-scales (256), or 0 for f16 group scales."""
        return self.fmt.ks

    def forward(self, x, out=None):
        """x: [M, K] f32 C-contiguous -> [M, N] f32 (into `out` when given)."""
        return self._forward(x, out, False)

    def fuses_silu(self, long M):
        """Whether forward_silu of M rows runs silu_and_mul inside the kernel (the AMX-BF16
        prefill tiles: silu(gate) * up is computed as x is rounded to bf16, so the [M, K]
        product never goes through memory); elsewhere it computes it first, as the model would."""
        return self._path(M) == 2

    def forward_silu(self, x2, out=None):
        """x2: [M, 2 K] f32 C-contiguous, gate then up -> (silu(gate) * up) @ W.T + b [M, N]."""
        cdef cnp.ndarray xa = x2
        cdef long K = self.in_features
        if not _is_c(xa, cnp.NPY_FLOAT32, 2) or xa.shape[1] != 2 * K:
            raise ValueError("QLinear.forward_silu expects x as C-contiguous float32 [M, %d], got %s %s"
                             % (2 * K, xa.dtype, (<object>xa).shape))
        if self._path(xa.shape[0]) == 2:
            return self._forward(xa, out, True)
        act = np.empty((xa.shape[0], K), dtype=np.float32)
        _ops.silu_and_mul(xa, act)
        return self._forward(act, out, False)

    cdef int _path(self, long M):
        """0: the f32 paths (exact), 1: int8 activations, 2: AMX-BF16 tiles, 3: bf16 panels."""
        cdef bint decode_rows = _decode_rows(M)
        # NOTE: the lm_head (act8_residual) takes its two int8 rows for a few rows in a step of
        # prompt rows too: its rows there are the prompts' last ones, one per prompt, so a
        # prompt's logits still do not depend on how much of it the prefix cache held (only on
        # whether more than ACT8_M_MAX prompts end in its step), and a step of a few prompt rows
        # does not dequantize the whole vocabulary into bf16 tiles for one row
        cdef bint q8 = self.act8 and (decode_rows or (self.act8_residual and M <= _act8_m_max))
        # NOTE: the rows of a step of prompt rows only take the bf16 path however few they are:
        # a prompt's logits must not switch path when the prefix cache held most of it
        cdef bint wide = M >= PANEL_M_MIN or qg_decode_step == 2
        # NOTE: AMX comes with VNNI: a level forced below it (tests, bench_isa_context) runs no tiles
        cdef bint tiles = self.prefill_bf16 and wide and qg_amxbf16 != 0 and _level >= 2
        cdef bint panels = tiles or (self.prefill_bf16 and wide and _panel_usable())
        if not decode_rows and self.prefill_act8 and not (self.prefill_act8 == 2 and panels):
            q8 = True
        if q8:
            return 1
        return 2 if tiles else 3 if panels else 0

    cdef _forward(self, cnp.ndarray xa, object out, bint gated):
        cdef cnp.ndarray oa
        cdef long M, K = self.in_features, N = self.out_features
        if not gated and (not _is_c(xa, cnp.NPY_FLOAT32, 2) or xa.shape[1] != K):
            raise ValueError("QLinear.forward expects x as C-contiguous float32 [M, %d], got %s %s"
                             % (K, xa.dtype, (<object>xa).shape))
        M = xa.shape[0]
        if out is None:
            oa = np.empty((M, N), dtype=np.float32)
        else:
            oa = out
            if not _is_c(oa, cnp.NPY_FLOAT32, 2) or oa.shape[0] != M or oa.shape[1] != N:
                raise ValueError("QLinear.forward out must be C-contiguous float32 [%d, %d]"
                                 % (M, N))
        if M == 0:
            return oa
        cdef int path = self._path(M)
        cdef bint q8 = path == 1, tiles = path == 2
        cdef int resid = self.act8_residual
        if q8 and not _decode_rows(M):  # prefill rows in int8 (prefill_act8)
            resid = resid or self.prefill_act8 == 2
        if path == 3:
            self._panel_forward(xa, oa)
            return oa
        cdef int nt = omp_get_max_threads()
        cdef char* sp = NULL
        if tiles:  # x as it is (the kernel zero-pads its bf16 copy)
            sp = <char*>cnp.PyArray_DATA(_scratch(qg_amxbf16_bytes(&self.fmt, M, nt)))
        elif self.fmt.kp != K:  # per-row int8 with K not a multiple of 4: zero-padded rows
            xa = np.pad(xa, ((0, 0), (0, self.fmt.kp - K)))
        cdef const float* bias = NULL
        if self.bias_arr is not None:
            bias = <const float*>cnp.PyArray_DATA(self.bias_arr)
        cdef const uint8_t* w = <const uint8_t*>cnp.PyArray_DATA(self.packed)
        cdef const float* xp = <const float*>cnp.PyArray_DATA(xa)
        cdef float* op = <float*>cnp.PyArray_DATA(oa)
        cdef long ldx = self.fmt.kp, ldx_t = 2 * K if gated else K
        cdef int rc = 0
        with nogil:
            if tiles:
                qg_amxbf16_forward(w, &self.fmt, xp, M, K, ldx_t, bias, op, N, sp, nt, gated)
            elif q8:
                rc = qg_forward_q8(w, &self.fmt, xp, M, ldx, bias, op, _level, resid)
            else:
                rc = qg_forward(w, &self.fmt, xp, M, ldx, bias, op, _level)
        if rc != 0:
            raise MemoryError("QLinear.forward: cannot allocate per-thread tiles")
        return oa

    cdef _panel_forward(self, cnp.ndarray xa, cnp.ndarray oa):
        cdef long K = self.in_features, N = self.out_features, n0, n, kpp
        cdef const uint8_t* w = <const uint8_t*>cnp.PyArray_DATA(self.packed)
        cdef uint16_t* panel
        cdef int rc
        p = _panels(K, N)
        panel, kpp = <uint16_t*><size_t>p.panel_ptr, p.kp
        p.set_input(xa)
        for n0 in range(0, N, p.max_cols):
            n = min(p.max_cols, N - n0)
            with nogil:
                rc = qg_dequant_panel_bf16(w, &self.fmt, K, n0, n0 + n, kpp, panel)
            if rc != 0:
                raise MemoryError("QLinear.forward: cannot allocate per-thread tiles")
            p.run(oa, n0, n, self.bias_arr)


include "decode.pxi"
include "moe.pxi"
