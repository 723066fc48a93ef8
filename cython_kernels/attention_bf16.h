/* Tiled attention item on AVX-512 BF16 for bf16 KV caches: Q K^T and P V as vdpbf16ps products
 * (16 lanes x 2 bf16 products into f32 = 32 multiply-adds per instruction), online softmax in
 * f32. Included by attention_kernels.h after nr_attn_item_tiled, with the same contract.
 *
 * NOTE: the K/V rows of a bf16 cache are already bf16, so the only new roundings are Q * scale
 * and the probabilities P, each to bf16 (round to nearest even, relative error <= 2^-8). The
 * softmax sum l adds the rounded P, so the output is an exact convex combination of V rows with
 * weights each within 2^-8 of the f32 path's. Products and sums stay f32.
 *
 * Layout of one item (nq query vectors = rows x group heads, nqp = nq rounded up to 16, D2 =
 * ceil(D / 2), Dp = D rounded up to 16). Queries lie in the lanes for Q K^T and softmax:
 *   Q2 [D2][nqp] u32      bf16 pair (q[2p], q[2p+1]) * scale of query qi at [p][qi]; zero pad
 *                         (built row by query in Qr, then transposed in 16 x 16 blocks)
 *   St [NR_KT][nqp] f32   scores of key j of the tile (row j) against every query (lanes)
 *   P2 [NR_KT/2][nqp] u32 bf16 pair (p[2jp], p[2jp+1]) of each query
 *   V2 [NR_KT/2][Dp] u32  bf16 pair (v[2jp][d], v[2jp+1][d]) of each column d
 *   O  [nq][Dp] f32       unnormalized output rows
 * Keys are broadcast straight from the cache rows (no key transposition); within a key tile
 * only keys [klo, khi) that some query of the item sees are computed, the key tiles outside the
 * item's causal (and window) range are never visited, and partly visible keys are masked per
 * lane.
 */
#ifndef NR_ATTENTION_BF16_H
#define NR_ATTENTION_BF16_H

#define NR_TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define NR_KR 8  /* key rows per Q K^T register tile */

#include "attention_amx.h"

static inline size_t nr_ws_bf16_floats(int64_t nq, int64_t D) {
    int64_t nqp = nr_pad16(nq), Dp = nr_pad16(D), D2p = nr_pad16((D + 1) / 2);
    /* Q2 has D2p rows and Qr (its rows by query) as many values; O has nqp rows for the AMX
     * tiles; then their key copies (16 x D bf16) and Pr */
    return (size_t)(2 * D2p * nqp + nqp * Dp + 5 * nqp + NR_KT * nqp + NR_KT / 2 * nqp +
                    NR_KT / 2 * Dp + 8 * D + 16 * NR_KT / 2 + 64);
}

