/* AVX-512 quantized kernels (target attributes; qg_cpu_level() picks them at run time).
 * Same contracts as qgemm_avx2.h; a 16-column block is one zmm. */
#ifndef NUMA_RUNTIME_QGEMM_AVX512_H
#define NUMA_RUNTIME_QGEMM_AVX512_H

#define QG_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define QG_MR_REG_AVX512 8   /* rows in registers while streaming */
#define QG_MR_TILE_AVX512 12 /* rows per FMA tile on the L1 path */

/* P's 32-bit lanes shifted left by s (right by -s), s a constant after unrolling. */
#define QG_SHV512(P, s) ((s) >= 0 ? _mm512_sll_epi32(P, _mm_cvtsi32_si128(s)) \
                                  : _mm512_srl_epi32(P, _mm_cvtsi32_si128(-(s))))

/* A ks group's int8 sub-scales (which 0) or mins (1) of the 16 columns, as int32 lanes. */
QG_INLINE QG_T512 __m512i qg_sub512(const qg_format* f, const uint8_t* meta, int which) {
    if (qg_nib_meta(f)) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)meta));
        return which ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
    }
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(meta + 16 * which)));
}

/* A super-block's f16 d (which 0) or dmin (1) of the 16 columns (sp: qg_super_of), as f32. */
QG_INLINE QG_T512 __m512 qg_super512(const uint8_t* sp, int which) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 32 * which)));
}
/* A ks group's s = d sc and c = -dmin m, given its super-block's d / dmin as f32. */
QG_INLINE QG_T512 __m512 qg_ks_s512(const qg_format* f, const uint8_t* meta, __m512 d) {
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(qg_sub512(f, meta, 0)));
}
QG_INLINE QG_T512 __m512 qg_ks_c512(const qg_format* f, const uint8_t* meta, __m512 dm) {
    return _mm512_fnmadd_ps(dm, _mm512_cvtepi32_ps(qg_sub512(f, meta, 1)), _mm512_setzero_ps());
}

/* Group g's scales s (meta: its meta) and, for the asymmetric kinds, the c of w = q s + c:
 * f16 values, or with ks d * sc and -dmin * m (exact in f32). */
QG_INLINE QG_T512 __m512 qg_s512(const uint8_t* blk, const qg_format* f, const uint8_t* meta, long g) {
    if (!f->ks) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)meta));
    return qg_ks_s512(f, meta, qg_super512(qg_super_of(blk, f, g), 0));
}

QG_INLINE QG_T512 __m512 qg_c512(const uint8_t* blk, const qg_format* f, const uint8_t* meta, long g,
                                  __m512 s) {
    if (f->ks) return qg_ks_c512(f, meta, qg_super512(qg_super_of(blk, f, g), 1));
    const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(meta + 32)));
    return f->kind == QG_ZERO ? _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(s, o)) : o;
}

QG_INLINE QG_T512 void qg_sc_avx512(const uint8_t* blk, const qg_format* f, const uint8_t* meta,
                                    long g, int bits, __m512* s, __m512* c) {
    *s = qg_s512(blk, f, meta, g);
    if (bits == 8 || f->kind == QG_NL) {
        *c = _mm512_setzero_ps();
    } else if (f->kind == QG_SYM) {
        *c = _mm512_mul_ps(*s, _mm512_set1_ps(-(float)(1 << (bits - 1))));
    } else {
        *c = qg_c512(blk, f, meta, g, *s);
    }
}

/* What an int4 code stands for, as f32, indexed by the code: the NL levels for QG_NL, else the
 * code itself (the permute takes the place of a conversion). */
QG_INLINE QG_T512 __m512 qg_lut512(const qg_format* f) {
    if (f->kind == QG_NL)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qg_nl_levels)));
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* The i-th k of packed row v as f32: int4 through lut (qg_lut512), int8 converted. */
QG_INLINE QG_T512 __m512 qg_q_avx512(__m512i v, int bits, int i, __m512 lut) {
    if (bits == 4)
        return _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * i), _mm512_set1_epi32(0xF)), lut);
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24));
}

/* int2/3/5/6: nibble row rr of the unit at `unit` (p: its first 64 bytes, already loaded) as the
 * int4 path's two byte vectors: byte b of lane j of lo / hi is column j's code at unit-local
 * k = 8 rr + 2 b / 8 rr + 2 b + 1 (packing.py's layouts). int5/int6: the low nibbles of nibble
 * row rr with the high bits of plane p merged in; int2: p's crumbs; int3: p's crumbs with the
 * third bits of words 2 rr and 2 rr + 1 added as byte masks. The decode kernels, the row tiles
 * and the dequantization all merge here. */
