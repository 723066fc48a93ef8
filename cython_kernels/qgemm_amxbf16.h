/* Many-row (prefill) quantized linear on AMX-BF16 tiles, the weights dequantized per task.
 *
 * out[M, N] = bf16(x) . bf16(W)^T + bias: the same numbers as the bf16 panel path (each weight
 * dequantized exactly in f32 and rounded once to bf16, nearest-even; x rounded to bf16; exact
 * products summed in f32), without a panel in memory or a oneDNN call per panel.
 *
 * Why: on 16 threads the panel path (dequantize a panel of ~8 MiB, barrier, oneDNN bf16 matmul
 * over it) ran Qwen2.5-0.5B's 896 x 9728 linear at 512 rows only 3.1x faster than on 2
 * threads; here each thread dequantizes its own 32 columns for the whole K into a buffer that
 * stays in its L2 and runs every row over it, so nothing is shared but the bf16 activations.
 *
 * Task: 32 output columns (two packed 16-column blocks) x a part of the rows (all M unless the
 * tasks are fewer than the threads). The task's weights become bf16 B tiles, per 32-k step s
 * and block j:
 *   bt[(2 s + j) * 512 + (k / 2) * 32 + c * 2 + k % 2] = bf16(w[16 j + c][32 s + k])
 * (tdpbf16ps's B layout: 16 rows of 16 column pairs), one block of K (QG_AB_KC) at a time. Per
 * 32 rows four C tiles (2 x 2: rows 0-15 / 16-31 by blocks 0 / 1) start from the bias (first
 * K block) or the partial sums in out, sum over the block's steps in f32 and go back to out.
 * A: x rounded to bf16 once per call into xb, zero past K and past M, in 16-row tiles
 * [r / 16][k / 32][r % 16][k % 32], so that a tile load reads 1 KiB in a row.
 */
#ifndef NUMA_RUNTIME_QGEMM_AMXBF16_H
#define NUMA_RUNTIME_QGEMM_AMXBF16_H

#include "ops_math.h"

#define QG_TAB16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#define QG_AB_NC 32     /* output columns per task */
#define QG_AB_MR 32     /* rows per C-tile pass */
#define QG_AB_B_BYTES (1L << 20)  /* dequantized weights a thread keeps at once (in its L2) */
#define QG_AB_A_BYTES (1L << 19)  /* activation rows a thread runs over them at once */
/* Steps ahead that a pass prefetches its A and B tiles into L1. NOTE: 512 rows of
 * Qwen2.5-0.5B's int4 linears (a one-off timing loop, alternating in one process): on a 2-core
 * Sapphire Rapids-class VM 4-7% less time than without, and 2-4% less than also prefetching
 * the next pass's block of out for writing; on SPR-16 at 16 threads all within 3% */
#define QG_AB_PFD 2
/* k per block of K: a task's B tiles for a block are 64 KiB. NOTE: the same loop with blocks
 * of 128-768 k was slower on both machines */
#define QG_AB_KC 1024

/* 1: AMX-BF16 and AVX512-BF16 present and the tile state granted (tests switch it off) */
static int qg_amxbf16 = 0;

static int qg_amxbf16_init(void) {
    unsigned a, b, c, d;
    if (!nr_amx_has(NR_AMX_BF16 | NR_AMX_TILE)) return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (a < 1) return 0;  /* no subleaf 1 */
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
    if (!((a >> 5) & 1)) return 0;  /* AVX512_BF16 */
    if (qg_cpu_level() < 1) return 0;
    return nr_amx_grant();
}

static inline long qg_ab_kb(const qg_format* f) { return (f->kp + 31) / 32 * 32; }
static inline long qg_ab_mp(long M) { return (M + QG_AB_MR - 1) / QG_AB_MR * QG_AB_MR; }

/* Per-thread bytes of dequantized B tiles: a group of whole 32-column tasks (at least one). */
static inline long qg_ab_kc(const qg_format* f) {
    const long kb = qg_ab_kb(f);
    return kb < QG_AB_KC ? kb : QG_AB_KC;
}
static inline long qg_ab_group(const qg_format* f) {
    const long per = qg_ab_kc(f) * 64, g = QG_AB_B_BYTES / per;
    return g < 1 ? 1 : g;
}

/* Scratch bytes for M rows on nt threads: xb, then one B group buffer per thread. */
static size_t qg_amxbf16_bytes(const qg_format* f, long M, int nt) {
    return (size_t)qg_ab_mp(M) * qg_ab_kb(f) * 2 + (size_t)nt * qg_ab_group(f) * qg_ab_kc(f) * 64 + 3 * 64;
}

