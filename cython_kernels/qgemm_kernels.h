/* Quantized linear kernels: y[M, N] = x[M, K] @ W^T + bias with W stored as int8/int4 groups.
 *
 * Packed layout (numa_runtime/quant/packing.py writes it, qgemm.pyx documents it): W [N, Kp] is
 * cut into blocks of QG_NB = 16 output columns; each block is ONE contiguous stream of groups:
 *   group g: [scales f16 x 16][offsets f16 x 16, absent for symmetric][rows]
 *   int4 row: 16 uint32 lanes (64 bytes); lane j holds column j at k = 8r..8r+7, nibble i at
 *             bits 4i..4i+3, unsigned 0..15;
 *   int8 row: 16 int32 lanes; lane j holds column j at k = 4r..4r+3, byte i = k 4r+i, signed;
 *   int5/int6 unit of U = 32/16 k (GGUF Q5_x/Q6_K): a plane row (lane j: the high bits of
 *             column j's U codes, unit-local k = 8r + 2b + e at bit 8b + (bits - 4)(2r + e))
 *             and U / 8 int4 rows of the low nibbles (packing.py);
 *   int2/int3 unit of U = 16 k (GGUF Q2_K/Q3_K): a crumb row (lane j: the low 2 bits of column
 *             j's 16 codes, k = 8r + 2b + e at bit 8b + 2(2r + e)), and for int3 four 64-bit
 *             words of third bits (word 2r + e: bit 4j + b), one per byte vector of the int4 path.
 * Dequantized weight w = q * s + c, in f32 and exact (an f16 scale times a <= 8-bit integer
 * needs at most 19 significant bits):
 *   int8 symmetric: c = 0;  int2-6 symmetric: c = -2^(bits-1) s (int4: -8 s);  zero point z:
 *   c = -s z;  min m: c = m;  int4 "nl": w = qg_nl_levels[q] s.
 * So the kernels see the very same f32 weights as the numpy reference; only the order of the
 * sums differs.
 *
 * Paths: m <= QG_MR_REG rows dequantize in registers while streaming (decode); more rows
 * dequantize a chunk of a block to an f32 tile in L1 and run an FMA register tile over it.
 */
#ifndef NUMA_RUNTIME_QGEMM_KERNELS_H
#define NUMA_RUNTIME_QGEMM_KERNELS_H

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QG_NB 16        /* output columns per block */
#define QG_KC 256       /* k per L1 tile of dequantized weights: 16 KiB of f32 */
#define QG_MPASS 128    /* activation rows per pass over a block on the L1 path */

enum { QG_SYM = 0, QG_ZERO = 1, QG_MIN = 2, QG_NL = 3 };

/* QG_NL: the int4 code indexes these levels (GGUF IQ4_NL/IQ4_XS), w = level * s; the kernels
 * look them up in registers: a byte shuffle (int8 dot products) or a float permute. */
static const int8_t qg_nl_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1, 13, 25, 38, 53, 69, 89, 113};
/* The levels as int8 in each 128-bit lane, for byte shuffles (inside AVX-512 / AVX2 code). */
#define QG_NL_S512() _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)qg_nl_levels))
#define QG_NL_S256() _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)qg_nl_levels))

typedef struct {
    int bits;     /* 2, 3, 4, 5, 6 or 8 */
    int kind;     /* QG_SYM, QG_ZERO, QG_MIN, QG_NL */
    long group;   /* k per group (divides kp) */
    long kp;      /* padded K (multiple of 8 for int4, 4 for int8) */
    long n;       /* output columns */
    long ks;      /* k per super-block of int8 sub-scales (GGUF K-quants: 256), 0: f16 scales */
} qg_format;

/* k per packed unit (a row for int4/int8) and the unit's bytes, by bit width (a constant where
 * the kernels are instantiated per width) */