QG_INLINE QG_T512 void qg_hb_merge512(const uint8_t* unit, __m512i p, int bits, int rr, __m512i* lo,
                                      __m512i* hi) {
    if (bits == 2 || bits == 3) {
        const __m512i m2 = _mm512_set1_epi32(0x03030303);
        *lo = _mm512_and_si512(QG_SHV512(p, -4 * rr), m2);
        *hi = _mm512_and_si512(QG_SHV512(p, -4 * rr - 2), m2);
        if (bits == 3) {
            uint64_t w[2];
            memcpy(w, unit + 64 + 16 * rr, 16);
            const __m512i four = _mm512_set1_epi8(4);
            *lo = _mm512_mask_add_epi8(*lo, _cvtu64_mask64(w[0]), *lo, four);
            *hi = _mm512_mask_add_epi8(*hi, _cvtu64_mask64(w[1]), *hi, four);
        }
        return;
    }
    const __m512i n = _mm512_loadu_si512((const void*)(unit + 64 + 64 * rr));
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F);
    const __m512i hm = _mm512_set1_epi32(bits == 5 ? 0x10101010 : 0x30303030);
    const int se = bits == 5 ? 4 - 2 * rr : 4 - 4 * rr, so = se - (bits - 4);
    *lo = _mm512_ternarylogic_epi32(_mm512_and_si512(n, m4), QG_SHV512(p, se), hm, 0xF8);
    *hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(n, 4), m4), QG_SHV512(p, so), hm, 0xF8);
}

/* The code at unit-local k = 8 rr + j from qg_hb_merge512's vectors, as f32. */
QG_INLINE QG_T512 __m512 qg_hb_code512(__m512i lo, __m512i hi, int j) {
    const __m512i e = (j & 1) ? hi : lo;
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(e, _mm_cvtsi32_si128(8 * (j >> 1))),
                                               _mm512_set1_epi32(0xFF)));
}

/* One step of pk = 8 (int2-6) or 4 (int8) k at group-local k kl of a group's rows (after its
 * meta): v holds the int4/int8 row, or lo and hi the merged int2/3/5/6 codes (v = lo). */
QG_INLINE QG_T512 void qg_step512(const uint8_t* rows, const qg_format* f, long kl, const int bits,
                                  __m512i* v, __m512i* hi) {
    if (bits != 4 && bits != 8) {
        const long uk = qg_pk_of(bits);
        const uint8_t* unit = rows + kl / uk * qg_ub_of(bits);
        const int rr = (int)(kl % uk) / 8;
        qg_hb_merge512(unit, _mm512_loadu_si512((const void*)unit), bits, rr, v, hi);
    } else {
        *v = *hi = _mm512_loadu_si512((const void*)(rows + kl / (bits == 4 ? 8 : 4) * 64));
    }
}

/* The code of step k's i-th k (qg_step512's vectors), as f32 (int4: through lut). */
QG_INLINE QG_T512 __m512 qg_code512(__m512i v, __m512i hi, const int bits, int i, __m512 lut) {
    return bits != 4 && bits != 8 ? qg_hb_code512(v, hi, i) : qg_q_avx512(v, bits, i, lut);
}

/* k0, k1: multiples of the step (8 k, 4 for int8). */
QG_INLINE QG_T512 void qg_dequant_avx512_b(const uint8_t* blk, const qg_format* f, long k0,
                                           long k1, float* tile, const int bits) {
    const long pk = bits == 8 ? 4 : 8, mb = qg_meta_bytes(f);
    const uint8_t* gbase = qg_groups(blk, f);  /* group g: gbase + g gb */
    const long gb = qg_group_bytes(f);
    __m512 s = _mm512_setzero_ps(), c = _mm512_setzero_ps();
    const __m512 lut = qg_lut512(f);
    long g_last = -1;
    for (long k = k0; k < k1; k += pk) {
        long g = k / f->group;
        const uint8_t* meta = gbase + g * gb;
        if (g != g_last) {
            qg_sc_avx512(blk, f, meta, g, bits, &s, &c);
            g_last = g;
        }
        __m512i v, hi;
        qg_step512(meta + mb, f, k - g * f->group, bits, &v, &hi);
        for (int i = 0; i < pk; i++)
            _mm512_store_ps(tile + (k - k0 + i) * QG_NB,
                            _mm512_fmadd_ps(qg_code512(v, hi, bits, i, lut), s, c));
    }
}

static QG_T512 void qg_dequant_avx512(const uint8_t* blk, const qg_format* f, long k0, long k1,
                                      float* t) {
    switch (f->bits) {
        case 2: qg_dequant_avx512_b(blk, f, k0, k1, t, 2); break;
        case 3: qg_dequant_avx512_b(blk, f, k0, k1, t, 3); break;
        case 4: qg_dequant_avx512_b(blk, f, k0, k1, t, 4); break;
        case 5: qg_dequant_avx512_b(blk, f, k0, k1, t, 5); break;
        case 6: qg_dequant_avx512_b(blk, f, k0, k1, t, 6); break;
        default: qg_dequant_avx512_b(blk, f, k0, k1, t, 8); break;
    }
}

