/* AVX2 + FMA + F16C quantized kernels (the build's floor; see qgemm_kernels.h for the layout).
 * A 16-column block is two ymm halves: lanes 0-7 and 8-15. */
#ifndef NUMA_RUNTIME_QGEMM_AVX2_H
#define NUMA_RUNTIME_QGEMM_AVX2_H

#define QG_MR_REG_AVX2 3  /* rows in registers while streaming: 2 x 3 accumulators + 10 */
#define QG_MR_TILE_AVX2 6 /* rows per FMA tile on the L1 path: 2 x 6 accumulators + 3 */
#define QG_INLINE static inline __attribute__((always_inline))

/* Scales s and offsets c of group g (meta: its meta; 16 columns as two halves). */
QG_INLINE void qg_sc_avx2(const uint8_t* blk, const qg_format* f, const uint8_t* meta, long g,
                          int bits, __m256 s[2], __m256 c[2]) {
    for (int h = 0; h < 2; h++) {
        s[h] = qg_s256(blk, f, meta, g, h);
        if (bits == 8 || f->kind == QG_NL) {
            c[h] = _mm256_setzero_ps();
        } else if (f->kind == QG_SYM) {
            c[h] = _mm256_mul_ps(s[h], _mm256_set1_ps(-(float)(1 << (bits - 1))));
        } else {
            c[h] = qg_c256(blk, f, meta, g, s[h], h);
        }
    }
}

/* The NL levels as f32, codes 0-7 and 8-15 (nl: the format's kind is QG_NL). */
typedef struct { __m256 lo, hi; int nl; } qg_lut256;
static inline qg_lut256 qg_lut_avx2(const qg_format* f) {
    const __m128i l = _mm_loadu_si128((const __m128i*)qg_nl_levels);
    qg_lut256 t = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l)),
                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(l, 8))), f->kind == QG_NL};
    return t;
}

/* Column half h of the i-th k of packed row v (8 lanes), as f32 integers (int4 "nl": the
 * code's level, bit 3 of the code choosing the table half). */
QG_INLINE __m256 qg_q_avx2(__m256i v, int bits, int i, qg_lut256 t) {
    if (bits == 4) {
        const __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, 4 * i), _mm256_set1_epi32(0xF));
        if (t.nl)
            return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, q), _mm256_permutevar8x32_ps(t.hi, q),
                                    _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
        return _mm256_cvtepi32_ps(q);
    }
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * i), 24));
}

/* tile[(k - k0) * 16 + j] = w[j, k], k0 <= k < k1. */
QG_INLINE void qg_dequant_avx2_b(const uint8_t* blk, const qg_format* f, long k0, long k1,
                                 float* tile, const int bits) {
    const long pk = bits == 4 ? 8 : 4, mb = qg_meta_bytes(f);
    const uint8_t* gbase = qg_groups(blk, f);  /* group g: gbase + g gb */
    const long gb = qg_group_bytes(f);
    __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, c[2] = {s[0], s[1]};
    const qg_lut256 lut = qg_lut_avx2(f);
    long g_last = -1;
    for (long k = k0; k < k1; k += pk) {
        long g = k / f->group;
        const uint8_t* meta = gbase + g * gb;
        if (g != g_last) {
            qg_sc_avx2(blk, f, meta, g, bits, s, c);
            g_last = g;
        }
        const uint8_t* row = meta + mb + (k - g * f->group) / pk * 64;
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(row + 32 * h));
            for (int i = 0; i < pk; i++)
                _mm256_store_ps(tile + (k - k0 + i) * QG_NB + 8 * h,
                                _mm256_fmadd_ps(qg_q_avx2(v, bits, i, lut), s[h], c[h]));
        }
    }
}

static void qg_dequant_hb(const uint8_t* blk, const qg_format* f, long k0, long k1, float* t);

static void qg_dequant_avx2(const uint8_t* blk, const qg_format* f, long k0, long k1, float* t) {
    if (qg_is_hb(f)) qg_dequant_hb(blk, f, k0, k1, t);
    else if (f->bits == 4) qg_dequant_avx2_b(blk, f, k0, k1, t, 4);
    else qg_dequant_avx2_b(blk, f, k0, k1, t, 8);
}

