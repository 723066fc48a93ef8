/* KV cache rows: one slot of one kv head, in each cache element type (nr_kv_type).
 *
 * f32 and bf16 rows hold D values. An int8 row holds D int8 values q = rint(x * 127 / max |x|)
 * followed by s = max |x| / 127 of that row (symmetric) as the 4 bytes of a native f32, so
 * x ~= q * s and a block's bytes carry their own scales (numa_runtime/backend/reference.py:
 * quantize_kv).
 */
#ifndef NR_KV_ROWS_H
#define NR_KV_ROWS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum nr_kv_type { NR_KV_F32 = 0, NR_KV_BF16 = 1, NR_KV_INT8 = 2 };
#define NR_KV_SCALE_BYTES 4  /* an int8 row ends with its f32 scale */

/* Elements of one cache row (one slot of one kv head). */
static inline int64_t nr_kv_row(int kv_type, int64_t D) {
    return kv_type == NR_KV_INT8 ? D + NR_KV_SCALE_BYTES : D;
}

/* dst[0:D] (int8) and its scale at dst[D:D+4] from x[0:D]: q = rint(x * (127 / max |x|)).
 * NOTE: the same f32 operations as reference.quantize_kv, so both give the same bytes. */
static inline void nr_quantize_row(const float *x, int64_t D, int8_t *dst) {
    float amax = 0.f;
    #pragma omp simd reduction(max:amax)
    for (int64_t d = 0; d < D; d++) { float ax = fabsf(x[d]); amax = ax > amax ? ax : amax; }
    float s = amax / 127.f, inv = amax > 0.f ? fminf(127.f / amax, FLT_MAX) : 0.f;
    #pragma omp simd
    for (int64_t d = 0; d < D; d++) {
        float r = nearbyintf(x[d] * inv);
        dst[d] = (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
    }
    memcpy(dst + D, &s, sizeof s);
}

/* The scale at the end of an int8 row (unaligned when D is not a multiple of 4). */
static inline float nr_row_scale(const int8_t *row, int64_t D) {
    float s;
    memcpy(&s, row + D, sizeof s);
    return s;
}

/* dst[0:D] = q[d] * s of an int8 row. */
static inline void nr_dequantize_row(const int8_t *row, int64_t D, float *dst) {
    float s = nr_row_scale(row, D);
    #pragma omp simd
    for (int64_t d = 0; d < D; d++) dst[d] = (float)row[d] * s;
}

#endif