QG_INLINE QG_T512 void qg_gemv_avx512_mr(const uint8_t* blk, const qg_format* f, const float* x,
                                         long ldx, float* acc, const int bits, const int mr) {
    const long pk = bits == 4 ? 8 : 4, mb = qg_meta_bytes(f);
    const uint8_t* gbase = qg_groups(blk, f);  /* group g: gbase + g gb */
    const long gb = qg_group_bytes(f);
    const long ng = f->kp / f->group, rows = f->group / pk;
    const __m512 lut = qg_lut512(f);
    __m512 a[QG_MR_REG_AVX512];
    for (int r = 0; r < mr; r++) a[r] = _mm512_setzero_ps();
    for (long g = 0; g < ng; g++) {
        const uint8_t* meta = gbase + g * gb;
        __m512 s, c;
        qg_sc_avx512(blk, f, meta, g, bits, &s, &c);
        const uint8_t* row = meta + mb;
        const float* xg = x + g * f->group;
        for (long q = 0; q < rows; q++, row += 64, xg += pk) {
            __m512i v = _mm512_loadu_si512((const void*)row);
            for (int i = 0; i < pk; i++) {
                __m512 w = _mm512_fmadd_ps(qg_q_avx512(v, bits, i, lut), s, c);
                for (int r = 0; r < mr; r++)
                    a[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(xg[r * ldx + i]), a[r]);
            }
        }
    }
    for (int r = 0; r < mr; r++) _mm512_store_ps(acc + r * QG_NB, a[r]);
}

#define QG_GEMV512_CASES(b)                                                  \
    switch (m) {                                                             \
        case 1: qg_gemv_avx512_mr(blk, f, x, ldx, acc, b, 1); break;         \
        case 2: qg_gemv_avx512_mr(blk, f, x, ldx, acc, b, 2); break;         \
        case 3: qg_gemv_avx512_mr(blk, f, x, ldx, acc, b, 3); break;         \
        case 4: qg_gemv_avx512_mr(blk, f, x, ldx, acc, b, 4); break;         \
        case 5: qg_gemv_avx512_mr(blk, f, x, ldx, acc, b, 5); break;         \
        case 6: qg_gemv_avx512_mr(blk, f, x, ldx, acc, b, 6); break;         \
        case 7: qg_gemv_avx512_mr(blk, f, x, ldx, acc, b, 7); break;         \
        default: qg_gemv_avx512_mr(blk, f, x, ldx, acc, b, 8); break;        \
    }

static QG_T512 void qg_gemv_avx512(const uint8_t* blk, const qg_format* f, const float* x,
                                   long ldx, int m, float* acc) {
    if (f->bits == 4) {
        QG_GEMV512_CASES(4)
    } else {
        QG_GEMV512_CASES(8)
    }
}

QG_INLINE QG_T512 void qg_tile_avx512_mr(const float* wt, long kc, const float* x, long ldx,
                                         float* acc, const int mr, int first) {
    __m512 a[QG_MR_TILE_AVX512];
    for (int r = 0; r < mr; r++)
        a[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * QG_NB);
    for (long k = 0; k < kc; k++) {
        __m512 w = _mm512_load_ps(wt + k * QG_NB);
        for (int r = 0; r < mr; r++)
            a[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * ldx + k]), a[r]);
    }
    for (int r = 0; r < mr; r++) _mm512_store_ps(acc + r * QG_NB, a[r]);
}

static QG_T512 void qg_tile_avx512(const float* wt, long kc, const float* x, long ldx, int m,
                                   float* acc, int first) {
    for (int r0 = 0; r0 < m; r0 += QG_MR_TILE_AVX512) {
        int mr = m - r0 < QG_MR_TILE_AVX512 ? m - r0 : QG_MR_TILE_AVX512;
        const float* xr = x + r0 * ldx;
        float* ar = acc + r0 * QG_NB;
        switch (mr) {
            case 1: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 1, first); break;
            case 2: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 2, first); break;
            case 3: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 3, first); break;
            case 4: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 4, first); break;
            case 5: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 5, first); break;
            case 6: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 6, first); break;
            case 7: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 7, first); break;
            case 8: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 8, first); break;
            case 9: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 9, first); break;
            case 10: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 10, first); break;
            case 11: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 11, first); break;
            default: qg_tile_avx512_mr(wt, kc, xr, ldx, ar, 12, first); break;
        }
    }
}

#endif
