/* Small-M linear kernels over oneDNN's packed weight layouts (see gemm.pyx).
 *
 * Weights are the [K, N] matrix B = W^T, packed ONCE by a oneDNN reorder into the layout its
 * brgemm matmul picks with format_tag_any on AVX-512 (the only copy we keep):
 *   bf16: dnnl_BA16a64b2a = [Nb][Kp/2][64][2]  (Kp = K rounded up to 32, Nb = ceil(N/64))
 *   f32 : dnnl_BA16a64b   = [Nb][Kp][64]       (Kp = K rounded up to 16)
 * Padding is zero. One 64-column block is one contiguous stream; each k-pair (bf16) or k (f32)
 * row of a block is 256 bytes = four cache lines = four zmm registers of 16 output columns.
 *
 * The small-M kernel streams every weight block once for all M activation rows (in groups of
 * GEMM_MMAX rows), threads split the blocks, and the activations sit in L1.
 */
#ifndef NUMA_RUNTIME_GEMM_KERNELS_H
#define NUMA_RUNTIME_GEMM_KERNELS_H

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define GEMM_NB 64    /* output columns per weight block */
#define GEMM_MR 6     /* activation rows per register tile: 6 x 4 accumulators + 4 weights */
#define GEMM_MMAX 32  /* activation rows per pass over the weights */
#define GEMM_KC 64    /* k-pairs (bf16) / k (f32) per L1 chunk when M > GEMM_MR: 16 KiB */

/* 2: avx512f+bw+vl+bf16 (Zen4, Sapphire Rapids), 1: avx512f+bw+vl, 0: x86-64-v3 only. */
static int gemm_cpu_level(void) {
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl");
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return 2;
    return avx512 ? 1 : 0;
}

static void* gemm_alloc(size_t nbytes) {
    /* NOTE: 2 MiB alignment + transparent huge pages: the GEMV streams the whole buffer, and
     * 4 KiB pages would cost a TLB miss every 4 KiB. */
    size_t align = nbytes >= (1u << 21) ? (1u << 21) : 64;
    size_t size = (nbytes + align - 1) / align * align;
    void* p = aligned_alloc(align, size ? size : align);
    if (p == NULL) return NULL;
#ifdef MADV_HUGEPAGE
    if (align == (1u << 21)) madvise(p, size, MADV_HUGEPAGE);
#endif
    memset(p, 0, size);
    return p;
}

