/* int2/3/5/6 weights (GGUF Q2_K, Q3_K, Q5_0, Q5_1, Q5_K, Q6_K kept at their own widths) on the
 * AVX2 paths.
 *
 * A unit of U = 32 (int5) or 16 (int2/3/6) k of a 16-column block is a plane row of high bits and
 * U / 8 int4 rows of low nibbles (int5/int6), or a row of 2-bit crumbs and for int3 four 64-bit
 * words of third bits (qgemm_kernels.h, numa_runtime/quant/packing.py). The kernels merge a unit
 * into the int4 path's nibble bytes (qg_hb_merge256 here, qg_hb_merge512 on AVX-512): the decode
 * kernels (qgemm_q8.h) and the VNNI row tiles (qgemm_q8tile.h) take those bytes into their
 * integer dot products, the f32 tile path, the bf16 panels and the AMX-BF16 tiles dequantize
 * them per k, and the AMX-INT8 tiles (qgemm_amx.h) store the merged bytes as their B rows.
 */
#ifndef NUMA_RUNTIME_QGEMM_HB_H
#define NUMA_RUNTIME_QGEMM_HB_H

/* P's 32-bit lanes shifted left by s (right by -s), s a constant after unrolling (QG_SHV512's
 * AVX2 twin). */
#define QG_SHV256(P, s) ((s) >= 0 ? _mm256_sll_epi32(P, _mm_cvtsi32_si128(s)) \
                                  : _mm256_srl_epi32(P, _mm_cvtsi32_si128(-(s))))

/* 32 bits m as 32 bytes: byte i is 0xFF where bit i of m is set, else 0. */
QG_INLINE __m256i qg_bits_bytes256(uint32_t m) {
    const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), sel);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* Column half h (lanes 8h..8h+7) of qg_hb_merge512: nibble row rr of the unit at `unit` as two
 * byte vectors (lo: unit-local k = 8 rr + 2 b, hi: + 1); p: the unit's first 64 bytes' half h. */
QG_INLINE void qg_hb_merge256(const uint8_t* unit, __m256i p, int bits, int rr, int h, __m256i* lo,
                              __m256i* hi) {
    if (bits == 2 || bits == 3) {
        const __m256i m2 = _mm256_set1_epi32(0x03030303);
        *lo = _mm256_and_si256(QG_SHV256(p, -4 * rr), m2);
        *hi = _mm256_and_si256(QG_SHV256(p, -4 * rr - 2), m2);
        if (bits == 3) {
            uint32_t w0, w1;  /* words 2 rr and 2 rr + 1, the bits of lanes 8h..8h+7 */
            memcpy(&w0, unit + 64 + 16 * rr + 4 * h, 4);
            memcpy(&w1, unit + 64 + 16 * rr + 8 + 4 * h, 4);
            const __m256i four = _mm256_set1_epi8(4);
            *lo = _mm256_or_si256(*lo, _mm256_and_si256(qg_bits_bytes256(w0), four));
            *hi = _mm256_or_si256(*hi, _mm256_and_si256(qg_bits_bytes256(w1), four));
        }
        return;
    }
    const __m256i n = _mm256_loadu_si256((const __m256i*)(unit + 64 + 64 * rr + 32 * h));
    const __m256i m4 = _mm256_set1_epi32(0x0F0F0F0F);
    const __m256i hm = _mm256_set1_epi32(bits == 5 ? 0x10101010 : 0x30303030);
    const int se = bits == 5 ? 4 - 2 * rr : 4 - 4 * rr, so = se - (bits - 4);
    *lo = _mm256_or_si256(_mm256_and_si256(n, m4), _mm256_and_si256(QG_SHV256(p, se), hm));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(n, 4), m4),
                          _mm256_and_si256(QG_SHV256(p, so), hm));
}

/* Codes of columns 8h..8h+7 at unit-local k = i, as int32 lanes. */
QG_INLINE __m256i qg_hb_code_avx2(const uint8_t* unit, int bits, int i, int h) {
    const int j = i & 7;
    __m256i lo, hi;
    qg_hb_merge256(unit, _mm256_loadu_si256((const __m256i*)(unit + 32 * h)), bits, i >> 3, h, &lo, &hi);
    return _mm256_and_si256(_mm256_srl_epi32((j & 1) ? hi : lo, _mm_cvtsi32_si128(8 * (j >> 1))),
                            _mm256_set1_epi32(0xFF));
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