/* Block blk (16 columns), k0 <= k < k1 (k0 a multiple of 32), into bt (one block's 512 bf16 a
 * 32-k step, stride 1024; bt's first step is k0's): zero past kp. Every width (qg_step512). */
QG_INLINE QG_TAB16 void qg_ab_dequant(const uint8_t* blk, const qg_format* f, long k0, long k1,
                                       uint16_t* bt, const int bits) {
    const long pk = bits == 8 ? 4 : 8, mb = qg_meta_bytes(f);
    const uint8_t* gbase = qg_groups(blk, f);  /* group g: gbase + g gb */
    const long gb = qg_group_bytes(f);
    uint16_t ix[32];
    for (int j = 0; j < 16; j++) {
        ix[2 * j] = (uint16_t)j;
        ix[2 * j + 1] = (uint16_t)(16 + j);
    }
    const __m512i idx = _mm512_loadu_si512((const void*)ix);
    __m512 s = _mm512_setzero_ps(), c = _mm512_setzero_ps();
    const __m512 lut = qg_lut512(f);
    long g_last = -1;
    const long kend = k1 < f->kp ? k1 : f->kp;
    for (long k = k0; k < kend; k += pk) {
        const long g = k / f->group;
        const uint8_t* meta = gbase + g * gb;
        if (g != g_last) {
            qg_sc_avx512(blk, f, meta, g, bits, &s, &c);
            g_last = g;
        }
        __m512i v, hi;
        qg_step512(meta + mb, f, k - g * f->group, bits, &v, &hi);
        uint16_t* dst = bt + ((k - k0) / 32) * 1024 + (k % 32) / 2 * 32;
        for (int i = 0; i < pk; i += 2) {
            const __m512 w0 = _mm512_fmadd_ps(qg_code512(v, hi, bits, i, lut), s, c);
            const __m512 w1 = _mm512_fmadd_ps(qg_code512(v, hi, bits, i + 1, lut), s, c);
            _mm512_store_si512((void*)(dst + i / 2 * 32),
                               _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
        }
    }
    for (long k = kend > k0 ? kend : k0; k < k1; k += 2)
        _mm512_store_si512((void*)(bt + ((k - k0) / 32) * 1024 + (k % 32) / 2 * 32), _mm512_setzero_si512());
}

/* C tile T (rows r0 + 16 h, columns nc of out) before a k block: the bias (first block) or
 * zeros, else the partial sums in out. Full tiles load from out (or, for the bias, one row with
 * stride 0); tiles past M or N go through c. */
#define QG_AB_CLOAD(T, h, j)                                                                      \
    {                                                                                             \
        const long r_ = r0 + 16 * (h), n_ = nc0 + 16 * (j);                                       \
        if (r_ + 16 <= M && n_ + 16 <= N) {                                                       \
            if (!first) _tile_loadd(T, out + r_ * ldo + n_, ldo * 4);                             \
            else if (bias) _tile_loadd(T, bias + n_, 0);                                          \
            else _tile_zero(T);                                                                   \
        } else {                                                                                  \
            float* c_ = c + (T) * 256;                                                            \
            const long w_ = n_ >= N ? 0 : (N - n_ < 16 ? N - n_ : 16);                            \
            const __mmask16 mk_ = (__mmask16)((1u << w_) - 1);                                   \
            for (int r = 0; r < 16; r++) {                                                        \
                __m512 v_ = _mm512_setzero_ps();                                                  \
                if (r_ + r < M && w_ > 0) {                                                       \
                    if (!first) v_ = _mm512_maskz_loadu_ps(mk_, out + (r_ + r) * ldo + n_);      \
                    else if (bias) v_ = _mm512_maskz_loadu_ps(mk_, bias + n_);                    \
                }                                                                                 \
                _mm512_store_ps(c_ + r * 16, v_);                                                 \
            }                                                                                     \
            QG_AMX_FENCE();                                                                       \
            _tile_loadd(T, c_, 64);                                                               \
        }                                                                                         \
    }

#define QG_AB_CSTORE(T, h, j)                                                                     \
    {                                                                                             \
        const long r_ = r0 + 16 * (h), n_ = nc0 + 16 * (j);                                       \
        if (r_ + 16 <= M && n_ + 16 <= N) {                                                       \
            _tile_stored(T, out + r_ * ldo + n_, ldo * 4);                                        \
        } else if (r_ < M && n_ < N) {                                                            \
            float* c_ = c + (T) * 256;                                                            \
            _tile_stored(T, c_, 64);                                                              \
            QG_AMX_FENCE();                                                                       \
            const long w_ = N - n_ < 16 ? N - n_ : 16;                                            \
            const __mmask16 mk_ = (__mmask16)((1u << w_) - 1);                                   \
            for (int r = 0; r < 16 && r_ + r < M; r++)                                            \
                _mm512_mask_storeu_ps(out + (r_ + r) * ldo + n_, mk_, _mm512_load_ps(c_ + r * 16)); \
        }                                                                                         \
    }

/* Rows r0..r0+31 of xb (from k block column kx; the rest of the 32 zeros) by column task cb
 * (bt: its B tiles for the block's steps) into out: 2 x 2 C tiles, rows 0-15 / 16-31 by
 * blocks 0 / 1, summed over the block's steps on top of the bias or the earlier blocks. */
QG_INLINE QG_TAB16 void qg_ab_pass(const uint16_t* xb, long kb, long kx, const uint16_t* bt,
                                   long steps, long r0, long M, long cb, long N, const float* bias,
                                   float* out, long ldo, int first, float* c) {
    const long nc0 = cb * QG_AB_NC;
    QG_AB_CLOAD(0, 0, 0)
    QG_AB_CLOAD(1, 0, 1)
    QG_AB_CLOAD(2, 1, 0)
    QG_AB_CLOAD(3, 1, 1)
    /* xb in 16-row tiles: [r / 16][k / 32][r % 16][k % 32] */
    const long ts = kb / 32 * 512;  /* one 16-row tile's stride */
    const uint16_t* xa = xb + (r0 / 16) * ts + kx / 32 * 512;
    for (long s = 0; s < steps; s++) {
        if (s + QG_AB_PFD < steps) {
            const char* pa = (const char*)(xa + (s + QG_AB_PFD) * 512);
            const char* pb = (const char*)(bt + (s + QG_AB_PFD) * 1024);
            for (int i = 0; i < 1024; i += 64) {
                _mm_prefetch(pa + i, _MM_HINT_T0);
                _mm_prefetch(pa + ts * 2 + i, _MM_HINT_T0);
                _mm_prefetch(pb + i, _MM_HINT_T0);
                _mm_prefetch(pb + 1024 + i, _MM_HINT_T0);
            }
        }
        _tile_loadd(4, xa + s * 512, 64);
        _tile_loadd(6, bt + s * 1024, 64);
        _tile_loadd(5, xa + ts + s * 512, 64);
        _tile_loadd(7, bt + s * 1024 + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    QG_AB_CSTORE(0, 0, 0)
    QG_AB_CSTORE(1, 0, 1)
    QG_AB_CSTORE(2, 1, 0)
    QG_AB_CSTORE(3, 1, 1)
    QG_AMX_FENCE();
}
#undef QG_AB_CLOAD
#undef QG_AB_CSTORE

/* x [M, K] f32 (rows ldx apart) -> out [M, N] (rows ldo apart); scratch: qg_amxbf16_bytes.
 * gated: x rows hold 2 K values, gate then up, and the input is silu(gate) * up (the MLP's
 * silu_and_mul, fused into the rounding of x to bf16).
 *
 * Work: 32-column tasks x row parts (as many parts as balance the tasks over the threads best),
 * row-part-major, a contiguous share per thread. K runs in blocks of QG_AB_KC, the
 * sums kept in out between blocks. For a group of its tasks (QG_AB_B_BYTES of B tiles a block)
 * a thread dequantizes one block's weights once, then runs chunks of rows (QG_AB_A_BYTES of
 * bf16 x), 32 rows at a time, over every task of the group: the weights and the chunk stay in
 * its L2, and each output row is written across the group's columns together (a 32-column
 * task over all rows would touch a page per row). */
static QG_TAB16 void qg_amxbf16_forward(const uint8_t* w, const qg_format* f, const float* x,
                                        long M, long K, long ldx, const float* bias, float* out,
                                        long ldo, char* scratch, int nthreads, int gated) {
    const long kb = qg_ab_kb(f), mp = qg_ab_mp(M), kc = qg_ab_kc(f);
    const long bb = qg_block_bytes(f), nblk = (f->n + QG_NB - 1) / QG_NB, N = f->n;
    const long ncb = (N + QG_AB_NC - 1) / QG_AB_NC, grp = qg_ab_group(f);
    long mc = QG_AB_A_BYTES / (kc * 2) / QG_AB_MR * QG_AB_MR;
    if (mc < QG_AB_MR) mc = QG_AB_MR;
    uint16_t* xb = (uint16_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    char* bts = (char*)(((uintptr_t)(xb + mp * kb) + 63) & ~(uintptr_t)63);
    /* row parts: the count (1..8, at least 64 rows a part) whose busiest thread has the
     * fewest task rows (ties: fewer parts, as each part dequantizes its columns again), e.g.
     * 28 column tasks on 16 threads: 4 parts of 128 rows, 7 tasks a thread */
    long nrp = 1, best = -1;
    for (long p = 1; p <= 8 && (p == 1 || mp / p >= 64); p++) {
        const long rp_ = (mp / p + QG_AB_MR - 1) / QG_AB_MR * QG_AB_MR;
        const long cost = (ncb * p + nthreads - 1) / nthreads * rp_;
        if (best < 0 || cost < best) {
            best = cost;
            nrp = p;
        }
    }
    const long rpart = (mp / nrp + QG_AB_MR - 1) / QG_AB_MR * QG_AB_MR, ntask = ncb * nrp;
    #pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num();
        #pragma omp for schedule(static)
        for (long r = 0; r < mp; r++) {
            uint16_t* d = xb + (r / 16) * (kb / 32 * 512) + (r % 16) * 32;
            const float* s = x + r * ldx;
            for (long k = 0; k < kb; k += 16) {
                __m512 v = _mm512_setzero_ps();
                if (r < M && k < K) {
                    const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
                    v = _mm512_maskz_loadu_ps(m, s + k);
                    if (gated) {  /* silu(gate) * up, as ops' silu_and_mul computes it */
                        float g[16] __attribute__((aligned(64))), u[16] __attribute__((aligned(64)));
                        _mm512_store_ps(g, v);
                        _mm512_store_ps(u, _mm512_maskz_loadu_ps(m, s + K + k));
                        #pragma omp simd
                        for (int i = 0; i < 16; i++) g[i] = g[i] / (1.0f + nr_expf(-g[i])) * u[i];
                        v = _mm512_load_ps(g);
                    }
                }
                _mm256_storeu_si256((__m256i*)(d + k / 32 * 512 + k % 32), (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
        uint16_t* bt = (uint16_t*)(bts + (size_t)tid * grp * kc * 64);
        const long tstride = kc / 32 * 1024;  /* a task's B tiles in bt */
        float c[4 * 256] __attribute__((aligned(64)));
        long t0, t1;
        nr_share(ntask, tid, omp_get_num_threads(), &t0, &t1);
        const int held = t0 < t1;
        if (held) nr_tile_config_16x64();
        while (t0 < t1) {
            /* a run of tasks in one row part, at most a group of them */
            const long rp = t0 / ncb, ca = t0 % ncb;
            long cz = ncb < ca + (t1 - t0) ? ncb : ca + (t1 - t0);
            if (cz - ca > grp) cz = ca + grp;
            const long ra = rp * rpart, rz = ra + rpart < M ? ra + rpart : M;
            for (long k0 = 0; k0 < kb; k0 += kc) {
                const long k1 = k0 + kc < kb ? k0 + kc : kb, steps = (k1 - k0) / 32;
                for (long cb = ca; cb < cz; cb++)
                    for (int j = 0; j < 2; j++) {
                        const long b = 2 * cb + j;
                        uint16_t* d = bt + (cb - ca) * tstride + j * 512;
                        if (b >= nblk)
                            for (long s = 0; s < steps; s++) memset(d + s * 1024, 0, 1024);
                        else if (f->bits == 2)
                            qg_ab_dequant(w + b * bb, f, k0, k1, d, 2);
                        else if (f->bits == 3)
                            qg_ab_dequant(w + b * bb, f, k0, k1, d, 3);
                        else if (f->bits == 4)
                            qg_ab_dequant(w + b * bb, f, k0, k1, d, 4);
                        else if (f->bits == 5)
                            qg_ab_dequant(w + b * bb, f, k0, k1, d, 5);
                        else if (f->bits == 6)
                            qg_ab_dequant(w + b * bb, f, k0, k1, d, 6);
                        else
                            qg_ab_dequant(w + b * bb, f, k0, k1, d, 8);
                    }
                QG_AMX_FENCE();
                for (long m0 = ra; m0 < rz; m0 += mc) {
                    const long m1 = m0 + mc < rz ? m0 + mc : rz;
                    /* NOTE: 32 rows by every task of the group, then the next 32 rows: the rows'
                     * A tiles stay hot while the group's B tiles stream from L2, and out is
                     * written 32 rows at a time across the group's columns. 512 rows of
                     * Qwen2.5-0.5B's int4 linears on XEON-AMX-2 (2 threads, a one-off timing
                     * loop, alternating): 2-7% less time than each task over the chunk's rows */
                    for (long r0 = m0; r0 < m1; r0 += QG_AB_MR)
                        for (long cb = ca; cb < cz; cb++)
                            qg_ab_pass(xb, kb, k0, bt + (cb - ca) * tstride, steps, r0, m1, cb, N,
                                       bias, out, ldo, k0 == 0, c);
                }
            }
            t0 += cz - ca;
        }
        if (held) _tile_release();
    }
}

#endif
