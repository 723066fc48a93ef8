# cython: language_level=3
"""Paged KV cache: reshape_and_cache and causal paged_attention (reference semantics).

paged_attention runs each item (a chunk of query rows of one sequence and kv head, all the
query heads sharing that kv head) on one of three paths: dot products straight from the cache
rows (items of few query vectors: MHA decode); register-tiled f32 products over a transposed
key tile (AVX2 or AVX-512); and, for a bf16 cache on a CPU with AVX-512 BF16, vdpbf16ps
products (AMX-BF16 tiles where present, attention_amx.h) with Q and P rounded to bf16
(attention_bf16.h; the K/V rows are bf16 already, so
those two roundings are the only new ones: each weight of the softmax stays within 2^-8 of the
f32 path's). Every path does the online softmax in f32 and visits only the key tiles its rows
can see (causal and window limits).

Layout contract: q, k, v and out are [T, H, D] float32 with a contiguous last axis and any
token/head stride (slices of a fused qkv buffer are fine); k_cache/v_cache are C-contiguous,
both of one type: float32 or bf16 bits (uint16) [num_blocks, block_size, Hk, D], or int8
[num_blocks, block_size, Hk, D + 4], each row D values and their f32 scale
(reference.quantize_kv); block_tables, query_start and context_lens are converted to
contiguous int32 if they are not already.

NOTE: an int8 row carries its own scale, so a cache stays one array per K and per V: the model
passes it as it passes a bf16 one, and whatever copies blocks (the disk tier) copies the scales.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, int32_t

cnp.import_array()

include "arrays.pxi"

cdef extern from "attention_kernels.h":
    ctypedef struct nr_attn_args:
        const float *q
        int64_t q_st, q_sh
        const void *kc
        const void *vc
        int kv_type
        int64_t nb, bs, Hq, Hk, D
        const int32_t *bt
        int64_t bt_st, max_blocks
        const int32_t *qstart
        const int32_t *ctx
        int64_t S
        float scale
        int64_t window
        int level
        int64_t tiled_min
        int64_t prompt_s0
        float *out
        int64_t o_st, o_sh
    int64_t nr_reshape_and_cache(const float *k, int64_t k_st, int64_t k_sh,
                                 const float *v, int64_t v_st, int64_t v_sh,
                                 void *kc, void *vc, int kv_type, int64_t T, int64_t Hk,
                                 int64_t D, const int64_t *slots, int64_t n_slots) nogil
    int64_t nr_attn_check(const nr_attn_args *a, int64_t T) nogil
    int64_t nr_kv_row(int kv_type, int64_t D) nogil
    int nr_tile_level() nogil
    int nr_paged_attention(const nr_attn_args *a) nogil
    int nr_amx
    int nr_amx_init()


# The best tile level of this CPU: 2 AVX-512 BF16 (the bf16 path for bf16 caches), 1 AVX-512F,
# 0 AVX2.
TILE_LEVEL = nr_tile_level()
cdef int _level = TILE_LEVEL
# NOTE: items with at least this many query vectors (query rows x query heads per kv head)
# run a register-tiled path (Q K^T and P V as small matrix products: f32 over a transposed key
# tile, or bf16 dot products for a bf16 cache at level 2); fewer (MHA decode) run dot products
# straight from the cache rows. The tiled path measured faster with 7 vectors per item, decode
# included (bench/RESULTS.md, from `python bench/bench_kernels.py --attention`).
TILED_MIN_QUERIES = 4
cdef int64_t _tiled_min = TILED_MIN_QUERIES


# Q K^T and P V of the bf16 path on AMX-BF16 tiles where present (attention_amx.h): the
# CPU has AMX-BF16 and the kernel granted this process the tile state; heads of D a multiple of
# 32. Same roundings as the vdpbf16ps products.
cdef int _amx_present = nr_amx_init()
nr_amx = _amx_present
HAS_AMX = _amx_present != 0


def amx_enabled():
    """Whether the bf16 path runs its products on AMX-BF16 tiles now (present and not switched
    off by _set_amx); the fused decoder (qgemm) follows it."""
    return nr_amx != 0


def _set_amx(bint on):
    """Tests and benchmarks: False runs the bf16 path on vdpbf16ps even where AMX-BF16 is
    present (same roundings, other f32 summation order). Returns the old value."""
    global nr_amx
    old = nr_amx != 0
    nr_amx = 1 if on and _amx_present else 0
    return old


def _force_paths(level=None, tiled_min=None):
    """Tests and benchmarks only: cap the tile ISA level (2 AVX-512 BF16: bf16 dot products
    for bf16 caches, 1 AVX-512 f32, 0 AVX2; never above TILE_LEVEL) and set the tiled-path
    threshold; returns the previous (level, tiled_min)."""
    global _level, _tiled_min
    old = (_level, _tiled_min)
    if level is not None:
        _level = min(max(int(level), 0), nr_tile_level())
    if tiled_min is not None:
        _tiled_min = max(int(tiled_min), 1)
    return old


cdef _check_thd(t, str name, bint writable=False):
    """t must be [T, H, D] float32 with a contiguous last axis; returns (st, sh) in floats."""
    if not _is_thd(t, writable):
        if not isinstance(t, np.ndarray) or t.dtype != np.float32 or t.ndim != 3:
            raise TypeError("%s must be a [T, H, D] float32 array" % name)
        if (t.shape[2] > 1 and t.strides[2] != 4) or t.strides[0] % 4 or t.strides[1] % 4:
            raise ValueError("%s must be contiguous in its last axis" % name)
        if writable and not t.flags.writeable:
            raise ValueError("%s must be writable" % name)
    cdef cnp.ndarray a = t
    return a.strides[0] // 4, a.strides[1] // 4


_KV_TYPES = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.int8): 2}  # nr_kv_type


cdef int _check_caches(k_cache, v_cache, int64_t D) except -1:
    """Both caches C-contiguous [nb, bs, Hk, row] of one type with rows for head dim D;
    returns the nr_kv_type."""
    cdef int tn = cnp.PyArray_TYPE(k_cache) if cnp.PyArray_Check(k_cache) else -1
    cdef int fast = 0 if tn == cnp.NPY_FLOAT32 else 1 if tn == cnp.NPY_UINT16 else \
        2 if tn == cnp.NPY_INT8 else -1
    if fast >= 0 and _is_c(k_cache, tn, 4) and _is_c(v_cache, tn, 4) and \
            _same_shape(k_cache, v_cache) and (<cnp.ndarray>k_cache).shape[3] == nr_kv_row(fast, D):
        return fast  # the common case, decided without Python attribute lookups
    for c, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if not isinstance(c, np.ndarray) or c.ndim != 4 or not c.flags.c_contiguous:
            raise ValueError("%s must be a C-contiguous [num_blocks, block_size, Hk, D] array"
                             % name)
        if c.dtype not in _KV_TYPES:
            raise TypeError("%s must be float32, bf16 bits (uint16) or int8, got %s"
                            % (name, c.dtype))
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache %s %s and v_cache %s %s differ" % (
            k_cache.shape, k_cache.dtype, v_cache.shape, v_cache.dtype))
    cdef int kv_type = _KV_TYPES[k_cache.dtype]
    if k_cache.shape[3] != nr_kv_row(kv_type, D):
        raise ValueError("a %s cache for head dim %d needs rows of %d, got %s%s" % (
            k_cache.dtype, D, nr_kv_row(kv_type, D), k_cache.shape,
            " (D int8 values + a 4-byte f32 scale)" if kv_type == 2 else ""))
    return kv_type


cdef bint _same_shape(cnp.ndarray a, cnp.ndarray b):
    cdef int i
    if a.ndim != b.ndim:
        return False
    for i in range(a.ndim):
        if a.shape[i] != b.shape[i]:
            return False
    return True


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """Write new K/V rows into the paged cache (rounded to bf16 for a bf16 cache, quantized
    per row with its scale for an int8 one).

    k, v: [T, Hk, D] f32; k_cache, v_cache: [num_blocks, block_size, Hk, D] f32|bf16 or
    [num_blocks, block_size, Hk, D + 4] int8; slot_mapping: [T] int64,
    slot = block_id * block_size + offset; a slot < 0 is skipped.
    """
    k_st, k_sh = _check_thd(k, "k")
    v_st, v_sh = _check_thd(v, "v")
    cdef cnp.ndarray ka = k, kca = k_cache
    cdef int kv_type = _check_caches(k_cache, v_cache, ka.shape[2])
    cdef cnp.ndarray slots = _int_array(slot_mapping, np.int64, cnp.NPY_INT64, 1)
    cdef int64_t T = ka.shape[0], Hk = ka.shape[1], D = ka.shape[2]
    if not _same_shape(ka, v) or slots.shape[0] != T or kca.shape[2] != Hk:
        raise ValueError("reshape_and_cache: k %s, v %s, slot_mapping %s and cache %s disagree"
                         % (k.shape, v.shape, slot_mapping.shape, k_cache.shape))
    cdef int64_t n_slots = kca.shape[0] * kca.shape[1]
    cdef const float *pk = <const float *>cnp.PyArray_DATA(k)
    cdef const float *pv = <const float *>cnp.PyArray_DATA(v)
    cdef void *pkc = cnp.PyArray_DATA(k_cache)
    cdef void *pvc = cnp.PyArray_DATA(v_cache)
    cdef const int64_t *ps = <const int64_t *>cnp.PyArray_DATA(slots)
    cdef int64_t ks0 = k_st, ks1 = k_sh, vs0 = v_st, vs1 = v_sh, bad
    with nogil:
        bad = nr_reshape_and_cache(pk, ks0, ks1, pv, vs0, vs1, pkc, pvc, kv_type, T, Hk, D,
                                   ps, n_slots)
    if bad >= 0:
        raise IndexError("slot_mapping[%d] = %d is past the cache's %d slots; nothing written"
                         % (bad, slots[bad], n_slots))


def paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, double scale,
                    out, int64_t window=0, first_prompt_seq=None):
    """Causal attention for a batch of sequences through their block tables.

    q: [T, Hq, D] f32, new tokens of all sequences back to back; query_start: [S+1] int32;
    context_lens: [S] int32, cached tokens of s *including* its new ones (already written);
    query row i of s sits at position context_lens[s] - n_new + i; block_tables:
    [S, max_blocks] int32; k_cache/v_cache: [num_blocks, block_size, Hk, D] f32|bf16 or
    [num_blocks, block_size, Hk, D + 4] int8 (dequantized as read);
    query head h reads kv head h // (Hq // Hk). out: [T, Hq, D] f32 (rows of sequences with
    no new tokens are not written). window > 0: the query at position P sees only keys
    P - window + 1 .. P (sliding window); 0: every earlier key. Online softmax in f32; long
    key ranges of few items are split over threads (flash-decoding). A bf16 cache at tile
    level 2 rounds Q * scale and the probabilities to bf16 (module docstring).
    first_prompt_seq: sequences from this one on hold prompt rows, which take the tiled path
    (the bf16 path of a bf16 cache) however few rows they have, so that a prompt row's
    precision does not depend on how its prompt was chunked or cached (None: no such sequence;
    every item's path follows its query vectors). Returns out.
    """
    cdef nr_attn_args a
    q_st, q_sh = _check_thd(q, "q")
    o_st, o_sh = _check_thd(out, "out", True)
    if not _same_shape(out, q):
        raise ValueError("out %s must have q's shape %s" % (out.shape, q.shape))
    cdef cnp.ndarray qa = q, kca = k_cache
    cdef int64_t d = qa.shape[2]
    a.kv_type = _check_caches(k_cache, v_cache, d)
    cdef int64_t nb = kca.shape[0], bs = kca.shape[1], hk = kca.shape[2]
    if hk < 1 or qa.shape[1] % hk:
        raise ValueError("q %s does not fit a cache of %s (Hq must be a multiple of Hk)"
                         % (q.shape, k_cache.shape))
    cdef cnp.ndarray bt = _int_array(block_tables, np.int32, cnp.NPY_INT32, 2)
    cdef cnp.ndarray qs = _int_array(query_start, np.int32, cnp.NPY_INT32, 1)
    cdef cnp.ndarray cl = _int_array(context_lens, np.int32, cnp.NPY_INT32, 1)
    cdef int64_t S = cl.shape[0]
    if bt.ndim != 2 or bt.shape[0] < S or qs.shape[0] != S + 1:
        raise ValueError("block_tables %s, query_start %s and context_lens %s disagree"
                         % (np.shape(block_tables), np.shape(query_start), np.shape(context_lens)))
    a.q = <const float *>cnp.PyArray_DATA(q)
    a.q_st = q_st
    a.q_sh = q_sh
    a.kc = cnp.PyArray_DATA(k_cache)
    a.vc = cnp.PyArray_DATA(v_cache)
    a.nb, a.bs, a.Hq, a.Hk, a.D = nb, bs, qa.shape[1], hk, d
    a.bt = <const int32_t *>cnp.PyArray_DATA(bt)
    a.bt_st = bt.shape[1]
    a.max_blocks = bt.shape[1]
    a.qstart = <const int32_t *>cnp.PyArray_DATA(qs)
    a.ctx = <const int32_t *>cnp.PyArray_DATA(cl)
    a.S = S
    a.scale = scale
    if window < 0:
        raise ValueError("paged_attention: window must be >= 0 (0 = no sliding window), got %d"
                         % window)
    a.window = window
    a.level = _level
    a.tiled_min = _tiled_min
    if first_prompt_seq is not None and not 0 <= first_prompt_seq <= S:
        raise ValueError("paged_attention: first_prompt_seq %r is not a sequence index 0..%d" % (first_prompt_seq, S))
    a.prompt_s0 = S if first_prompt_seq is None else first_prompt_seq
    a.out = <float *>cnp.PyArray_DATA(out)
    a.o_st = o_st
    a.o_sh = o_sh
    cdef int64_t T = qa.shape[0], bad
    with nogil:
        bad = nr_attn_check(&a, T)
    if bad >= 0:
        raise ValueError("paged_attention: sequence %d is inconsistent (query rows %d:%d of %d, "
                         "context %d, block table of %d blocks of %d, cache of %d blocks)"
                         % (bad, qs[bad], qs[bad + 1], T, cl[bad], bt.shape[1], bs, nb))
    if T == 0 or d == 0:
        return out
    cdef int rc
    with nogil:
        rc = nr_paged_attention(&a)
    if rc != 0:
        raise MemoryError("paged_attention: cannot allocate its work items or per-thread scratch")
    return out
