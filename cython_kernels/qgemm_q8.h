/* Decode GEMV with int8 activations: integer dot products over the packed int4/int8 weights.
 *
 * For engines that compute in bf16 (qgemm.pyx: QLinear.act8), the few rows of a decode step are
 * quantized to int8 in blocks of QG_QB k (absmax / 127, round to nearest even), as llama.cpp
 * quantizes its activations to Q8 blocks; then each 64-byte weight row meets them in integer
 * dot products: vpdpbusd (AVX-512 VNNI), or vpmaddubsw + vpmaddwd (AVX-512BW, AVX2). Per output
 * column j and group g (scale s_j, offset c_j, see qgemm_kernels.h):
 *   sum_k w[j,k] x[k] = s_j * sum_b sx_b * (sum_{k in b} u[j,k] xi[k] - off * sum_{k in b} xi[k])
 *                       + c_j * sum_b sx_b * sum_{k in b} xi[k]
 * with u the unsigned weight code the instruction reads (int4: q in 0..15; int8: q + 128 on the
 * VNNI path) and off what u carries beyond q (int4 symmetric: 8, int8 on VNNI: 128, else 0):
 * the integer parts are exact, so the only rounding beyond f32 is that of x to int8.
 * numa_runtime/quant/reference.py: quantize_activations is the numpy specification.
 */
#ifndef NUMA_RUNTIME_QGEMM_Q8_H
#define NUMA_RUNTIME_QGEMM_Q8_H

#include <math.h>

#include "split.h"

#define QG_QB 32       /* k per activation block (a group's last block may be shorter) */
#define QG_MR_Q8 8     /* rows per pass over a weight block */
#define QG_MAX_SLICES 8  /* most k slices a column block of a decode GEMV is cut into */

typedef struct {
    const int8_t* xq;   /* [M][kp]; int2-6 weights: each 8 k stored as k 0 2 4 6 1 3 5 7 */
    const float* sx;    /* [M][nb] scale of each block */
    const int32_t* xi;  /* [M][nb] sum of each block's int8 values */
    const float* xs;    /* [M][ng] sum over the group's blocks of sx * xi */
    long kp, nb, ng;
} qg_xq;

/* Set by the model for each step on its compute thread (qgemm.set_decode_step): the step's rows
 * are all decode rows, so a batch of them may take int8 activations beyond QG_MR_Q8 rows. */
static __thread int qg_decode_step;
/* Software prefetch distance of the int8-activation kernels (bytes ahead of each 64-byte weight row
 * they read: decode, VNNI row tiles, AMX tiles; 0: off; qgemm._set_prefetch). NOTE: each thread
 * streams its own contiguous run of column blocks, yet the hardware prefetchers alone left decode
 * short of DRAM speed. `bench/bench_engine.py --prefetch 0 4096` (rounds alternating off and on,
 * bench/RESULTS.md): int4 batch-1 decode steps 0.86x (2-core Zen 5) and 0.87x (16-core Sapphire
 * Rapids), int8 0.89x (Sapphire Rapids), a batch of 16 0.81x (Zen 5, VNNI row tiles) and 0.93x
 * (Sapphire Rapids, AMX tiles). Distances of 256-1024 bytes did not help, 2-16 KiB all did. */
static long qg_pf_bytes = 4096;

static inline long qg_blocks_per_group(const qg_format* f) { return (f->group + QG_QB - 1) / QG_QB; }

/* The offset the unsigned weight codes of the VNNI kernels carry (int4 symmetric: q + 8; int8
 * and the NL levels: the value + 128, its sign bit flipped); vpmaddubsw reads int8 weights and
 * NL levels by the sign trick instead. */
static inline int qg_q8_off_vnni(const qg_format* f) {
    return f->bits == 8 || f->kind == QG_NL ? 128 : (f->kind == QG_SYM ? 1 << (f->bits - 1) : 0);
}

/* One full block of n = QG_QB = 32 k, or of 16 (int6 groups of 16, GGUF Q6_K: the last two
 * vectors read as zeros): the scalar rule of qg_quantize_block in AVX2 (the build's floor).
 * cvtps rounds to nearest even, as nearbyintf does in the default rounding mode, and
 * |x * inv| <= 127 up to one rounding, so both give the same bytes. */
static inline void qg_quantize_block(const float* xr, int n, int perm4, int8_t* dst, float* sx,
                                       int32_t* xi, float* res) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 v0 = _mm256_loadu_ps(xr), v1 = _mm256_loadu_ps(xr + 8);
    const __m256 v2 = n == 32 ? _mm256_loadu_ps(xr + 16) : _mm256_setzero_ps();
    const __m256 v3 = n == 32 ? _mm256_loadu_ps(xr + 24) : _mm256_setzero_ps();
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absm), _mm256_and_ps(v1, absm)),
                                   _mm256_max_ps(_mm256_and_ps(v2, absm), _mm256_and_ps(v3, absm)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    /* NOTE: max_ps drops a NaN: a block holding one gets a NaN scale, so that it reaches the
     * output as on the exact path (it came out as -absmax of its block) */
#define QG_UN(v) _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
    const __m256 un = _mm256_or_ps(_mm256_or_ps(QG_UN(v0), QG_UN(v1)), _mm256_or_ps(QG_UN(v2), QG_UN(v3)));
#undef QG_UN
    const float amax = _mm256_testz_ps(un, un) ? _mm_cvtss_f32(h) : NAN;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
#define QG_Q(v) _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, vi)), lo), hi)
    const __m256i q0 = QG_Q(v0), q1 = QG_Q(v1), q2 = QG_Q(v2), q3 = QG_Q(v3);
#undef QG_Q
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
    /* packs interleave the 128-bit lanes: dword i of b holds q[i % 4][4 (i / 4) ..] */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (perm4)  /* int2-6 weights: each 8 k as k 0 2 4 6 1 3 5 7 */
        b = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11,
                                                    13, 15, 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14,
                                                    9, 11, 13, 15));
    if (n == 32) _mm256_storeu_si256((__m256i*)dst, b);
    else _mm_storeu_si128((__m128i*)dst, _mm256_castsi256_si128(b));
    const float scale = amax / 127.0f;
    *sx = scale;
    *xi = _mm_cvtsi128_si32(u);
    if (res) {  /* x - q * scale, rounded once (an FMA): what the integer rows leave out */
        const __m256 vs = _mm256_set1_ps(scale);
        _mm256_storeu_ps(res, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q0), vs, v0));
        _mm256_storeu_ps(res + 8, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q1), vs, v1));
        if (n == 32) {
            _mm256_storeu_ps(res + 16, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q2), vs, v2));
            _mm256_storeu_ps(res + 24, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q3), vs, v3));
        }
    }
}