static inline long qg_pk_of(int bits) { return bits == 4 ? 8 : bits == 8 ? 4 : bits == 5 ? 32 : 16; }
static inline long qg_ub_of(int bits) {
    return bits == 4 || bits == 8 || bits == 2 ? 64 : bits == 3 ? 96 : 64 + qg_pk_of(bits) / 8 * 64;
}
static inline long qg_pack_k(const qg_format* f) { return qg_pk_of(f->bits); }
/* Units that the kernels merge into the int4 path's nibble bytes (qg_hb_merge512): int2/3/5/6 */
static inline int qg_is_hb(const qg_format* f) { return f->bits != 4 && f->bits != 8; }
static inline long qg_unit_bytes(const qg_format* f) { return qg_ub_of(f->bits); }
/* The row-tile kernels (qgemm_q8tile.h) read every layout; AMX-INT8 (qgemm_amx.h, qg_amx_fits)
 * those whose blocks are whole. */
static inline int qg_tileable(const qg_format* f) { (void)f; return 1; }
/* Whether groups carry a zero point or min (w = q s + c with c their own). */
static inline int qg_has_c(const qg_format* f) { return f->kind == QG_ZERO || f->kind == QG_MIN; }
/* int2 with ks (GGUF Q2_K): each column's 4-bit sub-scale and min in one byte (sc | m << 4). */
static inline int qg_nib_meta(const qg_format* f) { return f->ks && f->bits == 2; }
/* A group's meta for 16 columns: f16 scales [+ f16 offsets], or with ks int8 sub-scales
 * [+ int8 mins] (int2: one byte each, qg_nib_meta); with ks each block's stream starts with its
 * super-blocks' f16 d [+ f16 dmin]. */
static inline long qg_meta_bytes(const qg_format* f) {
    return qg_nib_meta(f) ? 16 : (f->ks ? 16 : 32) * (qg_has_c(f) ? 2 : 1);
}
static inline long qg_group_bytes(const qg_format* f) {
    return qg_meta_bytes(f) + f->group / qg_pack_k(f) * qg_unit_bytes(f);
}
static inline long qg_super_each(const qg_format* f) { return qg_has_c(f) ? 64 : 32; }
static inline long qg_super_bytes(const qg_format* f) {
    return f->ks ? f->kp / f->ks * qg_super_each(f) : 0;
}
static inline long qg_block_bytes(const qg_format* f) {
    return qg_super_bytes(f) + f->kp / f->group * qg_group_bytes(f);
}
/* The first group's meta in block blk: group g's is qg_group_bytes(f) further each (the kernels
 * take both once, outside their group loops), its rows follow its meta. */
static inline const uint8_t* qg_groups(const uint8_t* blk, const qg_format* f) {
    return blk + qg_super_bytes(f);
}
/* Group g's super-block scales (ks formats; ks is QG_KS, checked where a QLinear is made, so the
 * division is a shift). */
#define QG_KS 256
static inline const uint8_t* qg_super_of(const uint8_t* blk, const qg_format* f, long g) {
    return blk + g * f->group / QG_KS * qg_super_each(f);
}

/* Half h (columns 8h..8h+7) of group g's scale s and, for the asymmetric kinds, the c of
 * w = q s + c: f16 values, or with ks d * sc and -dmin * m (exact in f32). */
/* Columns 8h..8h+7 of a ks group's int8 sub-scales (which 0) or mins (1), as int32 lanes. */
static inline __m256i qg_sub256(const qg_format* f, const uint8_t* meta, int which, int h) {
    if (qg_nib_meta(f)) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(meta + 8 * h)));
        return which ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
    }
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(meta + 16 * which + 8 * h)));
}
static inline __m256 qg_s256(const uint8_t* blk, const qg_format* f, const uint8_t* meta, long g, int h) {
    if (!f->ks) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(meta + 16 * h)));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(qg_super_of(blk, f, g) + 16 * h)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(qg_sub256(f, meta, 0, h)));
}
static inline __m256 qg_c256(const uint8_t* blk, const qg_format* f, const uint8_t* meta, long g, __m256 s, int h) {
    if (f->ks) {
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(qg_super_of(blk, f, g) + 32 + 16 * h)));
        const __m256 m = _mm256_cvtepi32_ps(qg_sub256(f, meta, 1, h));
        return _mm256_fnmadd_ps(dm, m, _mm256_setzero_ps());
    }
    const __m256 o = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(meta + 32 + 16 * h)));
    /* zero point: c = -(s z), exact; min: c = m */
    return f->kind == QG_ZERO ? _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(s, o)) : o;
}

