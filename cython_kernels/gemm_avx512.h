/* AVX-512 block kernels for gemm_kernels.h: one packed 64-column weight block times m <= GEMM_MMAX
 * activation rows. Compiled with target attributes; gemm_cpu_level() picks them at run time. */
#ifndef NUMA_RUNTIME_GEMM_AVX512_H
#define NUMA_RUNTIME_GEMM_AVX512_H

#define GEMM_T_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define GEMM_T_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define GEMM_INLINE static inline __attribute__((always_inline))

/* Software prefetch distance of the GEMV tiles in bytes (0: off; gemm._set_prefetch). NOTE: 4096
 * bytes ahead, as the quantized kernels (qgemm_q8.h): bf16 batch-1 decode steps 0.95x on a 2-core
 * Zen 5 and 0.92x on a 16-core Sapphire Rapids (`bench/bench_engine.py --prefetch 0 4096`, rounds
 * alternating off and on, bench/RESULTS.md). An earlier Zen 4 build-time comparison (separate
 * processes) had found 1-4 KiB a 10-15% loss; Zen 4 was not measured again. */
#ifndef GEMM_PF_BYTES
#define GEMM_PF_BYTES 4096
#endif
static long gemm_pf_bytes = GEMM_PF_BYTES;

/* One 256-byte row (four cache lines) gemm_pf_bytes ahead of the stream; 0 = none. */
GEMM_INLINE void gemm_prefetch_row(const void* row) {
    if (gemm_pf_bytes)
        for (int i = 0; i < 4; i++)
            _mm_prefetch((const char*)row + gemm_pf_bytes + 64 * i, _MM_HINT_T0);
}

/* acc[r][0:64] (+)= sum_p x32[r][p] . wb[p] over k-pairs p0..p1, for r < mr (constant). */
GEMM_INLINE GEMM_T_BF16 void gemm_tile_bf16(const uint16_t* wb, const uint32_t* x32, long ldx,
                                            long p0, long p1, float* acc, const int mr,
                                            int first) {
    __m512 c[GEMM_MR][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++)
            c[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * GEMM_NB + 16 * j);
    for (long p = p0; p < p1; p++) {
        const uint16_t* row = wb + p * 2 * GEMM_NB;  /* 64 columns x 2 k = 256 bytes */
        gemm_prefetch_row(row);
        __m512i w[4];
        for (int j = 0; j < 4; j++) w[j] = _mm512_load_si512((const void*)(row + 32 * j));
        for (int r = 0; r < mr; r++) {
            __m512i xb = _mm512_set1_epi32((int)x32[r * ldx + p]);
            for (int j = 0; j < 4; j++)
                c[r][j] = _mm512_dpbf16_ps(c[r][j], (__m512bh)w[j], (__m512bh)xb);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(acc + r * GEMM_NB + 16 * j, c[r][j]);
}

GEMM_INLINE GEMM_T_AVX512 void gemm_tile_f32(const float* wb, const float* xs, long ldx, long k0,
                                             long k1, float* acc, const int mr, int first) {
    __m512 c[GEMM_MR][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++)
            c[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * GEMM_NB + 16 * j);
    for (long k = k0; k < k1; k++) {
        const float* row = wb + k * GEMM_NB;  /* 64 columns = 256 bytes */
        gemm_prefetch_row(row);
        __m512 w[4];
        for (int j = 0; j < 4; j++) w[j] = _mm512_load_ps(row + 16 * j);
        for (int r = 0; r < mr; r++) {
            __m512 xb = _mm512_set1_ps(xs[r * ldx + k]);
            for (int j = 0; j < 4; j++) c[r][j] = _mm512_fmadd_ps(w[j], xb, c[r][j]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(acc + r * GEMM_NB + 16 * j, c[r][j]);
}

/* NR_MR_SWITCH (tile_kernels.h) turns mr into a constant so c[][] lives in registers. */

/* acc[m][64] = rows xs[m][Kp] times k-pairs p0..p1 of one bf16 block wb [Kp/2][64][2]. With
 * more rows than one register tile, k is cut into GEMM_KC chunks so the weight chunk is reread
 * from L1 by every tile instead of from DRAM. acc: 64-byte aligned. */
static GEMM_T_BF16 void gemm_block_bf16_avx512(const void* wv, const void* xv, int m, long kp,
                                               long p0, long p1, float* acc) {
    const uint16_t* wb = (const uint16_t*)wv;
    const uint32_t* x32 = (const uint32_t*)xv;
    long np = kp / 2, kc = m <= GEMM_MR ? p1 - p0 : GEMM_KC;
    for (long c0 = p0; c0 < p1; c0 += kc) {
        long c1 = c0 + kc < p1 ? c0 + kc : p1;
        int first = c0 == p0;
        for (int r0 = 0; r0 < m; r0 += GEMM_MR) {
            int mr = m - r0 < GEMM_MR ? m - r0 : GEMM_MR;
            NR_MR_SWITCH(gemm_tile_bf16, mr, wb, x32 + r0 * np, np, c0, c1,
                             acc + r0 * GEMM_NB)
        }
    }
}

/* acc[m][64] = rows xs[m][Kp] times k = k0..k1 of one f32 block wb [Kp][64]. */
static GEMM_T_AVX512 void gemm_block_f32_avx512(const void* wv, const void* xv, int m, long kp,
                                                long k0, long k1, float* acc) {
    const float* wb = (const float*)wv;
    const float* xs = (const float*)xv;
    long kc = m <= GEMM_MR ? k1 - k0 : GEMM_KC;
    for (long c0 = k0; c0 < k1; c0 += kc) {
        long c1 = c0 + kc < k1 ? c0 + kc : k1;
        int first = c0 == k0;
        for (int r0 = 0; r0 < m; r0 += GEMM_MR) {
            int mr = m - r0 < GEMM_MR ? m - r0 : GEMM_MR;
            NR_MR_SWITCH(gemm_tile_f32, mr, wb, xs + r0 * kp, kp, c0, c1, acc + r0 * GEMM_NB)
        }
    }
}

#endif