static inline uint16_t gemm_f32_to_bf16_1(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float gemm_bf16_to_f32_1(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* y[r, :ldy] = bf16(x[r, :k]) then zeros; rows r < m. Round-to-nearest-even, as reference. */
static void gemm_rows_to_bf16(const float* x, long m, long k, uint16_t* y, long ldy) {
    #pragma omp parallel for schedule(static) if (m * k >= (1 << 16))
    for (long r = 0; r < m; r++) {
        for (long i = 0; i < k; i++) y[r * ldy + i] = gemm_f32_to_bf16_1(x[r * k + i]);
        for (long i = k; i < ldy; i++) y[r * ldy + i] = 0;
    }
}

/* Block-range split: thread t of nt gets blocks [*b0, *b1). */
static inline void gemm_split(long nblocks, int t, int nt, long* b0, long* b1) {
    *b0 = nblocks * t / nt;
    *b1 = nblocks * (t + 1) / nt;
}

/* Blocks per dynamic work item: about 8 items per thread.
 * NOTE: dynamic, not a static split: a thread that is preempted (shared machines, other ranks)
 * or slower costs only its current chunk, not the whole call, and each block is already a
 * 60+ KiB contiguous stream, so the prefetchers lose nothing. */
static inline int gemm_chunk(long nblocks) {
    long c = nblocks / (8L * omp_get_num_threads());
    return c < 1 ? 1 : (int)c;
}

/* acc: [m][64] partial sums of one block -> out[m, n0:n0+64] (+bias), clipped at N. */
static inline void gemm_store_block(const float* acc, int m, long n0, long N, const float* bias,
                                    float* out) {
    long w = N - n0 < GEMM_NB ? N - n0 : GEMM_NB;
    for (int r = 0; r < m; r++)
        for (long j = 0; j < w; j++)
            out[r * N + n0 + j] = acc[r * GEMM_NB + j] + (bias ? bias[n0 + j] : 0.0f);
}

#include "gemm_avx512.h"

/* Sum of n floats, OpenMP, plain AVX2 adds with 8 independent accumulators: a pure DRAM read
 * probe for bench/limits.py, independent of the GEMV kernels it judges. */
static double gemm_read_probe(const float* a, long n) {
    double total = 0.0;
    #pragma omp parallel reduction(+ : total)
    {
        long i0, i1;
        gemm_split(n / 64, omp_get_thread_num(), omp_get_num_threads(), &i0, &i1);
        __m256 s[8];
        for (int j = 0; j < 8; j++) s[j] = _mm256_setzero_ps();
        for (long i = i0 * 64; i < i1 * 64; i += 64)
            for (int j = 0; j < 8; j++) s[j] = _mm256_add_ps(s[j], _mm256_loadu_ps(a + i + 8 * j));
        float v[8];
        for (int j = 1; j < 8; j++) s[0] = _mm256_add_ps(s[0], s[j]);
        _mm256_storeu_ps(v, s[0]);
        for (int j = 0; j < 8; j++) total += v[j];
    }
    for (long i = n / 64 * 64; i < n; i++) total += a[i];
    return total;
}

/* ---------------------------------------------------------------- portable fallback (AVX2) */
/* wb: one bf16 block [Kp/2][64][2]; xs: bf16 rows [m][Kp]; acc: [m][64]. */
static void gemm_block_bf16_generic(const uint16_t* wb, const uint16_t* xs, int m, long kp,
                                    float* acc) {
    memset(acc, 0, sizeof(float) * m * GEMM_NB);
    for (long p = 0; p < kp / 2; p++) {
        const uint16_t* row = wb + p * 2 * GEMM_NB;
        for (int r = 0; r < m; r++) {
            float x0 = gemm_bf16_to_f32_1(xs[r * kp + 2 * p]);
            float x1 = gemm_bf16_to_f32_1(xs[r * kp + 2 * p + 1]);
            for (int j = 0; j < GEMM_NB; j++)
                acc[r * GEMM_NB + j] += gemm_bf16_to_f32_1(row[2 * j]) * x0 +
                                        gemm_bf16_to_f32_1(row[2 * j + 1]) * x1;
        }
    }
}

/* wb: one f32 block [Kp][64]; xs: f32 rows [m][Kp]; acc: [m][64]. */
static void gemm_block_f32_generic(const float* wb, const float* xs, int m, long kp, float* acc) {
    memset(acc, 0, sizeof(float) * m * GEMM_NB);
    for (long k = 0; k < kp; k++)
        for (int r = 0; r < m; r++) {
            float xv = xs[r * kp + k];
            for (int j = 0; j < GEMM_NB; j++) acc[r * GEMM_NB + j] += wb[k * GEMM_NB + j] * xv;
        }
}

/* ---------------------------------------------------------------- entry points */
/* out[M, N] = x[M, K] @ B + bias, B packed bf16 [Nb][Kp/2][64][2]. xs: scratch [GEMM_MMAX][Kp]
 * bf16. x rows are rounded to bf16 first (as oneDNN's bf16 x bf16 path does). */
static void gemm_small_bf16(const uint16_t* w, long K, long N, long kp, const float* x, long M,
                            const float* bias, float* out, uint16_t* xs, int level) {
    long nblocks = (N + GEMM_NB - 1) / GEMM_NB;
    for (long m0 = 0; m0 < M; m0 += GEMM_MMAX) {
        int m = (int)(M - m0 < GEMM_MMAX ? M - m0 : GEMM_MMAX);
        gemm_rows_to_bf16(x + m0 * K, m, K, xs, kp);
        float* o = out + m0 * N;
        #pragma omp parallel
        {
            float acc[GEMM_MMAX * GEMM_NB] __attribute__((aligned(64)));
            #pragma omp for schedule(dynamic, gemm_chunk(nblocks)) nowait
            for (long b = 0; b < nblocks; b++) {
                const uint16_t* wb = w + b * kp * GEMM_NB;
                if (level >= 2)
                    gemm_block_bf16_avx512(wb, xs, m, kp, acc);
                else
                    gemm_block_bf16_generic(wb, xs, m, kp, acc);
                gemm_store_block(acc, m, b * GEMM_NB, N, bias, o);
            }
        }
    }
}

/* out[M, N] = x[M, K] @ B + bias, B packed f32 [Nb][Kp][64]. xs: scratch [GEMM_MMAX][Kp] f32. */
static void gemm_small_f32(const float* w, long K, long N, long kp, const float* x, long M,
                           const float* bias, float* out, float* xs, int level) {
    long nblocks = (N + GEMM_NB - 1) / GEMM_NB;
    for (long m0 = 0; m0 < M; m0 += GEMM_MMAX) {
        int m = (int)(M - m0 < GEMM_MMAX ? M - m0 : GEMM_MMAX);
        for (int r = 0; r < m; r++) {
            memcpy(xs + r * kp, x + (m0 + r) * K, sizeof(float) * K);
            memset(xs + r * kp + K, 0, sizeof(float) * (kp - K));
        }
        float* o = out + m0 * N;
        #pragma omp parallel
        {
            float acc[GEMM_MMAX * GEMM_NB] __attribute__((aligned(64)));
            #pragma omp for schedule(dynamic, gemm_chunk(nblocks)) nowait
            for (long b = 0; b < nblocks; b++) {
                const float* wb = w + b * kp * GEMM_NB;
                if (level >= 1)
                    gemm_block_f32_avx512(wb, xs, m, kp, acc);
                else
                    gemm_block_f32_generic(wb, xs, m, kp, acc);
                gemm_store_block(acc, m, b * GEMM_NB, N, bias, o);
            }
        }
    }
}

#endif