NR_ALWAYS uint32_t nr_ld32(const uint16_t *p) {
    uint32_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* St[r][16 w ...] = key row r . Q2 for r < kr, w < nw (constants): pairs broadcast from the
 * cache row; an odd D's last element pairs with zero (never reads past the row). */
NR_ALWAYS NR_TBF16 void nr_qk_bf16(const uint16_t *const *krow, int64_t D, const uint32_t *Q2,
                                   int64_t nqp, float *St, const int kr, const int nw) {
    __m512 c[NR_KR][2];
    for (int r = 0; r < kr; r++)
        for (int w = 0; w < nw; w++) c[r][w] = _mm512_setzero_ps();
    int64_t np = D / 2;
    for (int64_t p = 0; p < np; p++) {
        __m512i qv[2];
        for (int w = 0; w < nw; w++) qv[w] = _mm512_loadu_si512((const void *)(Q2 + p * nqp + 16 * w));
        for (int r = 0; r < kr; r++) {
            __m512i kb = _mm512_set1_epi32((int)nr_ld32(krow[r] + 2 * p));
            for (int w = 0; w < nw; w++)
                c[r][w] = _mm512_dpbf16_ps(c[r][w], (__m512bh)kb, (__m512bh)qv[w]);
        }
    }
    if (D & 1) {
        __m512i qv[2];
        for (int w = 0; w < nw; w++) qv[w] = _mm512_loadu_si512((const void *)(Q2 + np * nqp + 16 * w));
        for (int r = 0; r < kr; r++) {
            __m512i kb = _mm512_set1_epi32((int)krow[r][D - 1]);
            for (int w = 0; w < nw; w++)
                c[r][w] = _mm512_dpbf16_ps(c[r][w], (__m512bh)kb, (__m512bh)qv[w]);
        }
    }
    for (int r = 0; r < kr; r++)
        for (int w = 0; w < nw; w++) _mm512_storeu_ps(St + r * nqp + 16 * w, c[r][w]);
}

#define NR_KR_CASE(kr) case kr: nw == 2 ? nr_qk_bf16(rows, D, Q2c, nqp, Stc, kr, 2) \
                                        : nr_qk_bf16(rows, D, Q2c, nqp, Stc, kr, 1); break;

/* St rows [klo, khi) for query lanes [0, nqp) (lane chunks of up to 32). */
static NR_TBF16 void nr_qk_tile_bf16(const uint16_t *const *krow, int64_t klo, int64_t khi,
                                     int64_t D, const uint32_t *Q2, int64_t nqp, float *St) {
    for (int64_t q0 = 0; q0 < nqp; q0 += 32) {
        int nw = nqp - q0 >= 32 ? 2 : 1;
        for (int64_t j = klo; j < khi; j += NR_KR) {
            const uint16_t *const *rows = krow + j;
            const uint32_t *Q2c = Q2 + q0;
            float *Stc = St + j * nqp + q0;
            switch (khi - j < NR_KR ? (int)(khi - j) : NR_KR) {
                NR_KR_CASE(1) NR_KR_CASE(2) NR_KR_CASE(3) NR_KR_CASE(4)
                NR_KR_CASE(5) NR_KR_CASE(6) NR_KR_CASE(7) NR_KR_CASE(8)
            }
        }
    }
}
#undef NR_KR_CASE

/* O[r][16 w ...] += sum over key pairs jp of P2[jp][r] . V2[jp][16 w ...], r < mr, w < nw. */
NR_ALWAYS NR_TBF16 void nr_pv_bf16(const uint32_t *P2, int64_t nqp, const uint32_t *V2, int64_t Dp,
                                   float *O, int64_t jp0, int64_t jp1, const int nw, const int mr,
                                   int first) {
    (void)first;
    __m512 c[NR_MR][4];
    for (int r = 0; r < mr; r++)
        for (int w = 0; w < nw; w++) c[r][w] = _mm512_loadu_ps(O + r * Dp + 16 * w);
    for (int64_t jp = jp0; jp < jp1; jp++) {
        __m512i v[4];
        for (int w = 0; w < nw; w++) v[w] = _mm512_loadu_si512((const void *)(V2 + jp * Dp + 16 * w));
        for (int r = 0; r < mr; r++) {
            __m512i pb = _mm512_set1_epi32((int)P2[jp * nqp + r]);
            for (int w = 0; w < nw; w++) c[r][w] = _mm512_dpbf16_ps(c[r][w], (__m512bh)pb, (__m512bh)v[w]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int w = 0; w < nw; w++) _mm512_storeu_ps(O + r * Dp + 16 * w, c[r][w]);
}

static NR_TBF16 void nr_pv_tile_bf16(const uint32_t *P2, int64_t nqp, const uint32_t *V2,
                                     int64_t Dp, float *O, int64_t nq, int64_t jp0, int64_t jp1) {
    int first = 0;
    for (int64_t r0 = 0; r0 < nq; r0 += NR_MR) {
        int mr = nq - r0 < NR_MR ? (int)(nq - r0) : NR_MR;
        int64_t d0 = 0;
        for (; d0 + 64 <= Dp; d0 += 64)
            NR_MR_SWITCH(nr_pv_bf16, mr, P2 + r0, nqp, V2 + d0, Dp, O + r0 * Dp + d0, jp0, jp1, 4)
        for (; d0 < Dp; d0 += 16)
            NR_MR_SWITCH(nr_pv_bf16, mr, P2 + r0, nqp, V2 + d0, Dp, O + r0 * Dp + d0, jp0, jp1, 1)
    }
}

/* V2 pairs jp in [jp0, jp1) from value rows vrow (keys outside [klo, khi) read as zero). */
static NR_TBF16 void nr_pack_v_bf16(const uint16_t *const *vrow, int64_t klo, int64_t khi,
                                    int64_t D, int64_t Dp, uint32_t *V2) {
    __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                   39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    for (int64_t jp = klo / 2; jp < (khi + 1) / 2; jp++) {
        int64_t ja = 2 * jp, jb = ja + 1;
        const uint16_t *va = ja >= klo ? vrow[ja] : NULL, *vb = jb < khi ? vrow[jb] : NULL;
        uint32_t *dst = V2 + jp * Dp;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            __mmask32 k = D - d0 >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (D - d0)) - 1u);
            __m512i a = va ? _mm512_maskz_loadu_epi16(k, va + d0) : _mm512_setzero_si512();
            __m512i b = vb ? _mm512_maskz_loadu_epi16(k, vb + d0) : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(dst + d0), _mm512_permutex2var_epi16(a, ilo, b));
            if (d0 + 16 < Dp)
                _mm512_storeu_si512((void *)(dst + d0 + 16), _mm512_permutex2var_epi16(a, ihi, b));
        }
    }
}

