/* Shared scalar helpers for ops.pyx, attention.pyx and sampling.pyx.
 *
 * Everything here is plain C that GCC auto-vectorises under `#pragma omp simd`
 * (built with -O3 -fopenmp -march=x86-64-v3 -fno-trapping-math, so the clamps and selects
 * if-convert); no libm calls in hot loops. bf16 conversions come from bf16.h.
 */
#ifndef NR_OPS_MATH_H
#define NR_OPS_MATH_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "bf16.h"

/* Elements below which an elementwise loop stays on one thread (streaming loops that read and
 * write every element, e.g. the bf16 conversions and reduce_impl.h's sums, use 4x this). */
#define NR_PAR_MIN 32768

/* exp(x) in f32, Cephes polynomial, ~1 ulp on the normal range; 0 below -87.3 (the
 * reference's exp underflows there too, to within f32 rounding of any sum it enters). */
#pragma omp declare simd notinbranch
static inline float nr_expf(float x) {
    float xc = x > 88.3762626647949f ? 88.3762626647949f : x;
    xc = xc < -87.3365447504f ? -87.3365447504f : xc;
    float fx = __builtin_rintf(xc * 1.44269504088896341f);
    float r = xc - fx * 0.693359375f;
    r = r + fx * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((int32_t)fx + 127) << 23;
    y = y * c.f;
    return x < -87.3365447504f ? 0.0f : y;
}

#endif