/* Quantize group g of one row (xr: the row's kp values) into the row's buffers (xq: [kp],
 * sx, xi: [nb], xs: [ng]); res (NULL: none) gets x - the dequantized values. */
static void qg_quantize_group(const float* xr, const qg_format* f, long g, int8_t* xq, float* sx,
                              int32_t* xi, float* xs, float* res) {
    const long G = f->group, nbg = qg_blocks_per_group(f);
    float gs = 0.0f;
    for (long b = 0; b < nbg; b++) {
        long k0 = g * G + b * QG_QB, k1 = k0 + QG_QB < (g + 1) * G ? k0 + QG_QB : (g + 1) * G;
        float* bs = sx + g * nbg + b;
        int32_t* bi = xi + g * nbg + b;
        if (k1 - k0 == QG_QB || (k1 - k0 == 16 && f->bits != 8)) {
            qg_quantize_block(xr + k0, (int)(k1 - k0), f->bits != 8, xq + k0, bs, bi, res ? res + k0 : NULL);
        } else {
            float amax = 0.0f;
            int nan = 0;
            for (long k = k0; k < k1; k++) {
                amax = fmaxf(amax, fabsf(xr[k]));
                nan |= isnan(xr[k]);
            }
            if (nan) amax = NAN;  /* NOTE: as qg_quantize_block: the NaN reaches the output */
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, scale = amax / 127.0f;
            int32_t sum = 0;
            for (long k = k0; k < k1; k++) {
                const float v = xr[k] * inv;
                int32_t q = v == v ? (int32_t)nearbyintf(v) : 0;
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                sum += q;
                long d = k;
                if (f->bits != 8) d = (k & ~7L) + ((k & 1) ? 4 : 0) + ((k & 7) >> 1);
                xq[d] = (int8_t)q;
                if (res) res[k] = fmaf(-(float)q, scale, xr[k]);
            }
            *bs = scale;
            *bi = sum;
        }
        gs += *bs * (float)*bi;
    }
    xs[g] = gs;
}

/* Quantize one row of kp k into q's buffers; res (NULL: none) gets x - the dequantized row. */
static void qg_quantize_row(const float* xr, const qg_format* f, int8_t* xq, float* sx,
                            int32_t* xi, float* xs, float* res) {
    const long ng = f->kp / f->group;
    for (long g = 0; g < ng; g++) qg_quantize_group(xr, f, g, xq, sx, xi, xs, res);
}

/* Row xr as activation row r of q's buffers: int8 row r, or with `resid` int8 rows 2 r (xr) and
 * 2 r + 1 (its residual xr - dq(xr), computed in rr: kp floats). */
static void qg_quantize_row_at(const float* xr, long r, const qg_format* f, int8_t* xq, float* sx,
                               int32_t* xi, float* xs, int resid, float* rr) {
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f);
    if (!resid) {
        qg_quantize_row(xr, f, xq + r * f->kp, sx + r * nb, xi + r * nb, xs + r * ng, NULL);
        return;
    }
    const long a = 2 * r, c = 2 * r + 1;
    qg_quantize_row(xr, f, xq + a * f->kp, sx + a * nb, xi + a * nb, xs + a * ng, rr);
    qg_quantize_row(rr, f, xq + c * f->kp, sx + c * nb, xi + c * nb, xs + c * ng, NULL);
}

/* Quantize rows x[M, kp] (stride ldx) into q (buffers sized by the caller). With `resid`
 * (res: a [M][kp] f32 buffer) row r becomes two int8 rows, 2r = x and 2r + 1 = its residual
 * x - dq(x): their sum carries about 15 bits, where one row carries 8. NOTE: a decode step's few
 * rows are quantized by the calling thread alone: vectorized, one row of 4864 k takes about a
 * microsecond, less than starting a team. */
static void qg_quantize_rows(const float* x, long r, long ldx, const qg_format* f, int8_t* xq,
                             float* sx, int32_t* xi, float* xs, int resid, float* res) {
    qg_quantize_row_at(x + r * ldx, r, f, xq, sx, xi, xs, resid, resid ? res + r * f->kp : NULL);
}

