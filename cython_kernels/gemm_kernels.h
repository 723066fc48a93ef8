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

#include "bf16.h"
#include "split.h"
#include "tile_kernels.h"

#define GEMM_NB 64    /* output columns per weight block */
#define GEMM_MR 6     /* activation rows per register tile: 6 x 4 accumulators + 4 weights */
#define GEMM_MMAX 32  /* activation rows per pass over the weights */
#define GEMM_KC 64    /* k-pairs (bf16) / k (f32) per L1 chunk when M > GEMM_MR: 16 KiB */

/* 2: avx512f+bw+vl+bf16 (Zen4, Sapphire Rapids), 1: avx512f+bw+vl (Skylake to Ice Lake),
 * 0: AVX2+FMA+F16C only (x86-64-v3: Haswell, Zen 1-3): the build's floor. */
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

/* y[:ldy] = bf16(x[:k]) then zeros. Round-to-nearest-even, as reference. */
static inline void gemm_row_to_bf16(const float* x, long k, uint16_t* y, long ldy) {
    for (long i = 0; i < k; i++) y[i] = nr_f32_to_bf16(x[i]);
    for (long i = k; i < ldy; i++) y[i] = 0;
}

/* y[r, :ldy] = bf16(x[r, :k]) then zeros; rows r < m.
 * NOTE: small inputs (decode's rows) do not enter OpenMP at all: a parallel region with a false
 * if clause still builds a team of one in libgomp (about a microsecond, once per GEMV). */
static void gemm_rows_to_bf16(const float* x, long m, long k, uint16_t* y, long ldy) {
    if (m * k >= (1 << 16)) {
        #pragma omp parallel for schedule(static)
        for (long r = 0; r < m; r++) gemm_row_to_bf16(x + r * k, k, y + r * ldy, ldy);
    } else {
        for (long r = 0; r < m; r++) gemm_row_to_bf16(x + r * k, k, y + r * ldy, ldy);
    }
}

/* dst[r * ldd + j] = src[r * n + j] for r < m, j < n (a dense block into wider rows). */
static void gemm_copy_rows(const float* src, long m, long n, float* dst, long ldd) {
    if (m * n >= (1 << 15)) {
        #pragma omp parallel for schedule(static)
        for (long r = 0; r < m; r++) memcpy(dst + r * ldd, src + r * n, sizeof(float) * n);
    } else {
        for (long r = 0; r < m; r++) memcpy(dst + r * ldd, src + r * n, sizeof(float) * n);
    }
}

/* y[r, :ldy] = f32(bf16(x[r, :k])) then zeros: the bf16-rounded activations the widening
 * kernels (levels 0 and 1) multiply, so they compute the products the bf16 dot product does. */