/* exp in f32 (nr_expf's polynomial, 16 lanes): exp(0) = 1 exactly, 0 below -87.3. */
NR_ALWAYS NR_TBF16 __m512 nr_exp512(__m512 x) {
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365447504f)),
                              _mm512_set1_ps(88.3762626647949f));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365447504f), _CMP_GE_OQ), y);
}

/* Online softmax of one key tile for 16 query lanes: St rows [klo, khi) (key j at position
 * j0 + j, visible to lane q when first[q] <= j0 + j <= pos[q]) become bf16 pairs in P2 (zero
 * where masked); m, l and corr (the factor the lane's O row must be scaled by) updated. */
NR_ALWAYS NR_TBF16 void nr_softmax16_bf16(const float *St, int64_t nqp, int64_t j0, int64_t klo,
                                          int64_t khi, const int32_t *pos, const int32_t *first,
                                          float *m, float *l, float *corr, uint32_t *P2) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512i vp = _mm512_loadu_si512((const void *)pos), vf = _mm512_loadu_si512((const void *)first);
    int64_t ja = klo & ~(int64_t)1, jb = (khi + 1) & ~(int64_t)1;
    __m512 mold = _mm512_loadu_ps(m), mx = mold;
    /* every lane sees every key of [klo, khi) (no causal or window edge in it): no masks */
    int all = _mm512_reduce_min_epi32(vp) >= j0 + khi - 1 && _mm512_reduce_max_epi32(vf) <= j0 + klo;