static void qg_quantize_x(const float* x, long M, long ldx, const qg_format* f, int8_t* xq,
                          float* sx, int32_t* xi, float* xs, int resid, float* res) {
    if (M * f->kp <= 65536) {
        for (long r = 0; r < M; r++) qg_quantize_rows(x, r, ldx, f, xq, sx, xi, xs, resid, res);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (long r = 0; r < M; r++) qg_quantize_rows(x, r, ldx, f, xq, sx, xi, xs, resid, res);
}

/* Scratch of the calling thread: one QG_SCRATCH_KEEP buffer kept between calls (a decode step's
 * activations); larger requests are allocated per call. NULL when out of memory. */
#define QG_SCRATCH_KEEP (1L << 20)
static __thread void* qg_scratch_buf;

static void* qg_scratch_get(size_t n) {
    if (n > QG_SCRATCH_KEEP) return malloc(n);
    if (qg_scratch_buf == NULL) qg_scratch_buf = malloc(QG_SCRATCH_KEEP);
    return qg_scratch_buf;
}

static void qg_scratch_put(void* p) {
    if (p != qg_scratch_buf) free(p);
}

static inline int32_t qg_ld32(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- AVX-512: one 16-column block, mr rows; DOT(acc, u8, s8) adds 4-byte dot products.
 * The BW variant (no VNNI) reads int8 weights by the sign trick (|w| times x with w's sign),
 * since vpmaddubsw saturates above 255 * 127. */
#define QG_Q8_AVX512_BODY(DOT, VNNI)                                                            \
    const long pk = qg_pk_of(bits);                        \
    const long ub = qg_ub_of(bits);                             \
    const long mb = qg_meta_bytes(f);                                                           \
    const uint8_t* gbase = qg_groups(blk, f); /* group g: gbase + g gb */                       \
    const long gb = qg_group_bytes(f);                                                          \
    const long G = f->group, ng = f->kp / G, nbg = qg_blocks_per_group(f);                      \
    const int nl = bits == 4 && f->kind == QG_NL;                                                \
    const int off = (bits != 8 && !nl) || VNNI ? qg_q8_off_vnni(f) : 0;                         \
    const int has_c = bits != 8 && qg_has_c(f);                                                 \
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F), flip = _mm512_set1_epi32((int)0x80808080); \
    const __m512i nls = QG_NL_S512(), nlu = _mm512_xor_si512(nls, flip);                       \
    __m512 a[QG_MR_Q8];                                                                         \
    for (int r = 0; r < mr; r++) a[r] = _mm512_setzero_ps();                                   \
    /* ks: the super-block's f16 d (and dmin) converted once per super-block, not per group */ \
    __m512 sd = _mm512_setzero_ps(), sdm = _mm512_setzero_ps();                                \
    const uint8_t* sp_last = NULL;                                                              \
    (void)ng;                                                                                   \
    for (long g = g0; g < g1; g++) {                                                            \
        const uint8_t* meta = gbase + g * gb;                                              \
        const uint8_t* sp = f->ks ? qg_super_of(blk, f, g) : NULL;                              \
        if (sp != sp_last) {                                                                    \
            sp_last = sp;                                                                       \
            sd = qg_super512(sp_last, 0);                                                       \
            if (has_c) sdm = qg_super512(sp_last, 1);                                           \
        }                                                                                       \
        const __m512 s = f->ks ? qg_ks_s512(f, meta, sd) : qg_s512(blk, f, meta, g);            \
        const uint8_t* row = meta + mb;                                                         \
        for (long b = 0; b < nbg; b++) {                                                        \
            const long k0 = g * G + b * QG_QB;                                                  \
            const long k1 = k0 + QG_QB < (g + 1) * G ? k0 + QG_QB : (g + 1) * G;               \
            __m512i ia[QG_MR_Q8], ib[QG_MR_Q8];                                                 \
            for (int r = 0; r < mr; r++) ia[r] = ib[r] = _mm512_setzero_si512();               \
            for (long k = k0; k < k1; k += pk, row += ub) {                                     \
                if (qg_pf_bytes)                                                                \
                    for (long l = 0; l < ub; l += 64)                                           \
                        _mm_prefetch((const char*)row + l + qg_pf_bytes, _MM_HINT_T0);          \
                const __m512i v = _mm512_loadu_si512((const void*)row);                        \
                if (bits != 4 && bits != 8) {                                                   \
                    /* int5/6: v is the plane, each nibble row's bytes take their high bits from \
                     * it; int2/3: v is the crumb row (qg_hb_merge512) */                      \
                    for (int rr = 0; rr < pk / 8; rr++) {                                       \
                        __m512i lo, hi;                                                         \
                        qg_hb_merge512(row, v, bits, rr, &lo, &hi);                             \
                        for (int r = 0; r < mr; r++) {                                          \
                            const int8_t* xr = q->xq + r * q->kp + k + 8 * rr;                  \
                            ia[r] = DOT(ia[r], lo, _mm512_set1_epi32(qg_ld32(xr)));             \
                            ib[r] = DOT(ib[r], hi, _mm512_set1_epi32(qg_ld32(xr + 4)));         \
                        }                                                                       \
                    }                                                                           \
                } else if (bits == 4 && nl && !VNNI) {                                          \
                    /* the levels by the sign trick, as int8 weights: |level| times signed x */ \
                    const __m512i tl = _mm512_shuffle_epi8(nls, _mm512_and_si512(v, m4));       \
                    const __m512i th = _mm512_shuffle_epi8(nls, _mm512_and_si512(_mm512_srli_epi32(v, 4), m4)); \
                    const __m512i ul = _mm512_abs_epi8(tl), uh = _mm512_abs_epi8(th);           \
                    const __mmask64 nl_ = _mm512_movepi8_mask(tl), nh_ = _mm512_movepi8_mask(th); \
                    for (int r = 0; r < mr; r++) {                                              \
                        const int8_t* xr = q->xq + r * q->kp + k;                               \
                        const __m512i x0 = _mm512_set1_epi32(qg_ld32(xr));                      \
                        const __m512i x1 = _mm512_set1_epi32(qg_ld32(xr + 4));                  \
                        ia[r] = DOT(ia[r], ul, _mm512_mask_sub_epi8(x0, nl_, _mm512_setzero_si512(), x0)); \
                        ib[r] = DOT(ib[r], uh, _mm512_mask_sub_epi8(x1, nh_, _mm512_setzero_si512(), x1)); \
                    }                                                                           \
                } else if (bits == 4) {                                                         \
                    __m512i lo = _mm512_and_si512(v, m4);                                       \
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);                 \
                    if (nl) { /* VNNI: the levels + 128, unsigned */                            \
                        lo = _mm512_shuffle_epi8(nlu, lo);                                      \
                        hi = _mm512_shuffle_epi8(nlu, hi);                                      \
                    }                                                                           \
                    for (int r = 0; r < mr; r++) {                                              \
                        const int8_t* xr = q->xq + r * q->kp + k;                               \
                        ia[r] = DOT(ia[r], lo, _mm512_set1_epi32(qg_ld32(xr)));                 \
                        ib[r] = DOT(ib[r], hi, _mm512_set1_epi32(qg_ld32(xr + 4)));             \
                    }                                                                           \
                } else if (VNNI) {                                                              \
                    const __m512i u = _mm512_xor_si512(v, flip);                                \
                    for (int r = 0; r < mr; r++)                                                \
                        ia[r] = DOT(ia[r], u, _mm512_set1_epi32(qg_ld32(q->xq + r * q->kp + k))); \
                } else {                                                                        \
                    const __m512i u = _mm512_abs_epi8(v);                                       \
                    const __mmask64 neg = _mm512_movepi8_mask(v);                               \
                    for (int r = 0; r < mr; r++) {                                              \
                        __m512i xb = _mm512_set1_epi32(qg_ld32(q->xq + r * q->kp + k));        \
                        xb = _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb);         \
                        ia[r] = DOT(ia[r], u, xb);                                              \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            const long bi = g * nbg + b;                                                        \
            for (int r = 0; r < mr; r++) {                                                      \
                __m512i t = _mm512_add_epi32(ia[r], ib[r]);                                     \
                if (off) t = _mm512_sub_epi32(t, _mm512_set1_epi32(off * q->xi[r * q->nb + bi])); \
                a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t),                                   \
                                       _mm512_mul_ps(s, _mm512_set1_ps(q->sx[r * q->nb + bi])), a[r]); \
            }                                                                                   \
        }                                                                                       \
        if (has_c) {                                                                            \
            const __m512 c = f->ks ? qg_ks_c512(f, meta, sdm) : qg_c512(blk, f, meta, g, s);    \
            for (int r = 0; r < mr; r++)                                                        \
                a[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(q->xs[r * q->ng + g]), a[r]);          \
        }                                                                                       \
    }                                                                                           \
    for (int r = 0; r < mr; r++) _mm512_store_ps(acc + r * QG_NB, a[r]);

#define QG_T512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

/* acc += dot(u, broadcast *p) by 4-byte lanes (vpdpbusd with an embedded broadcast). NOTE: in asm
 * because GCC 12 neither embeds the broadcast nor accumulates in place (it adds register moves). */
QG_INLINE QG_T512VNNI __m512i qg_dpbusd_bcast(__m512i acc, __m512i u, const int32_t* p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*p));
    return acc;
}
#define QG_DOT_VNNI(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define QG_DOT_BW(acc, u, s) \
    _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))

