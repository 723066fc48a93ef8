# FusedDecoder: decode steps of a quantized decoder in one OpenMP region (decode_layers.h).
# Included by qgemm.pyx, whose QLinear internals (packed weights, format, bias) it reads.
from libc.stdint cimport int8_t, int32_t, int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from numa_runtime._kernels import attention as _attention

cdef extern from "decode_layers.h" nogil:
    enum: ND_MAX_PARTS
    int nr_amx  # this module's copy of attention_amx.h's switch (set from attention's each step)
    long nd_amx_gemvs
    ctypedef struct nd_linear:
        int nparts
        const uint8_t* w[ND_MAX_PARTS]
        qg_format f[ND_MAX_PARTS]
        long n
        const float* bias
        int bias_after
    ctypedef struct nd_layer:
        nd_linear qkv, o, gu, down
        const float* in_norm
        const float* post_norm
        const float* q_norm
        const float* k_norm
        void* kc
        void* vc
        int64_t window
    ctypedef struct nd_head:
        const float* norm
        const uint8_t* w
        qg_format f
        const float* bias
        int resid
    ctypedef struct nd_model:
        int64_t H, D, Hq, Hk, inter
        double eps
        int kv_type
        int64_t nb, bs
        float scale
        const float* cos_sin
        int64_t rot
        const nd_layer* layers
        const nd_head* head
    ctypedef struct nd_step:
        int64_t M
        const int64_t* pos
        const int64_t* slots
        const int32_t* bt
        const int32_t* qstart
        const int32_t* ctx
        int64_t bt_st
        float* residual
        float* h
        float* qkv
        float* attn
        float* o
        float* gu
        float* act
        float* delta
        int8_t* xq
        float* sx
        float* xs
        float* part
        int32_t* xi
        float* part2
        char* tiles
        int qg_level, attn_level
        int64_t tiled_min
        int barrier
        int redundant
        int64_t nlog, vocab
        const int64_t* lidx
        float* logits
        int64_t* amax
    int nd_run(const nd_model* m, const nd_step* st, int64_t s0, int64_t s1)
    long nd_pf_wait
    int nd_rope_items
    enum: QG_MAX_SLICES
    long qg_blocks_per_group(const qg_format* f)

_KV_CACHE_TYPES = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.int8): 2}  # nr_kv_type
_BARRIERS = {"auto": 0, "own": 1, "omp": 2}
cdef int _barrier = 0
_REDUNDANT = {"auto": 0, "on": 1, "off": 2}
cdef int _redundant = 0


def _force_barrier(str kind):
    """Tests: the barrier of FusedDecoder's region: "auto" (ours, libgomp's when the team
    outnumbers the cpus), "own" (ours always: spin, then sleep on a futex) or "omp"; returns
    the previous kind."""
    global _barrier
    old = [k for k, v in _BARRIERS.items() if v == _barrier][0]
    _barrier = _BARRIERS[kind]
    return old


def _set_wait_prefetch(long nbytes):
    """Tests and benchmarks: the bytes of its share of the next GEMV's weights that a thread of
    FusedDecoder's region prefetches while it waits at a barrier (0: off; default 131072,
    decode_layers.h nd_pf_wait). Same results either way. Returns the old value."""
    global nd_pf_wait
    old = nd_pf_wait
    nd_pf_wait = nbytes
    return old


def _set_rope_in_items(bint on):
    """Tests and benchmarks: whether each attention item of FusedDecoder's region rotates its own
    queries and writes its newest key and value into the cache (one barrier a layer fewer,
    decode_layers.h nd_item_rope) instead of a phase of its own before the items (default on).
    Same results either way. Returns the old setting."""
    global nd_rope_items
    old = nd_rope_items != 0
    nd_rope_items = 1 if on else 0
    return old


def _force_redundant(str mode):
    """Tests: whether FusedDecoder's small steps run redundant (every thread computes the norms
    and int8 roundings of GEMV inputs itself instead of a barrier after a share of the rows,
    decode_layers.h nd_red_ok): "auto", "on" (whenever the rows fit one pass, QG_MR_Q8) or
    "off"; returns the previous mode."""
    global _redundant
    old = [k for k, v in _REDUNDANT.items() if v == _redundant][0]
    _redundant = _REDUNDANT[mode]
    return old




def _parts(lin):
    """The QLinears of a linear: itself, or the parts of a loader.ConcatLinear."""
    return list(getattr(lin, "parts", [lin]))