static void gemm_rows_to_bf16f(const float* x, long m, long k, float* y, long ldy) {
    for (long r = 0; r < m; r++) {
        for (long i = 0; i < k; i++) y[r * ldy + i] = nr_bf16_to_f32(nr_f32_to_bf16(x[r * k + i]));
        for (long i = k; i < ldy; i++) y[r * ldy + i] = 0.0f;
    }
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
#include "gemm_widen.h"

/* ---------------------------------------------------------------- driver */
typedef void (*gemm_block_fn)(const void* wb, const void* xs, int m, long kp, long s0, long s1,
                              float* acc);

/* out[m, N] = xs @ B + bias for m <= GEMM_MMAX rows. B: nblocks blocks of block_bytes, each
 * `steps` k-steps (k-pairs for bf16, k for f32) deep.
 * NOTE: blocks that do not share out evenly over the threads (N = 896 on 16 cores is 14
 * blocks) are also cut along k into slices of >= 64 steps (each still one contiguous stream),
 * partial sums go to `part` and a second pass adds them (split.h says when; a static schedule:
 * a dynamic one's shared counter costs more than a small GEMV). */
static int gemm_small_run(const char* w, size_t block_bytes, long steps, long kp, long N,
                          const void* xs, int m, const float* bias, float* out,
                          gemm_block_fn fn, int whole_k) {
    long nblocks = (N + GEMM_NB - 1) / GEMM_NB, np_ = nblocks * GEMM_NB;
    const long nt = omp_get_max_threads();
    /* NOTE: whole_k: every output's k in one pass, so its value does not depend on the thread
     * count (a replicated MoE router: every rank must pick the same experts) */
    const long ks = whole_k ? 1 : nr_split_count(nblocks, nt, steps / 64 < 16 ? steps / 64 : 16, 0.08);
    float* part = NULL;
    if (ks > 1) {
        part = (float*)aligned_alloc(64, sizeof(float) * ks * m * np_);
        if (part == NULL) return -1;
    }
    long units = nblocks * ks;
    #pragma omp parallel
    {
        float acc[GEMM_MMAX * GEMM_NB] __attribute__((aligned(64)));
        /* NOTE: each thread's contiguous share by hand rather than `omp for`: no barrier after
         * the loop unless partial sums follow (the region's end is one already) */
        long u0, u1;
        nr_share(units, omp_get_thread_num(), omp_get_num_threads(), &u0, &u1);
        for (long u = u0; u < u1; u++) {
            long b = u / ks, s = u % ks;
            fn(w + b * block_bytes, xs, m, kp, steps * s / ks, steps * (s + 1) / ks, acc);
            if (ks == 1) {
                gemm_store_block(acc, m, b * GEMM_NB, N, bias, out);
            } else {
                for (int r = 0; r < m; r++)
                    memcpy(part + (s * m + r) * np_ + b * GEMM_NB, acc + r * GEMM_NB,
                           sizeof(float) * GEMM_NB);
            }
        }
        if (ks > 1) {
            #pragma omp barrier
            #pragma omp for schedule(static) nowait
            for (long b = 0; b < nblocks; b++) {
                for (int r = 0; r < m; r++)
                    for (int j = 0; j < GEMM_NB; j++) {
                        float v = 0.0f;
                        for (long s = 0; s < ks; s++) v += part[(s * m + r) * np_ + b * GEMM_NB + j];
                        acc[r * GEMM_NB + j] = v;
                    }
                gemm_store_block(acc, m, b * GEMM_NB, N, bias, out);
            }
        }
    }
    free(part);
    return 0;
}

/* out[M, N] = x[M, K] @ B + bias, B packed bf16 [Nb][Kp/2][64][2]. xs: scratch [GEMM_MMAX][Kp]
 * f32 (level 2 uses its first half as bf16). x rows are rounded to bf16 first (as oneDNN's
 * bf16 x bf16 path does). 0 or -1 (OOM). */
static int gemm_small_bf16(const uint16_t* w, long K, long N, long kp, const float* x, long M,
                           const float* bias, float* out, void* xs, int level, int whole_k) {
    gemm_block_fn fn = level >= 2 ? gemm_block_bf16_avx512
                     : level == 1 ? gemm_block_bf16_avx512f : gemm_block_bf16_avx2;
    for (long m0 = 0; m0 < M; m0 += GEMM_MMAX) {
        int m = (int)(M - m0 < GEMM_MMAX ? M - m0 : GEMM_MMAX);
        if (level >= 2)
            gemm_rows_to_bf16(x + m0 * K, m, K, (uint16_t*)xs, kp);
        else
            gemm_rows_to_bf16f(x + m0 * K, m, K, (float*)xs, kp);
        if (gemm_small_run((const char*)w, sizeof(uint16_t) * kp * GEMM_NB, kp / 2, kp, N, xs, m,
                           bias, out + m0 * N, fn, whole_k))
            return -1;
    }
    return 0;
}

/* out[M, N] = x[M, K] @ B + bias, B packed f32 [Nb][Kp][64]. xs: scratch [GEMM_MMAX][Kp] f32. */
static int gemm_small_f32(const float* w, long K, long N, long kp, const float* x, long M,
                          const float* bias, float* out, float* xs, int level, int whole_k) {
    gemm_block_fn fn = level >= 1 ? gemm_block_f32_avx512 : gemm_block_f32_avx2;
    for (long m0 = 0; m0 < M; m0 += GEMM_MMAX) {
        int m = (int)(M - m0 < GEMM_MMAX ? M - m0 : GEMM_MMAX);
        for (int r = 0; r < m; r++) {
            memcpy(xs + r * kp, x + (m0 + r) * K, sizeof(float) * K);
            memset(xs + r * kp + K, 0, sizeof(float) * (kp - K));
        }
        if (gemm_small_run((const char*)w, sizeof(float) * kp * GEMM_NB, kp, kp, N, xs, m, bias,
                           out + m0 * N, fn, whole_k))
            return -1;
    }
    return 0;
}

#endif