QG_INLINE QG_T512VNNI void qg_q8_vnni_mr(const uint8_t* blk, const qg_format* f, const qg_xq* q,
                                         long g0, long g1, float* acc, const int bits,
                                         const int mr) {
    QG_Q8_AVX512_BODY(QG_DOT_VNNI, 1)
}

QG_INLINE QG_T512 void qg_q8_bw_mr(const uint8_t* blk, const qg_format* f, const qg_xq* q,
                                   long g0, long g1, float* acc, const int bits, const int mr) {
    QG_Q8_AVX512_BODY(QG_DOT_BW, 0)
}

/* One function per (kernel, bit width, rows): fn_b<bits>_m<rows>, each compiled on its own.
 * NOTE: with all 48 instances inlined into one dispatching function, GCC kept more of the block
 * loops' counters and pointers on the stack (a store-to-load round trip per block); on their
 * own, the instances' register allocation is their own. */
#define QG_Q8_INST(fn, T, QT, b, m)                                                              \
    static T __attribute__((noinline)) void fn##_b##b##_m##m(const uint8_t* blk, const qg_format* f, \
                                                          const QT* q, long g0, long g1, float* acc) { \
        fn(blk, f, q, g0, g1, acc, b, m);                                                        \
    }
#define QG_Q8_INST_M(fn, T, QT, b)                                                               \
    QG_Q8_INST(fn, T, QT, b, 1) QG_Q8_INST(fn, T, QT, b, 2) QG_Q8_INST(fn, T, QT, b, 3)        \
    QG_Q8_INST(fn, T, QT, b, 4) QG_Q8_INST(fn, T, QT, b, 5) QG_Q8_INST(fn, T, QT, b, 6)        \
    QG_Q8_INST(fn, T, QT, b, 7) QG_Q8_INST(fn, T, QT, b, 8)
#define QG_Q8_INST_ALL(fn, T, QT)                                                                \
    QG_Q8_INST_M(fn, T, QT, 2) QG_Q8_INST_M(fn, T, QT, 3) QG_Q8_INST_M(fn, T, QT, 4)           \
    QG_Q8_INST_M(fn, T, QT, 5) QG_Q8_INST_M(fn, T, QT, 6) QG_Q8_INST_M(fn, T, QT, 8)

#define QG_Q8_CASES(fn, b)                                        \
    switch (m) {                                                  \
        case 1: fn##_b##b##_m1(blk, f, q, g0, g1, acc); break;    \
        case 2: fn##_b##b##_m2(blk, f, q, g0, g1, acc); break;    \
        case 3: fn##_b##b##_m3(blk, f, q, g0, g1, acc); break;    \
        case 4: fn##_b##b##_m4(blk, f, q, g0, g1, acc); break;    \
        case 5: fn##_b##b##_m5(blk, f, q, g0, g1, acc); break;    \
        case 6: fn##_b##b##_m6(blk, f, q, g0, g1, acc); break;    \
        case 7: fn##_b##b##_m7(blk, f, q, g0, g1, acc); break;    \
        default: fn##_b##b##_m8(blk, f, q, g0, g1, acc); break;   \
    }

QG_Q8_INST_ALL(qg_q8_vnni_mr, QG_T512VNNI, qg_xq)
QG_Q8_INST_ALL(qg_q8_bw_mr, QG_T512, qg_xq)

/* Whether the lean VNNI kernels (qg_q8_lean_mr; row tiles: qg_q8t_lean_mr) can take f: int4 codes
 * (not NL) or int8, f16 group scales (no ks), and groups of whole activation blocks. */