cdef _set_linear(nd_linear* d, lin, list keep):
    """d <- a QLinear (its bias in its sums) or a ConcatLinear of QLinears (its bias after them)."""
    cdef QLinear part
    parts = _parts(lin)
    d.nparts = len(parts)
    for i, q in enumerate(parts):
        part = <QLinear>q
        d.w[i] = <const uint8_t*>cnp.PyArray_DATA(part.packed)
        d.f[i] = part.fmt
    d.n = lin.out_features
    d.bias_after = parts[0] is not lin
    bias = (<QLinear>lin).bias_arr if parts[0] is lin else lin.bias
    if bias is not None:
        bias = np.ascontiguousarray(bias, dtype=np.float32)
        keep.append(bias)
    d.bias = NULL if bias is None else <const float*>cnp.PyArray_DATA(bias)


cdef inline float* _f32(object a, long M, long n, str name) except NULL:
    if not _is_c(a, cnp.NPY_FLOAT32, 2) or (<cnp.ndarray>a).shape[0] != M or (<cnp.ndarray>a).shape[1] != n:
        raise ValueError("FusedDecoder.run: %s must be C-contiguous float32 [%d, %d]" % (name, M, n))
    return <float*>cnp.PyArray_DATA(a)


def fused_decode_usable(linears) -> bool:
    """True when every linear is a QLinear, or a ConcatLinear of up to ND_MAX_PARTS QLinears,
    whose decode rows take int8 activations (act8) and whose packed k equals its in_features
    (no zero-padded rows), and down_proj (the last) is one part: FusedDecoder's contract."""
    for i, lin in enumerate(linears):
        parts = _parts(lin)
        if not parts or len(parts) > ND_MAX_PARTS or (i == 3 and len(parts) > 1):
            return False
        for q in parts:
            if not isinstance(q, QLinear) or not q.act8 or (<QLinear>q).fmt.kp != q.in_features:
                return False
    return True


def fused_decoder(layers, *args):
    """A FusedDecoder over `layers` (FusedDecoder's arguments), or None when a layer's linears
    are not all int8-activation QLinears (dense, f32-exact or profiled linears run op by op)."""
    if not all(fused_decode_usable(spec[:4]) for spec in layers):
        return None
    return FusedDecoder(layers, *args)


def _fused_amx_gemvs():
    """How many GEMV parts decode regions have run on AMX-INT8 tiles in this process (tests:
    decode batches past QG_MR_Q8 rows take them where present, as QLinear.forward does)."""
    return nd_amx_gemvs


