/* Small register-tiled f32 matrix products for the attention kernels: C[m][n] (+)= A[m][k] B[k][n].
 *
 * A: rows of stride lda (any k); B: rows of stride ldb; C: rows of stride ldc; n a multiple of
 * 16; B and C 32-byte aligned rows (ldb, ldc multiples of 8 floats). Tiles of 6 rows: AVX2 6 x 16
 * (12 ymm accumulators), AVX-512 6 x 64 then 6 x 16 (24 / 6 zmm accumulators). The AVX-512 path
 * is compiled with a target attribute and chosen at run time, so one build runs everywhere.
 */
#ifndef NR_TILE_KERNELS_H
#define NR_TILE_KERNELS_H

#include <immintrin.h>

#define NR_MR 6
#define NR_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define NR_ALWAYS static inline __attribute__((always_inline))

/* 2: AVX-512 BF16 too (attention_bf16.h, for bf16 caches), 1: AVX-512F/BW/VL/DQ, 0: AVX2 + FMA
 * only (the build's floor). */
static int nr_tile_level(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
        return 0;
    return __builtin_cpu_supports("avx512bf16") ? 2 : 1;
}

NR_ALWAYS void nr_tile_avx2(const float *A, long lda, const float *B, long ldb, float *C,
                            long ldc, long k, const int mr, int first) {
    __m256 c[NR_MR][2];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 2; j++)
            c[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(C + r * ldc + 8 * j);
    for (long p = 0; p < k; p++) {
        __m256 b0 = _mm256_loadu_ps(B + p * ldb), b1 = _mm256_loadu_ps(B + p * ldb + 8);
        for (int r = 0; r < mr; r++) {
            __m256 a = _mm256_broadcast_ss(A + r * lda + p);
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 2; j++) _mm256_storeu_ps(C + r * ldc + 8 * j, c[r][j]);
}

/* NW zmm columns (16 floats each) per tile. */
#define NR_TILE512(NAME, NW)                                                                  \
    NR_ALWAYS NR_T512 void NAME(const float *A, long lda, const float *B, long ldb, float *C, \
                                long ldc, long k, const int mr, int first) {                 \
        __m512 c[NR_MR][NW];                                                                  \
        for (int r = 0; r < mr; r++)                                                          \
            for (int j = 0; j < NW; j++)                                                      \
                c[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + r * ldc + 16 * j); \
        for (long p = 0; p < k; p++) {                                                        \
            __m512 b[NW];                                                                     \
            for (int j = 0; j < NW; j++) b[j] = _mm512_loadu_ps(B + p * ldb + 16 * j);        \
            for (int r = 0; r < mr; r++) {                                                    \
                __m512 a = _mm512_set1_ps(A[r * lda + p]);                                    \
                for (int j = 0; j < NW; j++) c[r][j] = _mm512_fmadd_ps(a, b[j], c[r][j]);     \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < mr; r++)                                                          \
            for (int j = 0; j < NW; j++) _mm512_storeu_ps(C + r * ldc + 16 * j, c[r][j]);     \
    }
NR_TILE512(nr_tile512_64, 4)
NR_TILE512(nr_tile512_16, 1)

/* NOTE: the switch makes mr a constant so the accumulators live in registers. */
#define NR_MR_SWITCH(fn, mr, ...)                         \
    switch (mr) {                                         \
        case 1: fn(__VA_ARGS__, 1, first); break;         \
        case 2: fn(__VA_ARGS__, 2, first); break;         \
        case 3: fn(__VA_ARGS__, 3, first); break;         \
        case 4: fn(__VA_ARGS__, 4, first); break;         \
        case 5: fn(__VA_ARGS__, 5, first); break;         \
        default: fn(__VA_ARGS__, 6, first); break;        \
    }

static void nr_mm_avx2(const float *A, long lda, const float *B, long ldb, float *C, long ldc,
                       long m, long n, long k, int first) {
    for (long r0 = 0; r0 < m; r0 += NR_MR) {
        int mr = m - r0 < NR_MR ? (int)(m - r0) : NR_MR;
        for (long j0 = 0; j0 < n; j0 += 16)
            NR_MR_SWITCH(nr_tile_avx2, mr, A + r0 * lda, lda, B + j0, ldb, C + r0 * ldc + j0, ldc, k)
    }
}

static NR_T512 void nr_mm_avx512(const float *A, long lda, const float *B, long ldb, float *C,
                                 long ldc, long m, long n, long k, int first) {
    for (long r0 = 0; r0 < m; r0 += NR_MR) {
        int mr = m - r0 < NR_MR ? (int)(m - r0) : NR_MR;
        long j0 = 0;
        for (; j0 + 64 <= n; j0 += 64)
            NR_MR_SWITCH(nr_tile512_64, mr, A + r0 * lda, lda, B + j0, ldb, C + r0 * ldc + j0, ldc, k)
        for (; j0 < n; j0 += 16)
            NR_MR_SWITCH(nr_tile512_16, mr, A + r0 * lda, lda, B + j0, ldb, C + r0 * ldc + j0, ldc, k)
    }
}

/* C[m][n] (+)= A[m][k] B[k][n] on the best level <= `level` (first: C = A B). */
static inline void nr_mm(int level, const float *A, long lda, const float *B, long ldb, float *C,
                         long ldc, long m, long n, long k, int first) {
    if (level >= 1)
        nr_mm_avx512(A, lda, B, ldb, C, ldc, m, n, k, first);
    else
        nr_mm_avx2(A, lda, B, ldb, C, ldc, m, n, k, first);
}

#endif