static inline int qg_q8t_lean_takes(const qg_format* f) {
    return ((f->bits == 4 && f->kind != QG_NL) || f->bits == 8) && !f->ks && f->group % QG_QB == 0;
}

/* 0: decode rows of every format take qg_q8_vnni_mr (tests and benchmarks: qgemm._set_q8_lean) */
static int qg_q8_lean_on = 1;

/* qg_q8_vnni_mr for the formats qg_q8t_lean_takes (Q4_0, Q4_1, Q8_0, int4 and int8 at load): the
 * same integer block sums (the offset's product as the sums' start, modulo 2^32 as before) and
 * float operations in the same order, so bitwise equal results, with every pointer advanced in
 * place, the activations read by embedded broadcasts, and no format test inside the group loop.
 * int8 rows alternate between two accumulators at 1-2 rows (two dpbusd chains, as int4's
 * nibbles have; more rows are more chains already).
 * NOTE: perf on the 2-core Zen 5 put most samples of the generic kernel at one row on scalar loop
 * bookkeeping that GCC kept on the stack; the two side by side: bench/RESULTS.md
 * (`bench_quant.py --decode-batch`, `bench_engine.py --lean-decode`). */
QG_INLINE QG_T512VNNI void qg_q8_lean_mr(const uint8_t* blk, const qg_format* f, const qg_xq* q,
                                         long g0, long g1, float* acc, const int bits, const int mr,
                                         const int has_c) {
    const long G = f->group, nbg = G / QG_QB, mb = has_c ? 64 : 32, gb = qg_group_bytes(f);
    const long kp = q->kp, nb = q->nb;
    const int32_t off = has_c ? 0 : qg_q8_off_vnni(f);
    const long pf = qg_pf_bytes;
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F), flip = _mm512_set1_epi32((int)0x80808080);
    const uint8_t* meta = qg_groups(blk, f) + g0 * gb;
    const int8_t* xr = q->xq + g0 * G;          /* row r: xr + r kp */
    const float* sx = q->sx + g0 * nbg;         /* row r: sx + r nb */
    const int32_t* xi = q->xi + g0 * nbg;
    __m512 a[QG_MR_Q8];
    for (int r = 0; r < mr; r++) a[r] = _mm512_setzero_ps();
    for (long g = g0; g < g1; g++, meta += gb) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)meta));
        const uint8_t* row = meta + mb;
        for (long b = 0; b < nbg; b++, sx++, xi++) {
            __m512i ia[QG_MR_Q8], ib[QG_MR_Q8];
            for (int r = 0; r < mr; r++) {
                ia[r] = off ? _mm512_set1_epi32((int32_t)((uint32_t)0 - (uint32_t)off * (uint32_t)xi[r * nb]))
                            : _mm512_setzero_si512();
                ib[r] = _mm512_setzero_si512();
            }
            if (bits == 4) {
                #pragma GCC unroll 4
                for (int st = 0; st < QG_QB / 8; st++, row += 64, xr += 8) {
                    _mm_prefetch((const char*)row + pf, _MM_HINT_T0);
                    const __m512i v = _mm512_loadu_si512((const void*)row);
                    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
                    for (int r = 0; r < mr; r++) {
                        ia[r] = qg_dpbusd_bcast(ia[r], lo, (const int32_t*)(xr + r * kp));
                        ib[r] = qg_dpbusd_bcast(ib[r], hi, (const int32_t*)(xr + r * kp + 4));
                    }
                }
            } else {
                #pragma GCC unroll 8
                for (int st = 0; st < QG_QB / 4; st++, row += 64, xr += 4) {
                    _mm_prefetch((const char*)row + pf, _MM_HINT_T0);
                    const __m512i u = _mm512_xor_si512(_mm512_loadu_si512((const void*)row), flip);
                    for (int r = 0; r < mr; r++) {
                        if ((st & 1) && mr <= 2) ib[r] = qg_dpbusd_bcast(ib[r], u, (const int32_t*)(xr + r * kp));
                        else ia[r] = qg_dpbusd_bcast(ia[r], u, (const int32_t*)(xr + r * kp));
                    }
                }
            }
            for (int r = 0; r < mr; r++)
                a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia[r], ib[r])),
                                       _mm512_mul_ps(s, _mm512_set1_ps(sx[r * nb])), a[r]);
        }
        if (has_c) {
            const __m512 c = qg_c512(blk, f, meta, g, s);
            for (int r = 0; r < mr; r++) a[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(q->xs[r * q->ng + g]), a[r]);
        }
    }
    for (int r = 0; r < mr; r++) _mm512_store_ps(acc + r * QG_NB, a[r]);
}

/* A lean kernel NAME##_mr(..., has_c) of rows QT (qg_xq, qg_xt): its wrapper of each has_c, then
 * (QG_Q8_INST_M) their instances of each bit width it takes (int4, int8) and row count. */