/* 2: AVX-512 with VNNI, 1: AVX-512 F/BW/VL/DQ, 0: AVX2 + FMA + F16C (the build's floor).
 * Only the int8-activation decode path (qgemm_q8.h) tells 2 from 1. */
static int qg_cpu_level(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
        return 0;
    return __builtin_cpu_supports("avx512vnni") ? 2 : 1;
}

/* Per-k contract shared by both ISA levels:
 *   dequant(block, f, k0, k1, tile): tile[(k - k0) * 16 + j] = w[j, k] for k0 <= k < k1
 *     (k0, k1 multiples of the row pack);
 *   gemv(block, f, x, ldx, m, acc): acc[r * 16 + j] = sum_k x[r, k] w[j, k], r < m <= MR_REG;
 *   tile(wt, kc, x, ldx, m, acc, first): acc[r * 16 + j] (+)= x[r, :kc] . wt[:kc, j]. */
typedef void (*qg_dequant_fn)(const uint8_t*, const qg_format*, long, long, float*);
typedef void (*qg_gemv_fn)(const uint8_t*, const qg_format*, const float*, long, int, float*);
typedef void (*qg_tile_fn)(const float*, long, const float*, long, int, float*, int);

#include "qgemm_avx2.h"
#include "qgemm_hb.h"
#include "qgemm_avx512.h"

static inline void qg_store(const float* acc, int m, long n0, long N, long ldo, const float* bias,
                            float* out) {
    long w = N - n0 < QG_NB ? N - n0 : QG_NB;
    if (w == QG_NB) {  /* a full block: two 8-float vectors a row (the same sums) */
        const __m256 b0 = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + n0 + 8) : _mm256_setzero_ps();
        for (int r = 0; r < m; r++) {
            _mm256_storeu_ps(out + r * ldo + n0, _mm256_add_ps(_mm256_loadu_ps(acc + r * QG_NB), b0));
            _mm256_storeu_ps(out + r * ldo + n0 + 8, _mm256_add_ps(_mm256_loadu_ps(acc + r * QG_NB + 8), b1));
        }
        return;
    }
    for (int r = 0; r < m; r++)
        for (long j = 0; j < w; j++)
            out[r * ldo + n0 + j] = acc[r * QG_NB + j] + (bias ? bias[n0 + j] : 0.0f);
}

/* out[M, N] = x[M, kp] @ W^T + bias; x rows have stride ldx (>= kp, zero beyond K). */
static int qg_forward(const uint8_t* w, const qg_format* f, const float* x, long M, long ldx,
                      const float* bias, float* out, int level) {
    qg_dequant_fn dq = level >= 1 ? qg_dequant_avx512 : qg_dequant_avx2;
    qg_gemv_fn gv = level >= 1 ? qg_gemv_avx512 : qg_gemv_avx2;
    qg_tile_fn tl = level >= 1 ? qg_tile_avx512 : qg_tile_avx2;
    int mr_reg = level >= 1 ? QG_MR_REG_AVX512 : QG_MR_REG_AVX2;
    long nblocks = (f->n + QG_NB - 1) / QG_NB, bb = qg_block_bytes(f);
    int err = 0;
    #pragma omp parallel
    {
        float* acc = (float*)aligned_alloc(64, sizeof(float) * QG_MPASS * QG_NB);
        float* wt = (float*)aligned_alloc(64, sizeof(float) * QG_KC * QG_NB);
        if (acc == NULL || wt == NULL) {
            #pragma omp atomic write
            err = 1;
        }
        long chunk = nblocks / (8L * omp_get_num_threads());
        #pragma omp for schedule(dynamic, chunk < 1 ? 1 : chunk)
        for (long b = 0; b < nblocks; b++) {
            if (acc == NULL || wt == NULL) continue;
            const uint8_t* blk = w + b * bb;
            if (M <= mr_reg && !qg_is_hb(f)) {  /* int5/int6 take the L1 path */
                gv(blk, f, x, ldx, (int)M, acc);
                qg_store(acc, (int)M, b * QG_NB, f->n, f->n, bias, out);
                continue;
            }
            for (long m0 = 0; m0 < M; m0 += QG_MPASS) {
                int m = (int)(M - m0 < QG_MPASS ? M - m0 : QG_MPASS);
                for (long k0 = 0; k0 < f->kp; k0 += QG_KC) {
                    long k1 = k0 + QG_KC < f->kp ? k0 + QG_KC : f->kp;
                    dq(blk, f, k0, k1, wt);
                    tl(wt, k1 - k0, x + m0 * ldx + k0, ldx, m, acc, k0 == 0);
                }
                qg_store(acc, m, b * QG_NB, f->n, f->n, bias, out + m0 * f->n);
            }
        }
        free(acc);
        free(wt);
    }
    return err ? -1 : 0;
}

