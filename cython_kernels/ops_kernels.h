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

/* out[t] = table[ids[t]]; table row stride ts, out row stride os (elements). */
static void nr_embedding(const int64_t *ids, int64_t T, const void *table, int is_bf16,
                         int64_t ts, int64_t H, float *out, int64_t os) {
    #pragma omp parallel for schedule(static) if (T * H > NR_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * os;
        if (is_bf16) {
            const uint16_t *r = (const uint16_t *)table + ids[t] * ts;
            #pragma omp simd
            for (int64_t i = 0; i < H; i++) o[i] = nr_bf16_to_f32(r[i]);
        } else {
            memcpy(o, (const float *)table + ids[t] * ts, (size_t)H * sizeof(float));
        }
    }
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
    #pragma omp parallel for schedule(static) if (R * H > NR_PAR_MIN)
    for (int64_t r = 0; r < R; r++) nr_rms_row(x + r * xs, w, eps, H, out + r * os);
}

/* res += x; out = rms_norm(res). out may alias x. */
static void nr_add_rms_norm(const float *x, int64_t xs, float *res, int64_t rs, const float *w,
                            double eps, int64_t R, int64_t H, float *out, int64_t os) {
    #pragma omp parallel for schedule(static) if (R * H > NR_PAR_MIN)
    for (int64_t r = 0; r < R; r++) {
        float *rr = res + r * rs;
        const float *xr = x + r * xs;
        #pragma omp simd
        for (int64_t i = 0; i < H; i++) rr[i] += xr[i];
        nr_rms_row(rr, w, eps, H, out + r * os);
    }
}

static void nr_silu_and_mul(const float *x, int64_t xs, int64_t T, int64_t n_inter, float *out,
                            int64_t os) {
    #pragma omp parallel for schedule(static) if (T * n_inter > NR_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * xs, *u = g + n_inter;
        float *o = out + t * os;
        #pragma omp simd
        for (int64_t i = 0; i < n_inter; i++) o[i] = g[i] / (1.0f + nr_expf(-g[i])) * u[i];
    }
}

static void nr_add(float *a, int64_t as_, const float *b, int64_t bs, int64_t R, int64_t H) {
    #pragma omp parallel for schedule(static) if (R * H > 4 * NR_PAR_MIN)
    for (int64_t r = 0; r < R; r++) {
        float *ar = a + r * as_;
        const float *br = b + r * bs;
        #pragma omp simd
        for (int64_t i = 0; i < H; i++) ar[i] += br[i];
    }
}

/* Neox rotary on x: [T, H, D] with token stride st and head stride sh (elements). */
static void nr_rotary(float *x, int64_t T, int64_t H, int64_t st, int64_t sh,
                      const int64_t *pos, const float *cs, int64_t rot) {
    int64_t half = rot / 2;
    #pragma omp parallel for schedule(static) if (T * H * rot > NR_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cs + pos[t] * rot, *s = c + half;
        for (int64_t h = 0; h < H; h++) {
            float *x1 = x + t * st + h * sh, *x2 = x1 + half;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

#endif