cdef class FusedDecoder:
    """Decode steps (one new token per sequence, up to MAX_ROWS rows) of a quantized decoder in
    one OpenMP region: decode_layers.h. Same values as the op-by-op path (the same kernel
    functions in the same order); one Python call and one team per call instead of ~11 calls and
    ~5 teams per layer.

    layers: per layer a tuple (qkv, o_proj, gate_up, down_proj: QLinears, or ConcatLinears of
    QLinears but for down_proj, input_norm, post_norm,
    q_norm or None, k_norm or None, k_cache, v_cache, window); the caches are C-contiguous
    [num_blocks, block_size, Hk, row] of one type (float32, bf16 bits, or int8 rows).
    """
    MAX_ROWS = 64   # the int8-activation bound of a decode batch (qgemm.ACT8_DECODE_M_MAX)
    cdef nd_model m
    cdef nd_head head
    cdef object head_keep
    cdef long vocab
    cdef nd_layer* layers
    cdef readonly long num_layers
    cdef long kmax, nbmax, ngmax, nmax
    cdef object keep, scratch, parts
    cdef long _max_pos

    def __cinit__(self):
        self.layers = NULL

    def __dealloc__(self):
        free(self.layers)

    def __init__(self, layers, int hidden, int head_dim, int num_q_heads, int num_kv_heads,
                 int inter, double eps, double scale, cos_sin):
        cdef long L = len(layers), i
        if L < 1:
            raise ValueError("FusedDecoder needs at least one layer")
        cos_sin = np.ascontiguousarray(cos_sin, dtype=np.float32)
        self.layers = <nd_layer*>malloc(L * sizeof(nd_layer))
        if self.layers == NULL:
            raise MemoryError("FusedDecoder: cannot allocate its layer table")
        memset(self.layers, 0, L * sizeof(nd_layer))
        self.num_layers = L
        D, A, W = head_dim, num_q_heads * head_dim, (num_q_heads + 2 * num_kv_heads) * head_dim
        shapes = ((W, hidden), (hidden, A), (2 * inter, hidden), (hidden, inter))
        keep = [cos_sin]
        self.kmax = self.nbmax = self.ngmax = self.nmax = 1
        self.parts = []  # every QLinear of every layer (row-tile scratch sizes)
        kv_type, kv_shape = None, None
        for i, spec in enumerate(layers):
            lins, (in_norm, post_norm, q_norm, k_norm, kc, vc, window) = spec[:4], spec[4:]
            if not fused_decode_usable(lins):
                raise ValueError("FusedDecoder: layer %d has a linear that is not made of int8-activation QLinears" % i)
            for lin, (n, k) in zip(lins, shapes):
                if lin.out_features != n or lin.in_features != k:
                    raise ValueError("FusedDecoder: layer %d has a %dx%d linear where %dx%d belongs"
                                     % (i, lin.out_features, lin.in_features, n, k))
                # NOTE: each part keeps its own int8 rounding of the input (decode_layers.h)
                kq = nb = ng = 0
                for q in _parts(lin):
                    self.parts.append(q)
                    fmt = (<QLinear>q).fmt
                    kq += fmt.kp
                    ng += fmt.kp // fmt.group
                    nb += fmt.kp // fmt.group * qg_blocks_per_group(&fmt)
                    self.nmax = max(self.nmax, q.out_features)
                self.kmax, self.ngmax, self.nbmax = max(self.kmax, kq), max(self.ngmax, ng), max(self.nbmax, nb)
            norms = [np.ascontiguousarray(x, dtype=np.float32) for x in (in_norm, post_norm)]
            heads = [None if x is None else np.ascontiguousarray(x, dtype=np.float32) for x in (q_norm, k_norm)]
            if any(x.shape != (hidden,) for x in norms) or any(x is not None and x.shape != (D,) for x in heads):
                raise ValueError("FusedDecoder: layer %d has norm weights of the wrong size" % i)
            if kc.dtype not in _KV_CACHE_TYPES or vc.dtype != kc.dtype or kc.shape != vc.shape \
                    or kc.ndim != 4 or not (kc.flags.c_contiguous and vc.flags.c_contiguous):
                raise ValueError("FusedDecoder: layer %d has K/V caches of another layout" % i)
            if kv_shape is not None and (kc.shape != kv_shape or kc.dtype != kv_type):
                raise ValueError("FusedDecoder: the layers' caches differ in shape or type")
            kv_type, kv_shape = kc.dtype, kc.shape
            if kc.shape[2] != num_kv_heads:
                raise ValueError("FusedDecoder: caches hold %d kv heads, not %d" % (kc.shape[2], num_kv_heads))
            keep += list(lins) + norms + heads + [kc, vc]
            _set_linear(&self.layers[i].qkv, lins[0], keep)
            _set_linear(&self.layers[i].o, lins[1], keep)
            _set_linear(&self.layers[i].gu, lins[2], keep)
            _set_linear(&self.layers[i].down, lins[3], keep)
            self.layers[i].in_norm = <const float*>cnp.PyArray_DATA(norms[0])
            self.layers[i].post_norm = <const float*>cnp.PyArray_DATA(norms[1])
            self.layers[i].q_norm = NULL if heads[0] is None else <const float*>cnp.PyArray_DATA(heads[0])
            self.layers[i].k_norm = NULL if heads[1] is None else <const float*>cnp.PyArray_DATA(heads[1])
            self.layers[i].kc = cnp.PyArray_DATA(kc)
            self.layers[i].vc = cnp.PyArray_DATA(vc)
            self.layers[i].window = window
        self.keep, self.scratch = keep, {}
        self.m.H, self.m.D, self.m.Hq, self.m.Hk, self.m.inter = hidden, D, num_q_heads, num_kv_heads, inter
        self.m.eps, self.m.scale = eps, scale
        self.m.kv_type = _KV_CACHE_TYPES[kv_type]
        self.m.nb, self.m.bs = kv_shape[0], kv_shape[1]
        self.m.cos_sin = <const float*>cnp.PyArray_DATA(cos_sin)
        self.m.rot = cos_sin.shape[1]
        self.m.layers = self.layers
        self.m.head = NULL
        self._max_pos = cos_sin.shape[0]

    def set_head(self, norm, lm_head, long vocab):
        """Run the final norm (weights `norm` [hidden]) and `lm_head` in the region of the last
        layer when run() is given logits_indices (a model on one rank). lm_head: a QLinear of int8
        activations (else False and nothing changes); vocab: its columns that are real tokens
        (the rest are padding, left out of the argmax). Returns whether it was set."""
        if not fused_decode_usable([lm_head]) or len(_parts(lm_head)) != 1 or _parts(lm_head)[0] is not lm_head \
                or lm_head.in_features != self.m.H or not 0 < vocab <= lm_head.out_features:
            return False
        cdef QLinear q = <QLinear>lm_head
        w = np.ascontiguousarray(norm, dtype=np.float32)
        if w.shape != (self.m.H,):
            raise ValueError("FusedDecoder.set_head: the final norm has %s weights, not [%d]" % (w.shape, self.m.H))
        self.head_keep = (w, q)
        self.head.norm = <const float*>cnp.PyArray_DATA(w)
        self.head.w = <const uint8_t*>cnp.PyArray_DATA(q.packed)
        self.head.f = q.fmt
        self.head.bias = NULL if q.bias_arr is None else <const float*>cnp.PyArray_DATA(q.bias_arr)
        self.head.resid = 1 if q.act8_residual else 0
        self.vocab = vocab
        self.m.head = &self.head
        return True

    def head_fits(self, long rows):
        """Whether run() can end with the head of `rows` logits rows (set_head, and their int8
        rows fit one pass over each weight block, QG_MR_Q8)."""
        return self.m.head != NULL and 0 < rows and rows * (2 if self.head.resid else 1) <= QG_MR_Q8

    cdef _scratch(self, long M):
        """The int8-activation buffers of a step of M rows (kept for the next step of M)."""
        s = self.scratch.get(M)
        if s is None:
            if len(self.scratch) >= 4:
                del self.scratch[next(iter(self.scratch))]
            ns = QG_MAX_SLICES if M <= QG_MR_Q8 else 1  # the most k slices qg_q8_slices cuts
            tb = 1  # the row tiles or AMX row scalars of one part at a time (decode_layers.h nd_gemv)
            pad = 0
            if M > QG_MR_Q8:
                for q in self.parts:
                    tb = max(tb, qg_tiles_bytes(&(<QLinear>q).fmt, M), qg_amx_rows_bytes(&(<QLinear>q).fmt, M))
                pad = (QG_MR_AMX - 1) * self.kmax  # AMX loads whole 16-row tiles of the int8 rows
            s = self.scratch[M] = (np.empty(M * self.kmax + pad, np.int8), np.empty(M * self.nbmax, np.float32),
                                   np.empty(M * self.nbmax, np.int32), np.empty(M * self.ngmax, np.float32),
                                   np.empty(ns * M * self.nmax, np.float32), np.empty(tb, np.uint8),
                                   np.empty(ns * M * self.nmax, np.float32))
        return s

    def run(self, b, positions, slot_mapping, block_tables, query_start, context_lens,
            long s0, long s1, logits_indices=None):
        """Stages [s0, s1) of a decode step (2 l: attention half of layer l, 2 l + 1: its MLP
        half) over the step buffers b (models/llama.py _StepBuffers: residual holds the
        embeddings before stage 0; o and delta are each half's output, all-reduced by the
        caller between stages under tensor parallelism). positions, slot_mapping: [M] int64;
        block_tables [M, max_blocks], query_start [M + 1], context_lens [M]: int32 with one new
        token per sequence. With logits_indices ([S'] rows, head_fits(S'), s1 the last stage) the
        region ends with the head of those rows: returns (logits [S', lm_head columns], the first
        index of each row's largest logit among the real tokens [S'] int64); else o or delta."""
        cdef nd_step st
        cdef long M = (<cnp.ndarray>b.residual).shape[0], i, H = self.m.H, D = self.m.D
        cdef long Hq = self.m.Hq, Hk = self.m.Hk, I = self.m.inter
        if M < 1 or M > self.MAX_ROWS or s0 < 0 or s1 > 2 * self.num_layers or s0 >= s1:
            raise ValueError("FusedDecoder.run: %d rows, stages [%d, %d) of %d layers"
                             % (M, s0, s1, self.num_layers))
        cdef cnp.ndarray pos = _int_array(positions, np.int64, cnp.NPY_INT64, 1)
        cdef cnp.ndarray slots = _int_array(slot_mapping, np.int64, cnp.NPY_INT64, 1)
        cdef cnp.ndarray bt = _int_array(block_tables, np.int32, cnp.NPY_INT32, 2)
        cdef cnp.ndarray qs = _int_array(query_start, np.int32, cnp.NPY_INT32, 1)
        cdef cnp.ndarray cl = _int_array(context_lens, np.int32, cnp.NPY_INT32, 1)
        if pos.shape[0] != M or slots.shape[0] != M or cl.shape[0] != M or qs.shape[0] != M + 1 \
                or bt.ndim != 2 or bt.shape[0] < M:
            raise ValueError("FusedDecoder.run: the step's arrays do not describe %d decode rows" % M)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pos)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(slots)
        cdef const int32_t* qp = <const int32_t*>cnp.PyArray_DATA(qs)
        cdef const int32_t* cp = <const int32_t*>cnp.PyArray_DATA(cl)
        cdef const int32_t* bp = <const int32_t*>cnp.PyArray_DATA(bt)
        cdef long nblk, nbt = bt.shape[1], j
        for i in range(M):
            if pp[i] < 0 or pp[i] >= self._max_pos or sp[i] >= self.m.nb * self.m.bs \
                    or qp[i] != i or qp[i + 1] != i + 1 or cp[i] < 1:
                raise ValueError("FusedDecoder.run: row %d is not a decode row in range (position %d, "
                                 "slot %d, context %d)" % (i, pp[i], sp[i], cp[i]))
            nblk = (cp[i] + self.m.bs - 1) // self.m.bs
            if nblk > nbt:
                raise ValueError("FusedDecoder.run: sequence %d needs %d blocks, its table has %d" % (i, nblk, nbt))
            for j in range(nblk):
                if bp[i * nbt + j] < 0 or bp[i * nbt + j] >= self.m.nb:
                    raise ValueError("FusedDecoder.run: sequence %d has block id %d" % (i, bp[i * nbt + j]))
        xq, sx, xi, xs, part, tiles, part2 = self._scratch(M)
        st.M = M
        st.pos, st.slots, st.bt, st.qstart, st.ctx, st.bt_st = pp, sp, bp, qp, cp, nbt
        st.residual = _f32(b.residual, M, H, "residual")
        st.h = _f32(b.h, M, H, "h")
        st.qkv = _f32(b.qkv, M, (Hq + 2 * Hk) * D, "qkv")
        st.attn = _f32(b.attn_rows, M, Hq * D, "attn")
        st.o = _f32(b.o, M, H, "o")
        st.gu = _f32(b.gu, M, 2 * I, "gu")
        st.act = _f32(b.act, M, I, "act")
        st.delta = _f32(b.delta, M, H, "delta")
        st.xq = <int8_t*>cnp.PyArray_DATA(xq)
        st.sx = <float*>cnp.PyArray_DATA(sx)
        st.xi = <int32_t*>cnp.PyArray_DATA(xi)
        st.xs = <float*>cnp.PyArray_DATA(xs)
        st.part = <float*>cnp.PyArray_DATA(part)
        st.part2 = <float*>cnp.PyArray_DATA(part2)
        st.tiles = <char*>cnp.PyArray_DATA(tiles) if M > QG_MR_Q8 else NULL
        st.qg_level = _level
        st.attn_level, st.tiled_min = _attention._force_paths()
        global nr_amx
        nr_amx = 1 if _attention.amx_enabled() else 0  # the attention items as paged_attention runs them
        st.barrier = _barrier
        st.redundant = _redundant
        st.nlog, st.vocab, st.lidx, st.logits, st.amax = 0, 0, NULL, NULL, NULL
        cdef cnp.ndarray lidx, logits = None, amax = None
        if logits_indices is not None:
            lidx = _int_array(logits_indices, np.int64, cnp.NPY_INT64, 1)
            if not self.head_fits(lidx.shape[0]) or s1 != 2 * self.num_layers:
                raise ValueError("FusedDecoder.run: no head of %d rows after stage %d (head_fits, the last stage)"
                                 % (lidx.shape[0], s1))
            for i in range(lidx.shape[0]):
                if not 0 <= (<const int64_t*>cnp.PyArray_DATA(lidx))[i] < M:
                    raise ValueError("FusedDecoder.run: logits row %d of %d rows" % ((<const int64_t*>cnp.PyArray_DATA(lidx))[i], M))
            logits = np.empty((lidx.shape[0], self.head.f.n), np.float32)
            amax = np.empty(lidx.shape[0], np.int64)
            st.nlog, st.vocab = lidx.shape[0], self.vocab
            st.lidx = <const int64_t*>cnp.PyArray_DATA(lidx)
            st.logits = <float*>cnp.PyArray_DATA(logits)
            st.amax = <int64_t*>cnp.PyArray_DATA(amax)
        cdef int rc
        with nogil:
            rc = nd_run(&self.m, &st, s0, s1)
        if rc != 0:
            raise MemoryError("FusedDecoder.run: cannot allocate attention work items or scratch")
        if logits is not None:
            return logits, amax
        return b.delta if s1 % 2 == 0 else b.o