/* acc[r * 16 + j] = sum_k x[r, k] w[j, k] for r < mr, streaming the block once. */
QG_INLINE void qg_gemv_avx2_mr(const uint8_t* blk, const qg_format* f, const float* x, long ldx,
                               float* acc, const int bits, const int mr) {
    const long pk = bits == 4 ? 8 : 4, mb = qg_meta_bytes(f);
    const uint8_t* gbase = qg_groups(blk, f);  /* group g: gbase + g gb */
    const long gb = qg_group_bytes(f);
    const long ng = f->kp / f->group, rows = f->group / pk;
    const qg_lut256 lut = qg_lut_avx2(f);
    __m256 a[QG_MR_REG_AVX2][2];
    for (int r = 0; r < mr; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (long g = 0; g < ng; g++) {
        const uint8_t* meta = gbase + g * gb;
        __m256 s[2], c[2];
        qg_sc_avx2(blk, f, meta, g, bits, s, c);
        const uint8_t* row = meta + mb;
        const float* xg = x + g * f->group;
        for (long q = 0; q < rows; q++, row += 64, xg += pk) {
            __m256i v0 = _mm256_loadu_si256((const __m256i*)row);
            __m256i v1 = _mm256_loadu_si256((const __m256i*)(row + 32));
            for (int i = 0; i < pk; i++) {
                __m256 w0 = _mm256_fmadd_ps(qg_q_avx2(v0, bits, i, lut), s[0], c[0]);
                __m256 w1 = _mm256_fmadd_ps(qg_q_avx2(v1, bits, i, lut), s[1], c[1]);
                for (int r = 0; r < mr; r++) {
                    __m256 xb = _mm256_broadcast_ss(xg + r * ldx + i);
                    a[r][0] = _mm256_fmadd_ps(w0, xb, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(w1, xb, a[r][1]);
                }
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_store_ps(acc + r * QG_NB, a[r][0]);
        _mm256_store_ps(acc + r * QG_NB + 8, a[r][1]);
    }
}

static void qg_gemv_avx2(const uint8_t* blk, const qg_format* f, const float* x, long ldx, int m,
                         float* acc) {
    /* NOTE: one case per (bits, rows) so the accumulators stay in registers. */
    if (f->bits == 4) {
        if (m == 1) qg_gemv_avx2_mr(blk, f, x, ldx, acc, 4, 1);
        else if (m == 2) qg_gemv_avx2_mr(blk, f, x, ldx, acc, 4, 2);
        else qg_gemv_avx2_mr(blk, f, x, ldx, acc, 4, 3);
    } else {
        if (m == 1) qg_gemv_avx2_mr(blk, f, x, ldx, acc, 8, 1);
        else if (m == 2) qg_gemv_avx2_mr(blk, f, x, ldx, acc, 8, 2);
        else qg_gemv_avx2_mr(blk, f, x, ldx, acc, 8, 3);
    }
}

/* acc[r][16] (+)= x[r, :kc] . wt[:kc][16] for r < mr. */
QG_INLINE void qg_tile_avx2_mr(const float* wt, long kc, const float* x, long ldx, float* acc,
                               const int mr, int first) {
    __m256 a[QG_MR_TILE_AVX2][2];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++)
            a[r][h] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * QG_NB + 8 * h);
    for (long k = 0; k < kc; k++) {
        __m256 w0 = _mm256_load_ps(wt + k * QG_NB), w1 = _mm256_load_ps(wt + k * QG_NB + 8);
        for (int r = 0; r < mr; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(w0, xb, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w1, xb, a[r][1]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) _mm256_store_ps(acc + r * QG_NB + 8 * h, a[r][h]);
}

static void qg_tile_avx2(const float* wt, long kc, const float* x, long ldx, int m, float* acc,
                         int first) {
    for (int r0 = 0; r0 < m; r0 += QG_MR_TILE_AVX2) {
        int mr = m - r0 < QG_MR_TILE_AVX2 ? m - r0 : QG_MR_TILE_AVX2;
        const float* xr = x + r0 * ldx;
        float* ar = acc + r0 * QG_NB;
        switch (mr) {
            case 1: qg_tile_avx2_mr(wt, kc, xr, ldx, ar, 1, first); break;
            case 2: qg_tile_avx2_mr(wt, kc, xr, ldx, ar, 2, first); break;
            case 3: qg_tile_avx2_mr(wt, kc, xr, ldx, ar, 3, first); break;
            case 4: qg_tile_avx2_mr(wt, kc, xr, ldx, ar, 4, first); break;
            case 5: qg_tile_avx2_mr(wt, kc, xr, ldx, ar, 5, first); break;
            default: qg_tile_avx2_mr(wt, kc, xr, ldx, ar, 6, first); break;
        }
    }
}

#endif
