/* bf16 <-> f32: the one C definition (numa_runtime/backend/reference.py's f32_to_bf16 and
 * bf16_to_f32 are the specification). bf16 values are uint16 bits: the upper half of an IEEE
 * float32. Plain C that GCC vectorises (the NaN test is a select, not a branch).
 */
#ifndef NR_BF16_H
#define NR_BF16_H

#include <stdint.h>
#include <string.h>

/* bf16 bits -> f32, exact. */
static inline float nr_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* f32 -> bf16 bits, round to nearest even; NaN -> 0x7FC0 (quiet NaN, whatever the payload). */
static inline uint16_t nr_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : (uint16_t)rounded;
}

#endif