#define NR_SCORE(j) ((j) < klo || (j) >= khi ? ninf : all ? _mm512_loadu_ps(St + (j) * nqp) :     \
        _mm512_mask_blend_ps(                                                                   \
        _mm512_cmp_epi32_mask(_mm512_set1_epi32((int)(j0 + (j))), vp, _MM_CMPINT_LE) &          \
        _mm512_cmp_epi32_mask(_mm512_set1_epi32((int)(j0 + (j))), vf, _MM_CMPINT_NLT),          \
        ninf, _mm512_loadu_ps(St + (j) * nqp)))
    for (int64_t j = klo; j < khi; j++) mx = _mm512_max_ps(mx, NR_SCORE(j));
    /* lanes that saw no key yet keep m = -inf, p = 0 and corr = 1 */
    __m512 ms = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), mx, _mm512_setzero_ps());
    __m512 c = nr_exp512(_mm512_sub_ps(mold, ms));
    c = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), c, _mm512_set1_ps(1.0f));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = ja; j < jb; j += 2) {
        __m256i b0 = (__m256i)_mm512_cvtneps_pbh(nr_exp512(_mm512_sub_ps(NR_SCORE(j), ms)));
        __m256i b1 = (__m256i)_mm512_cvtneps_pbh(nr_exp512(_mm512_sub_ps(NR_SCORE(j + 1), ms)));
        __m512i w0 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(b0), 16);
        __m512i w1 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(b1), 16);
        sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(w0), _mm512_castsi512_ps(w1)));
        _mm512_storeu_si512((void *)(P2 + j / 2 * nqp), _mm512_or_si512(_mm512_srli_epi32(w0, 16), w1));
    }
#undef NR_SCORE
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), c, sum));
    _mm512_storeu_ps(m, mx);
    _mm512_storeu_ps(corr, c);
}

/* Row pointers of keys and values j0..j0+nk of kv head hk of sequence s, straight from the
 * bf16 caches (one division per tile, not per key). */
static inline void nr_bf16_rows(const nr_attn_args *a, int64_t s, int64_t hk, int64_t j0,
                                int64_t nk, const uint16_t **krows, const uint16_t **vrows) {
    const int32_t *bt = a->bt + s * a->bt_st;
    int64_t b = j0 / a->bs, o = j0 % a->bs;
    for (int64_t j = 0; j < nk; j++) {
        int64_t off = (((int64_t)bt[b] * a->bs + o) * a->Hk + hk) * a->D;
        krows[j] = (const uint16_t *)a->kc + off;
        vrows[j] = (const uint16_t *)a->vc + off;
        if (++o == a->bs) { o = 0; b++; }
    }
}

/* nr_attn_item_tiled on vdpbf16ps for a bf16 cache (a->level >= 2), with Q K^T and P V on
 * AMX-BF16 tiles where nr_amx and D is a multiple of 32 (attention_amx.h). Same contract. */
