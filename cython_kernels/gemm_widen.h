/* Block kernels for CPUs without AVX512_BF16 (gemm_kernels.h levels 0 and 1): bf16 weights are
 * widened to f32 in registers, products accumulate in f32 with FMA. Same packed layouts and the
 * same block-kernel contract as gemm_avx512.h:
 *   acc[m][64] (=) sum over k-steps s0..s1 of one 64-column weight block times m rows of x.
 * Here x is f32 [m][ldx = Kp]: for bf16 weights its values are already rounded to bf16 (as the
 * AVX512_BF16 path and the reference do), so every level computes the same products.
 *
 * A bf16 k-pair row of a block is 64 columns x 2 k = 128 uint16. Read as 32-bit lanes, lane j
 * holds (k even in the low half, k odd in the high half) of column j, so one shift and one and
 * turn 8 (AVX2) or 16 (AVX-512) lanes into two f32 vectors: no shuffles.
 *
 * m == 1 (batch-1 decode: bandwidth-bound) widens in registers while it streams the block.
 * m >= 2 widens a chunk of GEMM_WK k-steps into an f32 scratch [k][64] in L1 once and runs an
 * f32 register tile (tile_kernels.h) over it, so the widening is paid once for all m rows.
 */
#ifndef NUMA_RUNTIME_GEMM_WIDEN_H
#define NUMA_RUNTIME_GEMM_WIDEN_H

#define GEMM_WK 64 /* k-steps per widened chunk: 64 x 64 x 4 B = 16 KiB of f32 in L1 */

/* ------------------------------------------------------------------- AVX2 (+FMA), level 0 */

