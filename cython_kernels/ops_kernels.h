/* Row kernels behind ops.pyx. Rows are contiguous in their last dimension; the row stride
 * (in elements) is passed separately, so strided views of fused buffers work. */
#ifndef NR_OPS_KERNELS_H
#define NR_OPS_KERNELS_H

#include <omp.h>
#include "ops_math.h"


static void nr_f32_to_bf16_n(const float *x, uint16_t *y, int64_t n) {
    #pragma omp parallel for simd schedule(static) if (n > 4 * NR_PAR_MIN)
    for (int64_t i = 0; i < n; i++) y[i] = nr_f32_to_bf16(x[i]);
}

static void nr_bf16_to_f32_n(const uint16_t *x, float *y, int64_t n) {
    #pragma omp parallel for simd schedule(static) if (n > 4 * NR_PAR_MIN)
    for (int64_t i = 0; i < n; i++) y[i] = nr_bf16_to_f32(x[i]);
}

/* for (int64_t i = 0; i < n; i++) body; on the OpenMP threads when `par`, else inline.
 * NOTE: not `#pragma omp parallel for if (par)`: for a false clause libgomp still builds a team
 * of one (about a microsecond), and decode calls these ops on a row or two several times per
 * layer. The body is a call of a row function (which holds the simd pragmas). */
#define NR_ROWS_FOR(par, i, n, body) do {                        \
        if (par) {                                               \
            _Pragma("omp parallel for schedule(static)")         \
            for (int64_t i = 0; i < (n); i++) body;              \
        } else {                                                 \
            for (int64_t i = 0; i < (n); i++) body;              \
        }                                                        \
    } while (0)

/* One row of the embedding: o = table row `id` (row stride ts) as f32. */
static inline void nr_embed_row(const void *table, int is_bf16, int64_t id, int64_t ts, int64_t H,
                                float *o) {
    if (is_bf16) {
        const uint16_t *r = (const uint16_t *)table + id * ts;
        #pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = nr_bf16_to_f32(r[i]);
    } else {
        memcpy(o, (const float *)table + id * ts, (size_t)H * sizeof(float));
    }
}

/* out[t] = table[ids[t]]; table row stride ts, out row stride os (elements). */
static void nr_embedding(const int64_t *ids, int64_t T, const void *table, int is_bf16,
                         int64_t ts, int64_t H, float *out, int64_t os) {
    NR_ROWS_FOR(T * H > NR_PAR_MIN, t, T, nr_embed_row(table, is_bf16, ids[t], ts, H, out + t * os));
}

/* One row of rms_norm: the mean of squares accumulates in f64 like the reference. */
static inline void nr_rms_row(const float *x, const float *w, double eps, int64_t H, float *o) {
    double ss = 0.0;
    #pragma omp simd reduction(+:ss)
    for (int64_t i = 0; i < H; i++) ss += (double)x[i] * (double)x[i];
    double inv = 1.0 / sqrt(ss / (double)H + eps);
    #pragma omp simd
    for (int64_t i = 0; i < H; i++) o[i] = (float)((double)x[i] * inv) * w[i];
}

static void nr_rms_norm(const float *x, int64_t xs, const float *w, double eps, int64_t R,
                        int64_t H, float *out, int64_t os) {
    NR_ROWS_FOR(R * H > NR_PAR_MIN, r, R, nr_rms_row(x + r * xs, w, eps, H, out + r * os));
}

/* One row of add_rms_norm: res += x; o = rms_norm(res). o may alias x. */
static inline void nr_add_rms_row(const float *x, float *res, const float *w, double eps, int64_t H,
                                  float *o) {
    #pragma omp simd
    for (int64_t i = 0; i < H; i++) res[i] += x[i];
    nr_rms_row(res, w, eps, H, o);
}

/* res += x; out = rms_norm(res). out may alias x. */
static void nr_add_rms_norm(const float *x, int64_t xs, float *res, int64_t rs, const float *w,
                            double eps, int64_t R, int64_t H, float *out, int64_t os) {
    NR_ROWS_FOR(R * H > NR_PAR_MIN, r, R,
                nr_add_rms_row(x + r * xs, res + r * rs, w, eps, H, out + r * os));
}

/* One row of silu_and_mul: o = silu(g) * u over n elements. */
static inline void nr_silu_row(const float *g, const float *u, int64_t n, float *o) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + nr_expf(-g[i])) * u[i];
}

static void nr_silu_and_mul(const float *x, int64_t xs, int64_t T, int64_t n_inter, float *out,
                            int64_t os) {
    NR_ROWS_FOR(T * n_inter > NR_PAR_MIN, t, T,
                nr_silu_row(x + t * xs, x + t * xs + n_inter, n_inter, out + t * os));
}

/* One row of add: a += b over H elements. */
static inline void nr_add_row(float *a, const float *b, int64_t H) {
    #pragma omp simd
    for (int64_t i = 0; i < H; i++) a[i] += b[i];
}

static void nr_add(float *a, int64_t as_, const float *b, int64_t bs, int64_t R, int64_t H) {
    NR_ROWS_FOR(R * H > 4 * NR_PAR_MIN, r, R, nr_add_row(a + r * as_, b + r * bs, H));
}

/* Neox rotary of one token's H heads (head stride sh) with the cos | sin row c of its position. */
static inline void nr_rotary_token(float *x, int64_t H, int64_t sh, const float *c, int64_t rot) {
    int64_t half = rot / 2;
    const float *s = c + half;
    for (int64_t h = 0; h < H; h++) {
        float *x1 = x + h * sh, *x2 = x1 + half;
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

/* Neox rotary on x: [T, H, D] with token stride st and head stride sh (elements). */
static void nr_rotary(float *x, int64_t T, int64_t H, int64_t st, int64_t sh,
                      const int64_t *pos, const float *cs, int64_t rot) {
    NR_ROWS_FOR(T * H * rot > NR_PAR_MIN, t, T, nr_rotary_token(x + t * st, H, sh, cs + pos[t] * rot, rot));
}

/* The DRAM read probe of bench/limits.py: the sum of n words, read on the OpenMP threads (a
 * static share each, vector loads); the sum only keeps the reads from being optimized away. */
static uint64_t nr_read_words(const uint64_t *p, int64_t n) {
    uint64_t total = 0;
    #pragma omp parallel for simd schedule(static) reduction(+:total)
    for (int64_t i = 0; i < n; i++) total += p[i];
    return total;
}

#endif