static NR_TBF16 void nr_attn_item_bf16(const nr_attn_args *a, int64_t s, int64_t hk, int64_t i0,
                                       int64_t i1, int64_t ja, int64_t jb, float *ws, float *part) {
    int64_t D = a->D, Dp = nr_pad16(D), D2p = nr_pad16((D + 1) / 2), group = a->Hq / a->Hk;
    int64_t q0 = a->qstart[s], n_new = a->qstart[s + 1] - q0;
    int64_t base = (int64_t)a->ctx[s] - n_new;  /* position of query row 0 */
    int64_t nq = (i1 - i0) * group, nqp = nr_pad16(nq);
    uint32_t *Q2 = (uint32_t *)ws;
    uint32_t *Qr = Q2 + D2p * nqp;
    float *O = (float *)(Qr + D2p * nqp), *m = O + nqp * Dp, *l = m + nqp, *corr = l + nqp;
    int32_t *pos = (int32_t *)(corr + nqp), *first = pos + nqp;
    float *St = (float *)(first + nqp);
    uint32_t *P2 = (uint32_t *)(St + NR_KT * nqp), *V2 = P2 + NR_KT / 2 * nqp;
    uint32_t *Pr = V2 + NR_KT / 2 * Dp;
    uint16_t *gbuf = (uint16_t *)(Pr + 16 * NR_KT / 2);
    const uint16_t *krows[NR_KT], *vrows[NR_KT];
    const int amx = nr_amx && D % 32 == 0;  /* attention_amx.h */

    for (int64_t qi = 0; qi < nqp; qi++) {
        pos[qi] = INT32_MAX;  /* padding lanes (zero Q) see every key; P V never reads them */
        first[qi] = 0;
        m[qi] = -INFINITY;
        l[qi] = 0.f;
    }
    /* Qr[qi][p] = the bf16 pair (q[2 p], q[2 p + 1]) * scale of query qi (zero past D and for
     * padding lanes), then Q2 = its transpose in 16 x 16 blocks */
    const __m512 vscale = _mm512_set1_ps(a->scale);
    for (int64_t qi = 0; qi < nqp; qi++) {
        uint32_t *dst = Qr + qi * D2p;
        if (qi >= nq) {
            memset(dst, 0, (size_t)D2p * sizeof(uint32_t));
            continue;
        }
        int64_t i = i0 + qi / group, h = hk * group + qi % group;
        const float *src = a->q + (q0 + i) * a->q_st + h * a->q_sh;
        for (int64_t d0 = 0; d0 < 2 * D2p; d0 += 32) {
            const int64_t r0 = D - d0, r1 = D - d0 - 16;
            const __mmask16 k0 = r0 >= 16 ? 0xFFFF : r0 <= 0 ? 0 : (__mmask16)((1u << r0) - 1u);
            const __mmask16 k1 = r1 >= 16 ? 0xFFFF : r1 <= 0 ? 0 : (__mmask16)((1u << r1) - 1u);
            const __m512 lo = _mm512_mul_ps(_mm512_maskz_loadu_ps(k0, src + d0), vscale);
            const __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(k1, src + d0 + 16), vscale);
            _mm512_storeu_si512((void *)(dst + d0 / 2), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        pos[qi] = (int32_t)(base + i);
        first[qi] = (int32_t)nr_first_key(a, base + i);
    }
    for (int64_t p0 = 0; p0 < D2p; p0 += 16)
        for (int64_t c = 0; c < nqp; c += 16) nr_tr16_u32(Qr + c * D2p + p0, D2p, Q2 + p0 * nqp + c, nqp);
    memset(O, 0, (size_t)(nqp * Dp) * sizeof(float));
    int64_t kfirst = first[0], klast = pos[nq - 1];  /* lanes are in position order */
    if (amx) nr_tile_config_16x64();
    for (int64_t j0 = ja; j0 < jb; j0 += NR_KT) {
        int64_t nk = jb - j0 < NR_KT ? jb - j0 : NR_KT;
        int64_t klo = kfirst - j0 > 0 ? kfirst - j0 : 0, khi = klast + 1 - j0 < nk ? klast + 1 - j0 : nk;
        if (khi <= klo) continue;  /* no query of the item sees a key of this tile */
        nr_bf16_rows(a, s, hk, j0, nk, krows, vrows);
        if (amx)
            nr_qk_amx(krows, klo, khi, nk, D, a->Hk * D, Q2, nqp, St, gbuf);
        else
            nr_qk_tile_bf16(krows, klo, khi, D, Q2, nqp, St);
        for (int64_t c = 0; c < nqp; c += 16)
            nr_softmax16_bf16(St + c, nqp, j0, klo, khi, pos + c, first + c, m + c, l + c,
                              corr + c, P2 + c);
        for (int64_t qi = 0; qi < nq; qi++) {
            if (corr[qi] == 1.0f) continue;
            __m512 cv = _mm512_set1_ps(corr[qi]);
            for (int64_t d = 0; d < Dp; d += 16)
                _mm512_storeu_ps(O + qi * Dp + d, _mm512_mul_ps(_mm512_loadu_ps(O + qi * Dp + d), cv));
        }
        nr_pack_v_bf16(vrows, klo, khi, D, Dp, V2);
        if (amx)
            nr_pv_amx(P2, nqp, V2, Dp, O, klo / 2, (khi + 1) / 2, Pr);
        else
            nr_pv_tile_bf16(P2, nqp, V2, Dp, O, nq, klo / 2, (khi + 1) / 2);
    }
    if (amx) nr_tile_release();
    nr_item_store(a, s, hk, i0, nq, O, Dp, m, l, part);
}

#endif