#define QG_Q8_LEAN_INST(NAME, QT)                                                                 \
    QG_INLINE QG_T512VNNI void NAME##_c0_mr(const uint8_t* blk, const qg_format* f, const QT* q,  \
                                            long g0, long g1, float* acc, const int bits, const int mr) { \
        NAME##_mr(blk, f, q, g0, g1, acc, bits, mr, 0);                                            \
    }                                                                                             \
    QG_INLINE QG_T512VNNI void NAME##_c1_mr(const uint8_t* blk, const qg_format* f, const QT* q,  \
                                            long g0, long g1, float* acc, const int bits, const int mr) { \
        NAME##_mr(blk, f, q, g0, g1, acc, bits, mr, 1);                                            \
    }                                                                                             \
    QG_Q8_INST_M(NAME##_c0_mr, QG_T512VNNI, QT, 4)                                                \
    QG_Q8_INST_M(NAME##_c1_mr, QG_T512VNNI, QT, 4)                                                \
    QG_Q8_INST_M(NAME##_c0_mr, QG_T512VNNI, QT, 8)
/* The call of the instance of QG_Q8_LEAN_INST(NAME, ...) that takes f and m rows. */
#define QG_Q8_LEAN_CASES(NAME)                                                                    \
    if (f->bits == 8) { QG_Q8_CASES(NAME##_c0_mr, 8) }                                            \
    else if (qg_has_c(f)) { QG_Q8_CASES(NAME##_c1_mr, 4) }                                        \
    else { QG_Q8_CASES(NAME##_c0_mr, 4) }

QG_Q8_LEAN_INST(qg_q8_lean, qg_xq)

static QG_T512VNNI void qg_q8_vnni(const uint8_t* blk, const qg_format* f, const qg_xq* q,
                                   long g0, long g1, int m, float* acc) {
    if (qg_q8_lean_on && qg_q8t_lean_takes(f)) {
        QG_Q8_LEAN_CASES(qg_q8_lean)
        return;
    }
    switch (f->bits) {
        case 2: { QG_Q8_CASES(qg_q8_vnni_mr, 2) } break;
        case 3: { QG_Q8_CASES(qg_q8_vnni_mr, 3) } break;
        case 4: { QG_Q8_CASES(qg_q8_vnni_mr, 4) } break;
        case 5: { QG_Q8_CASES(qg_q8_vnni_mr, 5) } break;
        case 6: { QG_Q8_CASES(qg_q8_vnni_mr, 6) } break;
        default: { QG_Q8_CASES(qg_q8_vnni_mr, 8) } break;
    }
}

static QG_T512 void qg_q8_bw(const uint8_t* blk, const qg_format* f, const qg_xq* q, long g0,
                             long g1, int m, float* acc) {
    switch (f->bits) {
        case 2: { QG_Q8_CASES(qg_q8_bw_mr, 2) } break;
        case 3: { QG_Q8_CASES(qg_q8_bw_mr, 3) } break;
        case 4: { QG_Q8_CASES(qg_q8_bw_mr, 4) } break;
        case 5: { QG_Q8_CASES(qg_q8_bw_mr, 5) } break;
        case 6: { QG_Q8_CASES(qg_q8_bw_mr, 6) } break;
        default: { QG_Q8_CASES(qg_q8_bw_mr, 8) } break;
    }
}

/* ---- AVX2: the block as two 8-column halves, two rows at a time (16 ymm registers). */
QG_INLINE void qg_q8_avx2_mr(const uint8_t* blk, const qg_format* f, const qg_xq* q, long g0,
                             long g1, float* acc, const int bits, const int mr) {
    const long pk = qg_pk_of(bits);
    const long ub = qg_ub_of(bits);
    const long mb = qg_meta_bytes(f);
    const uint8_t* gbase = qg_groups(blk, f);  /* group g: gbase + g gb */
    const long gb = qg_group_bytes(f);
    const long G = f->group, ng = f->kp / G, nbg = qg_blocks_per_group(f);
    const int nl = bits == 4 && f->kind == QG_NL;
    /* int8 and the NL levels: the sign trick, no offset */
    const int off = bits != 8 && !nl ? qg_q8_off_vnni(f) : 0;
    const int has_c = bits != 8 && qg_has_c(f);
    const __m256i m4 = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
    const __m256i nls = QG_NL_S256();
    __m256 a[2][2];
    for (int r = 0; r < mr; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    (void)ng;
    for (long g = g0; g < g1; g++) {
        const uint8_t* meta = gbase + g * gb;
        __m256 s[2];
        for (int h = 0; h < 2; h++) s[h] = qg_s256(blk, f, meta, g, h);
        const uint8_t* row = meta + mb;
        for (long b = 0; b < nbg; b++) {
            const long k0 = g * G + b * QG_QB;
            const long k1 = k0 + QG_QB < (g + 1) * G ? k0 + QG_QB : (g + 1) * G;
            __m256i ia[2][2];
            for (int r = 0; r < mr; r++) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
            for (long k = k0; k < k1; k += pk, row += ub) {
                if (qg_pf_bytes)
                    for (long l = 0; l < ub; l += 64)
                        _mm_prefetch((const char*)row + l + qg_pf_bytes, _MM_HINT_T0);
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(row + 32 * h));
                    if (bits != 4 && bits != 8) {
                        /* v: the plane or crumb row (see the AVX-512 body); NOTE: two products
                         * of <= 63 * 127 per 16-bit lane twice: 32004, no saturation */
                        for (int rr = 0; rr < pk / 8; rr++) {
                            __m256i lo, hi;
                            qg_hb_merge256(row, v, bits, rr, h, &lo, &hi);
                            for (int r = 0; r < mr; r++) {
                                const int8_t* xr = q->xq + r * q->kp + k + 8 * rr;
                                __m256i p = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(lo, _mm256_set1_epi32(qg_ld32(xr))),
                                    _mm256_maddubs_epi16(hi, _mm256_set1_epi32(qg_ld32(xr + 4))));
                                ia[r][h] = _mm256_add_epi32(ia[r][h], _mm256_madd_epi16(p, ones));
                            }
                        }
                    } else if (bits == 4 && nl) {
                        const __m256i tl = _mm256_shuffle_epi8(nls, _mm256_and_si256(v, m4));
                        const __m256i th = _mm256_shuffle_epi8(nls, _mm256_and_si256(_mm256_srli_epi32(v, 4), m4));
                        const __m256i ul = _mm256_abs_epi8(tl), uh = _mm256_abs_epi8(th);
                        for (int r = 0; r < mr; r++) {
                            const int8_t* xr = q->xq + r * q->kp + k;
                            /* NOTE: |level| <= 127: each maddubs lane <= 2 * 127 * 127, so the
                             * two halves widen apart (their sum would overflow 16 bits) */
                            const __m256i pl = _mm256_maddubs_epi16(ul, _mm256_sign_epi8(_mm256_set1_epi32(qg_ld32(xr)), tl));
                            const __m256i ph = _mm256_maddubs_epi16(uh, _mm256_sign_epi8(_mm256_set1_epi32(qg_ld32(xr + 4)), th));
                            ia[r][h] = _mm256_add_epi32(ia[r][h], _mm256_add_epi32(_mm256_madd_epi16(pl, ones),
                                                                                   _mm256_madd_epi16(ph, ones)));
                        }
                    } else if (bits == 4) {
                        const __m256i lo = _mm256_and_si256(v, m4);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(v, 4), m4);
                        for (int r = 0; r < mr; r++) {
                            const int8_t* xr = q->xq + r * q->kp + k;
                            /* NOTE: two products of <= 15 * 127 per 16-bit lane: no saturation */
                            __m256i p = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, _mm256_set1_epi32(qg_ld32(xr))),
                                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(qg_ld32(xr + 4))));
                            ia[r][h] = _mm256_add_epi32(ia[r][h], _mm256_madd_epi16(p, ones));
                        }
                    } else {
                        const __m256i u = _mm256_abs_epi8(v);
                        for (int r = 0; r < mr; r++) {
                            __m256i xb = _mm256_sign_epi8(
                                _mm256_set1_epi32(qg_ld32(q->xq + r * q->kp + k)), v);
                            ia[r][h] = _mm256_add_epi32(
                                ia[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xb), ones));
                        }
                    }
                }
            }
            const long bi = g * nbg + b;
            for (int r = 0; r < mr; r++) {
                const __m256 sxr = _mm256_set1_ps(q->sx[r * q->nb + bi]);
                const __m256i o = _mm256_set1_epi32(off * q->xi[r * q->nb + bi]);
                for (int h = 0; h < 2; h++)
                    a[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ia[r][h], o)),
                                              _mm256_mul_ps(s[h], sxr), a[r][h]);
            }
        }
        if (has_c) {
            for (int h = 0; h < 2; h++) {
                __m256 c = qg_c256(blk, f, meta, g, s[h], h);
                for (int r = 0; r < mr; r++)
                    a[r][h] = _mm256_fmadd_ps(c, _mm256_set1_ps(q->xs[r * q->ng + g]), a[r][h]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) _mm256_store_ps(acc + r * QG_NB + 8 * h, a[r][h]);
}

static void qg_q8_avx2(const uint8_t* blk, const qg_format* f, const qg_xq* q, long g0, long g1,
                       int m, float* acc) {
    for (int r0 = 0; r0 < m; r0 += 2) {
        qg_xq qr = *q;
        qr.xq += r0 * q->kp;
        qr.sx += r0 * q->nb;
        qr.xi += r0 * q->nb;
        qr.xs += r0 * q->ng;
        const int two = m - r0 >= 2;
#define QG_AVX2_CASE(b)                                                                 \
    case b:                                                                             \
        if (two) qg_q8_avx2_mr(blk, f, &qr, g0, g1, acc + r0 * QG_NB, b, 2);            \
        else qg_q8_avx2_mr(blk, f, &qr, g0, g1, acc + r0 * QG_NB, b, 1);                \
        break;
        switch (f->bits) {
            QG_AVX2_CASE(2) QG_AVX2_CASE(3) QG_AVX2_CASE(4) QG_AVX2_CASE(5) QG_AVX2_CASE(6)
            default: QG_AVX2_CASE(8)
        }
#undef QG_AVX2_CASE
    }
}

/* acc[r * 16 + j] = sum over groups g0 <= g < g1 of block `blk`, rows r < m <= QG_MR_Q8 */
typedef void (*qg_q8_fn)(const uint8_t*, const qg_format*, const qg_xq*, long, long, int, float*);

static inline qg_q8_fn qg_q8_kernel(int level) {
    return level >= 2 ? qg_q8_vnni : level >= 1 ? qg_q8_bw : qg_q8_avx2;
}

/* How many k slices each column block of a GEMV of Q int8 rows is cut into on nt threads
 * (split.h): 1 unless whole blocks would leave threads idle. */
static inline long qg_q8_slices(const qg_format* f, long Q, int nt) {
    const long ng = f->kp / f->group, nblocks = (f->n + QG_NB - 1) / QG_NB;
    return Q <= QG_MR_Q8 ? nr_split_count(nblocks, nt, ng < QG_MAX_SLICES ? ng : QG_MAX_SLICES, 0.12) : 1;
}

/* With `resid` (rows 2i and 2i + 1 are one output row; m is even): add each pair into row i of
 * acc. Returns the output rows acc holds. */
static inline int qg_fold_resid(float* acc, int m, int resid) {
    if (!resid) return m;
    for (int i = 0; i < m / 2; i++)
        for (int j = 0; j < QG_NB; j++)
            acc[i * QG_NB + j] = acc[2 * i * QG_NB + j] + acc[(2 * i + 1) * QG_NB + j];
    return m / 2;
}

/* Thread tid of nt: its contiguous share of the ns * nblocks tasks of out[M, N] = q @ W^T + bias
 * (Q int8 rows; with `resid` rows 2i and 2i + 1 are one output row; out rows ldo apart). With
 * ns > 1 each task stores its slice's partial sums into part [ns][M][N] instead
 * (qg_q8_sum_parts adds them). */
static void qg_q8_share(const uint8_t* w, const qg_format* f, const qg_xq* q, long Q, long M,
                        const float* bias, float* out, long ldo, float* part, long ns, qg_q8_fn fn,
                        int resid, int tid, int nt) {
    const long ng = q->ng, nb = q->nb, nblocks = (f->n + QG_NB - 1) / QG_NB, bb = qg_block_bytes(f);
    float acc[QG_MR_Q8 * QG_NB] __attribute__((aligned(64)));
    long t0, t1;
    nr_share(nblocks * ns, tid, nt, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        const long b = t / ns, sp = t % ns, g0 = sp * ng / ns, g1 = (sp + 1) * ng / ns;
        for (long r0 = 0; r0 < Q; r0 += QG_MR_Q8) {
            int m = (int)(Q - r0 < QG_MR_Q8 ? Q - r0 : QG_MR_Q8);
            const qg_xq qr = {q->xq + r0 * q->kp, q->sx + r0 * nb, q->xi + r0 * nb,
                              q->xs + r0 * ng, q->kp, nb, ng};
            fn(w + b * bb, f, &qr, g0, g1, m, acc);
            m = qg_fold_resid(acc, m, resid);
            const long o0 = resid ? r0 / 2 : r0;
            if (ns == 1) qg_store(acc, m, b * QG_NB, f->n, ldo, bias, out + o0 * ldo);
            else qg_store(acc, m, b * QG_NB, f->n, f->n, NULL, part + (sp * M + o0) * f->n);
        }
    }
}

/* Elements [i0, i1) of out[M, N] (rows ldo apart) = bias + the ns partials [ns][M][N], in a fixed
 * order (results do not depend on timing); after a barrier that follows every qg_q8_share. */
static void qg_q8_sum_parts(const float* part, long ns, long M, long N, const float* bias,
                            float* out, long ldo, long i0, long i1) {
    for (long i = i0; i < i1; i++) {
        float v = bias ? bias[i % N] : 0.0f;
        for (long sp = 0; sp < ns; sp++) v += part[sp * M * N + i];
        out[(i / N) * ldo + i % N] = v;
    }
}

#include "qgemm_q8tile.h"
#include "qgemm_amx.h"

/* out[M, N] = xq(x)[M, kp] @ W^T + bias; level: 2 VNNI, 1 AVX-512BW, 0 AVX2. `resid`: each row
 * runs as two int8 rows (x and its residual, qg_quantize_x) whose products are added before
 * the store. Each 16-column block meets the rows QG_MR_Q8 at a time (it stays in L1/L2 between
 * them). 0, or -1 when out of memory. */
static int qg_forward_q8(const uint8_t* w, const qg_format* f, const float* x, long M, long ldx,
                         const float* bias, float* out, int level, int resid) {
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f);
    const long Q = resid ? 2 * M : M;  /* int8 rows */
    /* one scratch: sx [Q nb] + xs [Q ng] floats, xi [Q nb], res [M kp] floats (resid only),
     * xq [Q kp] (64-byte aligned parts) */
    const size_t fb = (sizeof(float) * (size_t)(Q * nb + Q * ng) + 63) & ~(size_t)63;
    const size_t ib = (sizeof(int32_t) * (size_t)(Q * nb) + 63) & ~(size_t)63;
    const size_t rb = resid ? sizeof(float) * (size_t)(M * f->kp) : 0;
    const int tiles = level >= 2 && Q > QG_MR_Q8 && qg_q8_tiles && qg_tileable(f);
    const int amx = tiles && qg_amx && qg_amx_fits(f);
    /* AMX loads whole 16-row tiles: the last one may read up to 15 rows past xq (not stored) */
    const size_t pad = amx ? (size_t)((QG_MR_AMX - 1) * f->kp) : 0;
    char* scratch = (char*)qg_scratch_get(fb + ib + rb + (size_t)(Q * f->kp) + pad);
    if (scratch == NULL) return -1;
    float* sx = (float*)scratch;
    int32_t* xi = (int32_t*)(scratch + fb);
    float* res = resid ? (float*)(scratch + fb + ib) : NULL;
    int8_t* xq = (int8_t*)(scratch + fb + ib + rb);
    qg_quantize_x(x, M, ldx, f, xq, sx, xi, sx + Q * nb, resid, res);
    const qg_xq q = {xq, sx, xi, sx + Q * nb, f->kp, nb, ng};
    if (tiles) {
        /* many rows: AMX-INT8 matrix tiles (qgemm_amx.h) where present, else VNNI row tiles
         * (qgemm_q8tile.h); both first lay out the rows' scalars (and the row tiles the rows) */
        char* tb = (char*)malloc(amx ? qg_amx_rows_bytes(f, Q) : qg_tiles_bytes(f, Q));
        if (tb == NULL) {
            qg_scratch_put(scratch);
            return -1;
        }
        qg_amx_rows A;
        qg_tiles T;
        if (amx) A = qg_amx_rows_at(tb, &q, Q);
        else T = qg_tiles_at(tb, f, Q);
        #pragma omp parallel
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            if (amx) qg_amx_rows_fill(&A, &q, Q, tid, nt);
            else qg_tiles_fill(&T, &q, f, Q, tid, nt);
            #pragma omp barrier
            if (amx) qg_amx_share(w, f, &q, &A, Q, bias, out, f->n, resid, tid, nt);
            else qg_q8t_share(w, f, &T, Q, bias, out, f->n, resid, tid, nt);
        }
        free(tb);
        qg_scratch_put(scratch);
        return 0;
    }
    const qg_q8_fn fn = qg_q8_kernel(level);
    /* NOTE: column blocks that do not share out evenly over the threads (down_proj on 16 cores:
     * 56 blocks) are cut into `ns` ranges of groups whose partial sums are added at the end;
     * split.h says when. */
    const long ns = qg_q8_slices(f, Q, omp_get_max_threads());
    float* part = ns > 1 ? (float*)malloc(sizeof(float) * (size_t)(ns * M * f->n)) : NULL;
    if (ns > 1 && part == NULL) {
        qg_scratch_put(scratch);
        return -1;
    }
    #pragma omp parallel
    {
        /* NOTE: each thread's contiguous share by hand rather than `omp for`: no barrier after
         * the loop unless partial sums follow (the region's end is one already) */
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        qg_q8_share(w, f, &q, Q, M, bias, out, f->n, part, ns, fn, resid, tid, nt);
        if (ns > 1) {
            long i0, i1;
            nr_share(M * f->n, tid, nt, &i0, &i1);
            #pragma omp barrier
            qg_q8_sum_parts(part, ns, M, f->n, bias, out, f->n, i0, i1);
        }
    }
    free(part);
    qg_scratch_put(scratch);
    return 0;
}

#endif
