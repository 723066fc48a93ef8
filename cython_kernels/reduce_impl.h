/* Sum reductions (f32, bf16 accumulated in f32) and the shared-memory allreduce of
 * numa_runtime.distributed. Semantics: numa_runtime/backend/reference.py::reduce_sum, i.e.
 * dst[i] = ((0 + s0[i]) + s1[i]) + ... in source order, bf16 rounded once (RNE) at the end.
 * Every rank sums in the same order, so all ranks get bit-identical results.
 */
#ifndef NR_REDUCE_IMPL_H
#define NR_REDUCE_IMPL_H

#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <omp.h>

#include "ops_math.h"          /* nr_bf16_to_f32 / nr_f32_to_bf16 (bf16.h), NR_PAR_MIN */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NR_PAUSE() _mm_pause()
#else
#define NR_PAUSE() ((void)0)
#endif

#define NR_BLK 1024            /* elements per accumulation block (4 KiB of f32) */
#define NR_ALIGN_ELEMS 32      /* slice boundaries: 64 B of bf16, 128 B of f32 */

enum { NR_F32 = 0, NR_BF16 = 1 };

/* One block: acc is local, so dst may alias any source. */
static inline void nr_block_f32(float *dst, const float *const *srcs, int nsrc, int64_t off,
                                int64_t m) {
    float acc[NR_BLK];
    for (int64_t k = 0; k < m; k++) acc[k] = 0.0f;
    for (int s = 0; s < nsrc; s++) {
        const float *src = srcs[s] + off;
        for (int64_t k = 0; k < m; k++) acc[k] += src[k];
    }
    memcpy(dst + off, acc, (size_t)m * sizeof(float));
}

static inline void nr_block_bf16(uint16_t *dst, const uint16_t *const *srcs, int nsrc,
                                 int64_t off, int64_t m) {
    float acc[NR_BLK];
    for (int64_t k = 0; k < m; k++) acc[k] = 0.0f;
    for (int s = 0; s < nsrc; s++) {
        const uint16_t *src = srcs[s] + off;
        for (int64_t k = 0; k < m; k++) acc[k] += nr_bf16_to_f32(src[k]);
    }
    for (int64_t k = 0; k < m; k++) dst[off + k] = nr_f32_to_bf16(acc[k]);
}

/* dst[0:n] = sum of srcs[s][0:n]; dtype NR_F32 or NR_BF16. OpenMP over blocks when large. */
static void nr_reduce(void *dst, const void *const *srcs, int nsrc, int64_t n, int dtype) {
    int64_t nblk = (n + NR_BLK - 1) / NR_BLK;
    #pragma omp parallel for schedule(static) if (n >= 4 * NR_PAR_MIN)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t off = b * NR_BLK, m = n - off < NR_BLK ? n - off : NR_BLK;
        if (dtype == NR_F32)
            nr_block_f32((float *)dst, (const float *const *)srcs, nsrc, off, m);
        else
            nr_block_bf16((uint16_t *)dst, (const uint16_t *const *)srcs, nsrc, off, m);
    }
}

static void nr_copy(char *dst, const char *src, int64_t nbytes) {
    const int64_t chunk = 1 << 18;
    if (nbytes < 4 * chunk) { memcpy(dst, src, (size_t)nbytes); return; }
    int64_t nchunk = (nbytes + chunk - 1) / chunk;
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunk; c++) {
        int64_t off = c * chunk, m = nbytes - off < chunk ? nbytes - off : chunk;
        memcpy(dst + off, src + off, (size_t)m);
    }
}

static double nr_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Publish `phase` in this rank's flag, then wait until every rank's flag reaches it.
 * Flags only grow. Spins briefly, then yields the cpu (ranks may share cores).
 * Returns 0, or -1-j when rank j did not arrive within timeout_s. */
static int nr_flag_barrier(int64_t *const *flags, int nranks, int rank, int64_t phase,
                           double timeout_s) {
    __atomic_store_n(flags[rank], phase, __ATOMIC_RELEASE);
    double t0 = -1.0;
    for (int j = 0; j < nranks; j++) {
        uint64_t spins = 0;
        while (__atomic_load_n(flags[j], __ATOMIC_ACQUIRE) < phase) {
            if (++spins < 4096) { NR_PAUSE(); continue; }
            sched_yield();
            if ((spins & 1023) == 0) {
                double t = nr_now();
                if (t0 < 0) t0 = t;
                else if (t - t0 > timeout_s) return -1 - j;
            }
        }
    }
    return 0;
}

static inline int64_t nr_slice_len(int64_t n, int nranks) {
    int64_t per = (n + nranks - 1) / nranks;
    return (per + NR_ALIGN_ELEMS - 1) / NR_ALIGN_ELEMS * NR_ALIGN_ELEMS;
}

/* In-place allreduce of x[0:n] through one shared slot per rank (slots[j], each >= n
 * elements, owned by rank j and placed on its node).
 * small: each rank sums every slot into x (one barrier).
 * else: reduce-scatter (rank r sums slice r into its own slot) + all-gather (two barriers).
 * Uses phases phase0 (and phase0+1). Returns 0 or a negative nr_flag_barrier code. */
static int nr_shm_allreduce(void *x, int64_t n, int dtype, void *const *slots,
                            int64_t *const *flags, int nranks, int rank, int64_t phase0,
                            int small, double timeout_s) {
    int64_t esz = dtype == NR_F32 ? 4 : 2;
    int rc;
    nr_copy((char *)slots[rank], (const char *)x, n * esz);
    if ((rc = nr_flag_barrier(flags, nranks, rank, phase0, timeout_s)) != 0) return rc;
    if (small) {
        nr_reduce(x, (const void *const *)slots, nranks, n, dtype);
        return 0;
    }
    int64_t per = nr_slice_len(n, nranks);
    int64_t lo = per * rank, hi = lo + per < n ? lo + per : n;
    if (lo < hi) {
        const void *srcs[256];
        for (int j = 0; j < nranks; j++) srcs[j] = (const char *)slots[j] + lo * esz;
        nr_reduce((char *)slots[rank] + lo * esz, srcs, nranks, hi - lo, dtype);
    }
    if ((rc = nr_flag_barrier(flags, nranks, rank, phase0 + 1, timeout_s)) != 0) return rc;
    for (int j = 0; j < nranks; j++) {
        int64_t a = per * j, b = a + per < n ? a + per : n;
        if (a < b) nr_copy((char *)x + a * esz, (const char *)slots[j] + a * esz, (b - a) * esz);
    }
    return 0;
}

#endif
