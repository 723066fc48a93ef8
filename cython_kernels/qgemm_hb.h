/* int5/int6 weights (GGUF Q5_0, Q5_1, Q5_K, Q6_K kept at their own widths) on the f32 paths.
 *
 * A unit of U = 32 (int5) or 16 (int6) k of a 16-column block is a plane row of high bits and
 * U / 8 int4 rows of low nibbles (qgemm_kernels.h, numa_runtime/quant/packing.py). The decode
 * kernels (qgemm_q8.h) and the VNNI row tiles (qgemm_q8tile.h) merge the high bits into the int4
 * path's nibble bytes; the f32 tile path, the bf16 panels and the AMX-BF16 tiles dequantize
 * through the per-k code below. AMX-INT8 tiles do not read this layout (qg_amx_fits): decode
 * batches of int5/int6 take the row tiles where AMX is present too.
 */
#ifndef NUMA_RUNTIME_QGEMM_HB_H
#define NUMA_RUNTIME_QGEMM_HB_H

/* Codes (0..31 or 0..63) of columns 8h..8h+7 at unit-local k = i, as int32 lanes. */
QG_INLINE __m256i qg_hb_code_avx2(const uint8_t* unit, int bits, int i, int h) {
    const int r = i >> 3, j = i & 7, b = j >> 1, e = j & 1;
    const int sh = 8 * b + (bits - 4) * (2 * r + e);
    const __m256i n = _mm256_loadu_si256((const __m256i*)(unit + 64 + 64 * r + 32 * h));
    const __m256i p = _mm256_loadu_si256((const __m256i*)(unit + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(n, _mm_cvtsi32_si128(4 * j)),
                                        _mm256_set1_epi32(0xF));
    const __m256i hb = _mm256_and_si256(_mm256_srl_epi32(p, _mm_cvtsi32_si128(sh)),
                                        _mm256_set1_epi32((1 << (bits - 4)) - 1));
    return _mm256_or_si256(lo, _mm256_slli_epi32(hb, 4));
}

/* tile[(k - k0) * 16 + j] = w[j, k], k0 <= k < k1 (the qg_dequant_fn contract). */
static void qg_dequant_hb(const uint8_t* blk, const qg_format* f, long k0, long k1, float* tile) {
    const long uk = qg_pack_k(f), ub = qg_unit_bytes(f), mb = qg_meta_bytes(f);
    const uint8_t* gbase = qg_groups(blk, f);  /* group g: gbase + g gb */
    const long gb = qg_group_bytes(f);
    __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, c[2] = {s[0], s[1]};
    long g_last = -1;
    for (long k = k0; k < k1; k++) {
        const long g = k / f->group, kl = k - g * f->group;
        const uint8_t* meta = gbase + g * gb;
        if (g != g_last) {
            qg_sc_avx2(blk, f, meta, g, f->bits, s, c);
            g_last = g;
        }
        const uint8_t* unit = meta + mb + kl / uk * ub;
        for (int h = 0; h < 2; h++)
            _mm256_store_ps(tile + (k - k0) * QG_NB + 8 * h,
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(qg_hb_code_avx2(unit, f->bits, (int)(kl % uk), h)),
                                            s[h], c[h]));
    }
}

#endif