GEMM_INLINE __m256 gemm_lo8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
GEMM_INLINE __m256 gemm_hi8(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* acc[0:64] = x[2p0:2p1] . block, bf16 pairs widened in registers (one row of x). */
static void gemm_row1_bf16_avx2(const uint16_t* wb, const float* x, long p0, long p1,
                                float* acc) {
    __m256 c[8];
    for (int j = 0; j < 8; j++) c[j] = _mm256_setzero_ps();
    for (long p = p0; p < p1; p++) {
        const __m256i* row = (const __m256i*)(wb + p * 2 * GEMM_NB);
        __m256 x0 = _mm256_broadcast_ss(x + 2 * p), x1 = _mm256_broadcast_ss(x + 2 * p + 1);
        for (int j = 0; j < 8; j++) {
            __m256i v = _mm256_load_si256(row + j);
            c[j] = _mm256_fmadd_ps(gemm_lo8(v), x0, c[j]);
            c[j] = _mm256_fmadd_ps(gemm_hi8(v), x1, c[j]);
        }
    }
    for (int j = 0; j < 8; j++) _mm256_store_ps(acc + 8 * j, c[j]);
}

/* acc[0:64] = x[k0:k1] . f32 block [k][64] (one row of x). */
static void gemm_row1_f32_avx2(const float* wb, const float* x, long k0, long k1, float* acc) {
    __m256 c[8];
    for (int j = 0; j < 8; j++) c[j] = _mm256_setzero_ps();
    for (long k = k0; k < k1; k++) {
        __m256 xb = _mm256_broadcast_ss(x + k);
        for (int j = 0; j < 8; j++)
            c[j] = _mm256_fmadd_ps(_mm256_load_ps(wb + k * GEMM_NB + 8 * j), xb, c[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_store_ps(acc + 8 * j, c[j]);
}

/* wf[2 (p - p0)][64], wf[2 (p - p0) + 1][64] = the two k rows of bf16 pair p, for p0..p1. */
static void gemm_widen_avx2(const uint16_t* wb, long p0, long p1, float* wf) {
    for (long p = p0; p < p1; p++) {
        const __m256i* row = (const __m256i*)(wb + p * 2 * GEMM_NB);
        float* d = wf + 2 * (p - p0) * GEMM_NB;
        for (int j = 0; j < 8; j++) {
            __m256i v = _mm256_load_si256(row + j);
            _mm256_store_ps(d + 8 * j, gemm_lo8(v));
            _mm256_store_ps(d + GEMM_NB + 8 * j, gemm_hi8(v));
        }
    }
}

static void gemm_block_bf16_avx2(const void* wv, const void* xv, int m, long kp, long p0,
                                 long p1, float* acc) {
    const uint16_t* wb = (const uint16_t*)wv;
    const float* x = (const float*)xv;
    if (m == 1) {
        gemm_row1_bf16_avx2(wb, x, p0, p1, acc);
        return;
    }
    float wf[2 * (GEMM_WK / 2) * GEMM_NB] __attribute__((aligned(64)));  /* [GEMM_WK][64] */
    for (long c0 = p0; c0 < p1; c0 += GEMM_WK / 2) {
        long c1 = c0 + GEMM_WK / 2 < p1 ? c0 + GEMM_WK / 2 : p1;
        gemm_widen_avx2(wb, c0, c1, wf);
        nr_mm_avx2(x + 2 * c0, kp, wf, GEMM_NB, acc, GEMM_NB, m, GEMM_NB, 2 * (c1 - c0), c0 == p0);
    }
}

static void gemm_block_f32_avx2(const void* wv, const void* xv, int m, long kp, long k0, long k1,
                                float* acc) {
    const float* wb = (const float*)wv;
    const float* x = (const float*)xv;
    if (m == 1) {
        gemm_row1_f32_avx2(wb, x, k0, k1, acc);
        return;
    }
    for (long c0 = k0; c0 < k1; c0 += GEMM_WK) {
        long c1 = c0 + GEMM_WK < k1 ? c0 + GEMM_WK : k1;
        nr_mm_avx2(x + c0, kp, wb + c0 * GEMM_NB, GEMM_NB, acc, GEMM_NB, m, GEMM_NB, c1 - c0, c0 == k0);
    }
}

/* ------------------------------------------------------ AVX-512F without BF16, level 1 */

GEMM_INLINE GEMM_T_AVX512 __m512 gemm_lo16(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
GEMM_INLINE GEMM_T_AVX512 __m512 gemm_hi16(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

static GEMM_T_AVX512 void gemm_row1_bf16_avx512f(const uint16_t* wb, const float* x, long p0,
                                                 long p1, float* acc) {
    /* NOTE: two accumulator sets (even and odd k) so each FMA chain gets one op per pair. */
    __m512 c[4], d[4];
    for (int j = 0; j < 4; j++) c[j] = d[j] = _mm512_setzero_ps();
    for (long p = p0; p < p1; p++) {
        const uint16_t* row = wb + p * 2 * GEMM_NB;
        __m512 x0 = _mm512_set1_ps(x[2 * p]), x1 = _mm512_set1_ps(x[2 * p + 1]);
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_load_si512((const void*)(row + 32 * j));
            c[j] = _mm512_fmadd_ps(gemm_lo16(v), x0, c[j]);
            d[j] = _mm512_fmadd_ps(gemm_hi16(v), x1, d[j]);
        }
    }
    for (int j = 0; j < 4; j++) _mm512_store_ps(acc + 16 * j, _mm512_add_ps(c[j], d[j]));
}

static GEMM_T_AVX512 void gemm_widen_avx512f(const uint16_t* wb, long p0, long p1, float* wf) {
    for (long p = p0; p < p1; p++) {
        const uint16_t* row = wb + p * 2 * GEMM_NB;
        float* d = wf + 2 * (p - p0) * GEMM_NB;
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_load_si512((const void*)(row + 32 * j));
            _mm512_store_ps(d + 16 * j, gemm_lo16(v));
            _mm512_store_ps(d + GEMM_NB + 16 * j, gemm_hi16(v));
        }
    }
}

/* Level 1 bf16: acc[m][64] over k-pairs p0..p1; the f32 tile is gemm_avx512.h's. */
static GEMM_T_AVX512 void gemm_block_bf16_avx512f(const void* wv, const void* xv, int m, long kp,
                                                  long p0, long p1, float* acc) {
    const uint16_t* wb = (const uint16_t*)wv;
    const float* x = (const float*)xv;
    if (m == 1) {
        gemm_row1_bf16_avx512f(wb, x, p0, p1, acc);
        return;
    }
    float wf[2 * (GEMM_WK / 2) * GEMM_NB] __attribute__((aligned(64)));  /* [GEMM_WK][64] */
    for (long c0 = p0; c0 < p1; c0 += GEMM_WK / 2) {
        long c1 = c0 + GEMM_WK / 2 < p1 ? c0 + GEMM_WK / 2 : p1;
        int first = c0 == p0;
        long nk = 2 * (c1 - c0);
        gemm_widen_avx512f(wb, c0, c1, wf);
        for (int r0 = 0; r0 < m; r0 += GEMM_MR) {
            int mr = m - r0 < GEMM_MR ? m - r0 : GEMM_MR;
            NR_MR_SWITCH(gemm_tile_f32, mr, wf, x + r0 * kp + 2 * c0, kp, 0, nk,
                             acc + r0 * GEMM_NB)
        }
    }
}

#endif