#include "qgemm_q8.h"

/* ----------------------------------------------------------- bf16 panels for the large-M path
 * Columns n0..n1 of W (n0 a multiple of 64) dequantized and rounded to bf16 (nearest-even) into
 * a panel in gemm.pyx's bf16 layout BA16a64b2a = [ceil((n1 - n0) / 64)][kpp / 2][64][2]:
 *   panel[(c / 64) * kpp * 64 + (k / 2) * 128 + (c % 64) * 2 + k % 2] = bf16(w[n0 + c][k])
 * for k < K, c < n1 - n0, and zero elsewhere (oneDNN requires zero padding). kpp: the panel's
 * padded K (>= f->kp). Needs AVX-512 BF16 (the caller checks). 0, or -1 when out of memory. */
#define QG_TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

static QG_TBF16 int qg_dequant_panel_bf16(const uint8_t* w, const qg_format* f, long K, long n0,
                                          long n1, long kpp, uint16_t* panel) {
    const long ncols = n1 - n0, nblk = (ncols + 63) / 64 * 64 / QG_NB, bb = qg_block_bytes(f);
    int err = 0;
    #pragma omp parallel
    {
        float* tile = (float*)aligned_alloc(64, sizeof(float) * QG_KC * QG_NB);
        if (tile == NULL) {
            #pragma omp atomic write
            err = 1;
        }
        /* element 2j <- row k column j, 2j + 1 <- row k + 1 column j (cvtne2ps puts row k low) */
        uint16_t ix[32];
        for (int j = 0; j < 16; j++) {
            ix[2 * j] = (uint16_t)j;
            ix[2 * j + 1] = (uint16_t)(16 + j);
        }
        const __m512i idx = _mm512_loadu_si512((const void*)ix);
        #pragma omp for schedule(static)
        for (long i = 0; i < nblk; i++) {
            if (tile == NULL) continue;
            const long c0 = i * QG_NB, left = ncols - c0;
            const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF
                                 : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
            uint16_t* pb = panel + (c0 / 64) * kpp * 64 + (c0 % 64) * 2;
            const uint8_t* blk = w + (n0 / QG_NB + i) * bb;
            for (long k0 = 0; k0 < kpp; k0 += QG_KC) {
                long kend = k0 + QG_KC < kpp ? k0 + QG_KC : kpp;
                if (live && k0 < f->kp)
                    qg_dequant_avx512(blk, f, k0, kend < f->kp ? kend : f->kp, tile);
                for (long k = k0; k < kend; k += 2) {
                    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
                    if (live && k < K) a = _mm512_maskz_loadu_ps(live, tile + (k - k0) * QG_NB);
                    if (live && k + 1 < K) b = _mm512_maskz_loadu_ps(live, tile + (k + 1 - k0) * QG_NB);
                    __m512i v = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
                    _mm512_storeu_si512((void*)(pb + (k / 2) * 128), v);
                }
            }
        }
        free(tile);
    }
    return err ? -1 : 0;
}

#include "qgemm_amxbf16.h"

#endif
