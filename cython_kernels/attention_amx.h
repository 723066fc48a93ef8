/* Q K^T and P V of the bf16 attention item (attention_bf16.h) on AMX-BF16 tiles, for a bf16
 * cache where the CPU has AMX-BF16 and the process was granted the tile state, and D is a
 * multiple of 32. Same numbers as the vdpbf16ps products (bf16 inputs, exact products, f32
 * sums in another order): the item, its softmax and its roundings are attention_bf16.h's.
 *
 * Q K^T: the scores of 16 keys (rows) by 16 query lanes (columns) are one C tile, summed over
 * D in steps of 32: A is 16 key rows read straight from the cache (rows of one block are
 * Hk * D apart; otherwise, or past the tile's keys, they are copied into 16 rows first), B is
 * 16 rows of Q2 (the item's bf16 query pairs, queries in the lanes), so C lands in St's layout.
 * P V: O[16 queries][16 d] tiles summed over steps of 32 keys: A is the probabilities of 16
 * queries (P2 transposed: a row per query), B 16 rows of V2 (pairs of value rows, d in the
 * lanes). Key pairs of a 32-key step outside the tile's visible keys are zero in P2 and V2.
 */
#ifndef NR_ATTENTION_AMX_H
#define NR_ATTENTION_AMX_H

#include "amx_tiles.h"

#define NR_TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#define NR_AMX_FENCE() __asm__ volatile("" ::: "memory")

/* 1: AMX-BF16 products (AMX-BF16 and AMX-TILE present, tile state granted); tests switch it */
static int nr_amx = 0;

static int nr_amx_init(void) {
    if (!nr_amx_has(NR_AMX_BF16 | NR_AMX_TILE)) return 0;
    if (nr_tile_level() < 2) return 0;
    return nr_amx_grant();
}

/* dst[16][16] (rows ld apart) = the transpose of src[16][16] (rows ls apart), 32-bit items. */
static inline NR_TBF16 void nr_tr16_u32(const uint32_t *src, int64_t ls, uint32_t *dst, int64_t ld) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(src + i * ls));
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {  /* r[4 g + c], 128-bit lane L: rows 4 g..4 g + 3, column 4 L + c */
        r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        _mm512_storeu_si512((void *)(dst + c * ld), _mm512_shuffle_i32x4(x0, y0, 0x88));
        _mm512_storeu_si512((void *)(dst + (4 + c) * ld), _mm512_shuffle_i32x4(x0, y0, 0xDD));
        _mm512_storeu_si512((void *)(dst + (8 + c) * ld), _mm512_shuffle_i32x4(x1, y1, 0x88));
        _mm512_storeu_si512((void *)(dst + (12 + c) * ld), _mm512_shuffle_i32x4(x1, y1, 0xDD));
    }
}

/* St rows of the 16-key groups that meet [klo, khi) (nk keys in the tile, row pointers krow,
 * kst elements apart within a cache block) for query lanes [0, nqp). gbuf: 16 x D bf16. */
static NR_TAMX void nr_qk_amx(const uint16_t *const *krow, int64_t klo, int64_t khi, int64_t nk,
                              int64_t D, int64_t kst, const uint32_t *Q2, int64_t nqp, float *St,
                              uint16_t *gbuf) {
    for (int64_t j = klo & ~(int64_t)15; j < khi; j += 16) {
        const uint16_t *A = krow[j];
        int64_t lda = kst * 2;
        int direct = j + 16 <= nk;
        for (int i = 1; direct && i < 16; i++) direct = krow[j + i] == krow[j] + i * kst;
        if (!direct) {
            for (int i = 0; i < 16; i++) {
                if (j + i < nk) memcpy(gbuf + i * D, krow[j + i], (size_t)D * 2);
                else memset(gbuf + i * D, 0, (size_t)D * 2);
            }
            NR_AMX_FENCE();
            A = gbuf;
            lda = D * 2;
        }
        for (int64_t c = 0; c < nqp; c += 32) {
            const int two = c + 16 < nqp;
            _tile_zero(0);
            if (two) _tile_zero(1);
            for (int64_t p = 0; p < D / 2; p += 16) {
                _tile_loadd(4, A + 2 * p, lda);
                _tile_loadd(6, Q2 + p * nqp + c, nqp * 4);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(7, Q2 + p * nqp + c + 16, nqp * 4);
                    _tile_dpbf16ps(1, 4, 7);
                }
            }
            _tile_stored(0, St + j * nqp + c, nqp * 4);
            if (two) _tile_stored(1, St + j * nqp + c + 16, nqp * 4);
        }
    }
    NR_AMX_FENCE();
}

/* O[nqp][Dp] += P V over key pairs [jp0, jp1) of the tile: P2 [NR_KT / 2][nqp] and V2
 * [NR_KT / 2][Dp] hold them (and, zeroed here, the other pairs of their 16-pair steps); Pr:
 * 16 x NR_KT / 2 u32 scratch. */
static NR_TAMX void nr_pv_amx(uint32_t *P2, int64_t nqp, uint32_t *V2, int64_t Dp, float *O,
                              int64_t jp0, int64_t jp1, uint32_t *Pr) {
    const int64_t s0 = jp0 & ~(int64_t)15, s1 = (jp1 + 15) & ~(int64_t)15;
    for (int64_t jp = s0; jp < s1; jp++)
        if (jp < jp0 || jp >= jp1) {
            memset(P2 + jp * nqp, 0, (size_t)nqp * 4);
            memset(V2 + jp * Dp, 0, (size_t)Dp * 4);
        }
    for (int64_t c = 0; c < nqp; c += 16) {
        for (int64_t s = s0; s < s1; s += 16) nr_tr16_u32(P2 + s * nqp + c, nqp, Pr + s, NR_KT / 2);
        NR_AMX_FENCE();
        for (int64_t d0 = 0; d0 < Dp; d0 += 64) {
            const int nd = Dp - d0 >= 64 ? 4 : (int)((Dp - d0) / 16);
            float *o = O + c * Dp + d0;
            /* tiles are named by constants: C 0..3, A 4, B 6 / 7 */
            _tile_loadd(0, o, Dp * 4);
            if (nd > 1) _tile_loadd(1, o + 16, Dp * 4);
            if (nd > 2) _tile_loadd(2, o + 32, Dp * 4);
            if (nd > 3) _tile_loadd(3, o + 48, Dp * 4);
            for (int64_t s = s0; s < s1; s += 16) {
                const uint32_t *v = V2 + s * Dp + d0;
                _tile_loadd(4, Pr + s, NR_KT / 2 * 4);
                _tile_loadd(6, v, Dp * 4);
                _tile_dpbf16ps(0, 4, 6);
                if (nd > 1) {
                    _tile_loadd(7, v + 16, Dp * 4);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (nd > 2) {
                    _tile_loadd(6, v + 32, Dp * 4);
                    _tile_dpbf16ps(2, 4, 6);
                }
                if (nd > 3) {
                    _tile_loadd(7, v + 48, Dp * 4);
                    _tile_dpbf16ps(3, 4, 7);
                }
            }
            _tile_stored(0, o, Dp * 4);
            if (nd > 1) _tile_stored(1, o + 16, Dp * 4);
            if (nd > 2) _tile_stored(2, o + 32, Dp * 4);
            if (nd > 3) _tile_stored(3, o + 48, Dp * 4);
        }
        NR_AMX_FENCE();
    }
}

#endif
