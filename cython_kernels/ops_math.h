/* Shared scalar helpers for ops.pyx, attention.pyx and sampling.pyx.
 *
 * Everything here is plain C that GCC auto-vectorises under `#pragma omp simd`
 * (built with -O3 -fopenmp -march=x86-64-v3); no libm calls in hot loops.
 */
#ifndef NR_OPS_MATH_H
#define NR_OPS_MATH_H

#include <stdint.h>
#include <string.h>
#include <math.h>

/* NOTE: without trapping math GCC if-converts the clamps and selects in our loops and
 * vectorises them (the build does not pass -fno-trapping-math). */
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

/* bf16 bits -> f32, exact. */
static inline float nr_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

/* f32 -> bf16 bits, round to nearest even; NaN -> 0x7FC0 (as reference.f32_to_bf16). */
static inline uint16_t nr_f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    uint32_t u = c.u;
    uint32_t r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    return (f != f) ? (uint16_t)0x7FC0 : (uint16_t)r;
}

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

#pragma GCC pop_options

#endif
