/* Paged KV cache write and causal paged attention (flash-style online softmax in f32).
 *
 * Caches are C-contiguous [num_blocks, block_size, Hk, row] of one element type (kv_rows.h):
 * f32 or bf16 bits with row = D, or int8 with row = D + 4 (the values, then their f32 scale).
 * int8 rows are quantized when written and dequantized into f32 when read, like bf16 rows.
 * q/k/v/out are [T, H, D] with any token and head stride but a contiguous last axis.
 *
 * Work split: one item = (sequence, kv head, chunk of query rows, range of keys); an item
 * handles all `group` query heads sharing that kv head, so each K/V row is read once per item
 * and used by every query of the item. Items run under OpenMP dynamic scheduling, largest
 * first. When there are fewer items than ~2 per thread (decode of one sequence with one or two
 * kv heads), long key ranges are cut into splits of >= NR_SPLIT_MIN keys (flash-decoding):
 * each split writes its unnormalized partial (acc, running max m, sum l) and a combine pass
 * merges the splits of each item with the usual rescaling.
 *
 * Sliding window: window W > 0 lets the query at position P see keys P - W + 1 .. P (W keys,
 * itself included); 0 means no window.
 */
#ifndef NR_ATTENTION_KERNELS_H
#define NR_ATTENTION_KERNELS_H

#include <stdlib.h>
#include <omp.h>
#include "kv_rows.h"
#include "ops_math.h"
#include "tile_kernels.h"

#define NR_KT 64      /* keys per tile */
#define NR_NQ 32      /* target query vectors (rows x group heads) per item */
#define NR_SPLIT_MIN 128  /* fewest keys per split of one item's key range */

/* One slot of one kv head: the K and V rows ks, vs (D values) into the caches at element
 * offset `off`, converted to the cache's type. */
static inline void nr_cache_write(const float *ks, const float *vs, void *kc, void *vc,
                                  int kv_type, int64_t off, int64_t D) {
    if (kv_type == NR_KV_INT8) {
        nr_quantize_row(ks, D, (int8_t *)kc + off);
        nr_quantize_row(vs, D, (int8_t *)vc + off);
    } else if (kv_type == NR_KV_BF16) {
        uint16_t *kd = (uint16_t *)kc + off, *vd = (uint16_t *)vc + off;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            kd[d] = nr_f32_to_bf16(ks[d]);
            vd[d] = nr_f32_to_bf16(vs[d]);
        }
    } else {
        memcpy((float *)kc + off, ks, (size_t)D * sizeof(float));
        memcpy((float *)vc + off, vs, (size_t)D * sizeof(float));
    }
}

static int64_t nr_reshape_and_cache(const float *k, int64_t k_st, int64_t k_sh,
                                    const float *v, int64_t v_st, int64_t v_sh,
                                    void *kc, void *vc, int kv_type, int64_t T, int64_t Hk,
                                    int64_t D, const int64_t *slots, int64_t n_slots) {
    int64_t row = nr_kv_row(kv_type, D);
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= n_slots) return t;  /* caller raises */
    /* threads from 8192 values a cache: Qwen2.5-0.5B's 512-token prefill (2 kv heads of 64) has
     * 65536, which on one thread took 0.23 ms a layer on SPR-16 (0.01 ms on its 16 threads) */
    #pragma omp parallel for schedule(static) if (T * Hk * D >= 8192)
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int64_t h = 0; h < Hk; h++)
            nr_cache_write(k + t * k_st + h * k_sh, v + t * v_st + h * v_sh, kc, vc, kv_type,
                           (slot * Hk + h) * row, D);
    }
    return -1;
}

typedef struct {
    const float *q; int64_t q_st, q_sh;
    const void *kc, *vc; int kv_type;  /* nr_kv_type */
    int64_t nb, bs, Hq, Hk, D;
    const int32_t *bt; int64_t bt_st, max_blocks;
    const int32_t *qstart, *ctx; int64_t S;
    float scale;
    int64_t window;  /* sliding window in keys, 0 = none */
    int level;       /* tile_kernels.h level: 2 AVX-512 BF16, 1 AVX-512, 0 AVX2 */
    int64_t tiled_min;  /* items of >= this many query vectors use the tiled path */
    int64_t prompt_s0;  /* sequences s >= prompt_s0 hold prompt rows: the tiled path however few
                         * their item's query vectors (S: none) */
    float *out; int64_t o_st, o_sh;
} nr_attn_args;

/* Row pointers of keys/values j0..j0+nk of kv head hk of sequence s (bf16 and int8 rows are
 * converted into buf). */
static inline void nr_gather(const nr_attn_args *a, const void *cache, int64_t s, int64_t hk,
                             int64_t j0, int64_t nk, float *buf, const float **rows) {
    const int32_t *bt = a->bt + s * a->bt_st;
    int64_t D = a->D, row = nr_kv_row(a->kv_type, D);
    for (int64_t j = 0; j < nk; j++) {
        int64_t p = j0 + j;
        int64_t off = (((int64_t)bt[p / a->bs] * a->bs + p % a->bs) * a->Hk + hk) * row;
        if (a->kv_type == NR_KV_INT8) {
            nr_dequantize_row((const int8_t *)cache + off, D, buf + j * D);
            rows[j] = buf + j * D;
        } else if (a->kv_type == NR_KV_BF16) {
            const uint16_t *src = (const uint16_t *)cache + off;
            float *dst = buf + j * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] = nr_bf16_to_f32(src[d]);
            rows[j] = dst;
        } else {
            rows[j] = (const float *)cache + off;
        }
    }
}

/* sc[j] = dot(qv, k[j]) for j < n, four keys per pass for independent FMA chains. */
static inline void nr_scores(const float *qv, const float **k, int64_t n, int64_t D, float *sc) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = k[j], *k1 = k[j + 1], *k2 = k[j + 2], *k3 = k[j + 3];
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        #pragma omp simd reduction(+:s0, s1, s2, s3)
        for (int64_t d = 0; d < D; d++) {
            float x = qv[d];
            s0 += x * k0[d]; s1 += x * k1[d]; s2 += x * k2[d]; s3 += x * k3[d];
        }
        sc[j] = s0; sc[j + 1] = s1; sc[j + 2] = s2; sc[j + 3] = s3;
    }
    for (; j < n; j++) {
        const float *k0 = k[j];
        float s0 = 0.f;
        #pragma omp simd reduction(+:s0)
        for (int64_t d = 0; d < D; d++) s0 += qv[d] * k0[d];
        sc[j] = s0;
    }
}

/* acc += sum_j p[j] * v[j] for j < n. */
static inline void nr_accumulate(float *acc, const float *p, const float **v, int64_t n,
                                 int64_t D) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *v0 = v[j], *v1 = v[j + 1], *v2 = v[j + 2], *v3 = v[j + 3];
        float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
        #pragma omp simd
        for (int64_t d = 0; d < D; d++)
            acc[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
    }
    for (; j < n; j++) {
        const float *v0 = v[j];
        float p0 = p[j];
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) acc[d] += p0 * v0[d];
    }
}

static inline int64_t nr_item_rows(int64_t group) { return group >= NR_NQ ? 1 : NR_NQ / group; }

static inline size_t nr_ws_floats(int64_t nq, int64_t D) {
    return (size_t)(2 * nq * D + 2 * nq + nq * NR_KT + 2 * NR_KT * D + 64);
}

/* First key visible to the query at position pos (sliding window or 0). */
static inline int64_t nr_first_key(const nr_attn_args *a, int64_t pos) {
    return a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
}

/* Keys [*lo, *n) of the tile j0..j0+nk are visible to the query at position pos. */
static inline void nr_visible(const nr_attn_args *a, int64_t pos, int64_t j0, int64_t nk,
                              int64_t *lo, int64_t *n) {
    int64_t l0 = nr_first_key(a, pos) - j0, n0 = pos + 1 - j0;
    *lo = l0 < 0 ? 0 : l0;
    *n = n0 > nk ? nk : n0;
}

/* Online softmax over scores p[lo:n] of one query: p becomes exp(p - max), the running max m
 * and sum l are updated, and acc[0:len] is rescaled to the new max. */
static inline void nr_online_softmax(float *p, int64_t lo, int64_t n, float *m, float *l,
                                     float *acc, int64_t len) {
    float mx = *m;
    #pragma omp simd reduction(max:mx)
    for (int64_t j = lo; j < n; j++) mx = p[j] > mx ? p[j] : mx;
    float corr = nr_expf(*m - mx), sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t j = lo; j < n; j++) { p[j] = nr_expf(p[j] - mx); sum += p[j]; }
    *l = *l * corr + sum;
    *m = mx;
    if (corr != 1.0f) {
        #pragma omp simd
        for (int64_t d = 0; d < len; d++) acc[d] *= corr;
    }
}

/* Query rows [i0, i1) of sequence s, kv head hk, all its query heads, over keys [ja, jb)
 * (clipped to each row's causal and window limits). part == NULL: write the normalized
 * result to out; else write the partial [acc: nq x D][m: nq][l: nq] to part. */
/* An item's result: with `part`, its unnormalized rows O (row stride ldo), running max m and
 * sum l into part ([nq][D], [nq], [nq]) for the combine pass; else O / l into a->out. */
static inline void nr_item_store(const nr_attn_args *a, int64_t s, int64_t hk, int64_t i0,
                                 int64_t nq, const float *O, int64_t ldo, const float *m,
                                 const float *l, float *part) {
    int64_t D = a->D, group = a->Hq / a->Hk, q0 = a->qstart[s];
    if (part != NULL) {
        float *pm = part + nq * D, *pl = pm + nq;
        for (int64_t qi = 0; qi < nq; qi++) {
            memcpy(part + qi * D, O + qi * ldo, (size_t)D * sizeof(float));
            pm[qi] = m[qi];
            pl[qi] = l[qi];
        }
        return;
    }
    for (int64_t qi = 0; qi < nq; qi++) {
        int64_t i = i0 + qi / group, h = hk * group + qi % group;
        float *dst = a->out + (q0 + i) * a->o_st + h * a->o_sh;
        const float *o = O + qi * ldo;
        float inv = 1.0f / l[qi];
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
    }
}

static void nr_attn_item(const nr_attn_args *a, int64_t s, int64_t hk, int64_t i0, int64_t i1,
                         int64_t ja, int64_t jb, float *ws, float *part) {
    int64_t D = a->D, group = a->Hq / a->Hk;
    int64_t q0 = a->qstart[s], n_new = a->qstart[s + 1] - q0;
    int64_t base = (int64_t)a->ctx[s] - n_new;  /* position of query row 0 */
    int64_t nq = (i1 - i0) * group;
    float *Q = ws, *acc = Q + nq * D, *m = acc + nq * D, *l = m + nq, *sc = l + nq;
    float *kb = sc + nq * NR_KT, *vb = kb + NR_KT * D;
    const float *krows[NR_KT], *vrows[NR_KT];
    if (part != NULL) { acc = part; m = part + nq * D; l = m + nq; }

    for (int64_t qi = 0; qi < nq; qi++) {
        int64_t i = i0 + qi / group, h = hk * group + qi % group;
        const float *src = a->q + (q0 + i) * a->q_st + h * a->q_sh;
        float *dst = Q + qi * D, *ac = acc + qi * D;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) { dst[d] = src[d] * a->scale; ac[d] = 0.f; }
        m[qi] = -INFINITY;
        l[qi] = 0.f;
    }
    for (int64_t j0 = ja; j0 < jb; j0 += NR_KT) {
        int64_t nk = jb - j0 < NR_KT ? jb - j0 : NR_KT;
        nr_gather(a, a->kc, s, hk, j0, nk, kb, krows);
        for (int64_t qi = 0; qi < nq; qi++) {
            int64_t lo, n;
            nr_visible(a, base + i0 + qi / group, j0, nk, &lo, &n);
            if (n <= lo) continue;
            float *p = sc + qi * NR_KT;
            nr_scores(Q + qi * D, krows + lo, n - lo, D, p + lo);
            nr_online_softmax(p, lo, n, &m[qi], &l[qi], acc + qi * D, D);
        }
        nr_gather(a, a->vc, s, hk, j0, nk, vb, vrows);
        for (int64_t qi = 0; qi < nq; qi++) {
            int64_t lo, n;
            nr_visible(a, base + i0 + qi / group, j0, nk, &lo, &n);
            if (n <= lo) continue;
            nr_accumulate(acc + qi * D, sc + qi * NR_KT + lo, vrows + lo, n - lo, D);
        }
    }
    if (part == NULL)  /* NOTE: with part, acc, m and l already are the partial result */
        nr_item_store(a, s, hk, i0, nq, acc, D, m, l, NULL);
}

static inline int64_t nr_pad16(int64_t d) { return (d + 15) / 16 * 16; }

static inline size_t nr_ws_tiled_floats(int64_t nq, int64_t D) {
    int64_t Dp = nr_pad16(D);
    return (size_t)(nq * D + nq * Dp + 2 * nq + nq * NR_KT + D * NR_KT + NR_KT * Dp + 64);
}

/* Keys j0..j0+nk of kv head hk of sequence s, transposed into Kt [D][NR_KT] (keys >= nk zero),
 * and values into Vb [NR_KT][Dp] (zero padded). */
static void nr_gather_tiles(const nr_attn_args *a, int64_t s, int64_t hk, int64_t j0, int64_t nk,
                            float *Kt, float *Vb, int64_t Dp) {
    const int32_t *bt = a->bt + s * a->bt_st;
    int64_t D = a->D, row = nr_kv_row(a->kv_type, D);
    for (int64_t j = 0; j < NR_KT; j++) {
        float *vd = Vb + j * Dp;
        if (j >= nk) {
            for (int64_t d = 0; d < D; d++) Kt[d * NR_KT + j] = 0.f;
            for (int64_t d = 0; d < Dp; d++) vd[d] = 0.f;
            continue;
        }
        int64_t p = j0 + j;
        int64_t off = (((int64_t)bt[p / a->bs] * a->bs + p % a->bs) * a->Hk + hk) * row;
        if (a->kv_type == NR_KV_INT8) {
            const int8_t *ks = (const int8_t *)a->kc + off;
            float sk = nr_row_scale(ks, D);
            for (int64_t d = 0; d < D; d++) Kt[d * NR_KT + j] = (float)ks[d] * sk;
            nr_dequantize_row((const int8_t *)a->vc + off, D, vd);
        } else if (a->kv_type == NR_KV_BF16) {
            const uint16_t *ks = (const uint16_t *)a->kc + off, *vs = (const uint16_t *)a->vc + off;
            for (int64_t d = 0; d < D; d++) Kt[d * NR_KT + j] = nr_bf16_to_f32(ks[d]);
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) vd[d] = nr_bf16_to_f32(vs[d]);
        } else {
            const float *ks = (const float *)a->kc + off, *vs = (const float *)a->vc + off;
            for (int64_t d = 0; d < D; d++) Kt[d * NR_KT + j] = ks[d];
            memcpy(vd, vs, (size_t)D * sizeof(float));
        }
        for (int64_t d = D; d < Dp; d++) vd[d] = 0.f;
    }
}

/* nr_attn_item with the two products of each key tile as register-tiled matrix products:
 * S[nq][64] = Q[nq][D] Kt[D][64], then O[nq][Dp] += P[nq][64] Vb[64][Dp]. Same contract. */
static void nr_attn_item_tiled(const nr_attn_args *a, int64_t s, int64_t hk, int64_t i0,
                               int64_t i1, int64_t ja, int64_t jb, float *ws, float *part) {
    int64_t D = a->D, Dp = nr_pad16(D), group = a->Hq / a->Hk;
    int64_t q0 = a->qstart[s], n_new = a->qstart[s + 1] - q0;
    int64_t base = (int64_t)a->ctx[s] - n_new;  /* position of query row 0 */
    int64_t nq = (i1 - i0) * group;
    float *Q = ws, *O = Q + nq * D, *m = O + nq * Dp, *l = m + nq, *S = l + nq;
    float *Kt = S + nq * NR_KT, *Vb = Kt + D * NR_KT;

    for (int64_t qi = 0; qi < nq; qi++) {
        int64_t i = i0 + qi / group, h = hk * group + qi % group;
        const float *src = a->q + (q0 + i) * a->q_st + h * a->q_sh;
        float *dst = Q + qi * D, *o = O + qi * Dp;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] = src[d] * a->scale;
        for (int64_t d = 0; d < Dp; d++) o[d] = 0.f;
        m[qi] = -INFINITY;
        l[qi] = 0.f;
    }
    for (int64_t j0 = ja; j0 < jb; j0 += NR_KT) {
        int64_t nk = jb - j0 < NR_KT ? jb - j0 : NR_KT;
        nr_gather_tiles(a, s, hk, j0, nk, Kt, Vb, Dp);
        nr_mm(a->level, Q, D, Kt, NR_KT, S, NR_KT, nq, NR_KT, D, 1);
        for (int64_t qi = 0; qi < nq; qi++) {
            int64_t lo, n;
            nr_visible(a, base + i0 + qi / group, j0, nk, &lo, &n);
            float *p = S + qi * NR_KT;
            if (n <= lo) {  /* nothing visible: P row of zeros, m and l unchanged */
                for (int64_t j = 0; j < NR_KT; j++) p[j] = 0.f;
                continue;
            }
            nr_online_softmax(p, lo, n, &m[qi], &l[qi], O + qi * Dp, Dp);
            for (int64_t j = 0; j < lo; j++) p[j] = 0.f;  /* P V reads the whole tile row */
            for (int64_t j = n; j < NR_KT; j++) p[j] = 0.f;
        }
        nr_mm(a->level, S, NR_KT, Vb, Dp, O, Dp, nq, Dp, nk, 0);
    }
    nr_item_store(a, s, hk, i0, nq, O, Dp, m, l, part);
}

#include "attention_bf16.h"

/* Merge nsplit partials (each [acc: nq x D][m: nq][l: nq], psz floats apart) of rows
 * [i0, i1) of sequence s, kv head hk into out. */
static void nr_attn_combine(const nr_attn_args *a, int64_t s, int64_t hk, int64_t i0,
                            int64_t i1, const float *parts, int64_t nsplit, int64_t psz) {
    int64_t D = a->D, group = a->Hq / a->Hk, nq = (i1 - i0) * group, q0 = a->qstart[s];
    for (int64_t qi = 0; qi < nq; qi++) {
        int64_t i = i0 + qi / group, h = hk * group + qi % group;
        float *dst = a->out + (q0 + i) * a->o_st + h * a->o_sh;
        float mx = -INFINITY, l = 0.f;
        for (int64_t t = 0; t < nsplit; t++) {
            float mt = parts[t * psz + nq * D + qi];
            mx = mt > mx ? mt : mx;
        }
        for (int64_t d = 0; d < D; d++) dst[d] = 0.f;
        for (int64_t t = 0; t < nsplit; t++) {
            const float *pt = parts + t * psz;
            float mt = pt[nq * D + qi];
            if (mt == -INFINITY) continue;  /* no key of this split is visible to the row */
            float w = nr_expf(mt - mx);
            l += w * pt[nq * D + nq + qi];
            const float *ac = pt + qi * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] += w * ac[d];
        }
        float inv = 1.0f / l;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] *= inv;
    }
}

/* Returns -1 on success, else the index of the first inconsistent sequence. */
static int64_t nr_attn_check(const nr_attn_args *a, int64_t T) {
    for (int64_t s = 0; s < a->S; s++) {
        int64_t q0 = a->qstart[s], q1 = a->qstart[s + 1], ctx = a->ctx[s];
        if (q0 < 0 || q1 < q0 || q1 > T || q1 - q0 > ctx) return s;
        if (q1 == q0) continue;
        int64_t nblk = (ctx + a->bs - 1) / a->bs;
        if (nblk > a->max_blocks) return s;
        for (int64_t b = 0; b < nblk; b++) {
            int32_t id = a->bt[s * a->bt_st + b];
            if (id < 0 || id >= a->nb) return s;
        }
    }
    return -1;
}

/* One work item: rows [i0, i0 + rows) of (s, h) over keys [ja, jb), split t of nsplit; slot:
 * the index of its partial when split (its nsplit partials are consecutive), else -1. */
typedef struct { int64_t s, h, i0, ja, jb, slot, t, nsplit; } nr_item;

/* The work of one attention call for nt threads: its items, the partials of split items and
 * each thread's scratch size (nr_attn_plan fills it, nr_attn_plan_free frees it). */
typedef struct {
    nr_item *items; int64_t n_items, n_slots, rows, group, psz;
    float *parts; size_t ws_n;
} nr_attn_plan_t;

static void nr_attn_plan_free(nr_attn_plan_t *p) {
    free(p->parts);
    free(p->items);
    p->items = NULL;
    p->parts = NULL;
}

/* 0 (p->n_items may be 0: nothing to do), or -1 when out of memory (p holds nothing). */
static int nr_attn_plan(const nr_attn_args *a, int64_t nt, nr_attn_plan_t *p) {
    int64_t group = a->Hq / a->Hk, rows = nr_item_rows(group), n_base = 0;
    memset(p, 0, sizeof *p);
    p->rows = rows;
    p->group = group;
    for (int64_t s = 0; s < a->S; s++) {
        int64_t n_new = a->qstart[s + 1] - a->qstart[s];
        n_base += a->Hk * ((n_new + rows - 1) / rows);
    }
    if (n_base == 0) return 0;
    /* NOTE: split key ranges only when items are too few to keep every thread busy. */
    int64_t want = n_base >= 2 * nt ? 1 : (2 * nt + n_base - 1) / n_base;
    for (int pass = 0; pass < 2; pass++) {
        nr_item *items = pass ? (nr_item *)malloc((size_t)p->n_items * sizeof(nr_item)) : NULL;
        if (pass && items == NULL) return -1;
        int64_t k = 0, slot = 0;
        /* largest first: the last chunks of each sequence see the most keys */
        for (int64_t s = 0; s < a->S; s++) {
            int64_t n_new = a->qstart[s + 1] - a->qstart[s], base = a->ctx[s] - n_new;
            for (int64_t c = (n_new + rows - 1) / rows - 1; c >= 0; c--) {
                int64_t i1 = (c + 1) * rows < n_new ? (c + 1) * rows : n_new;
                int64_t ja = nr_first_key(a, base + c * rows), jb = base + i1;
                int64_t ns = (jb - ja) / NR_SPLIT_MIN;
                ns = ns < want ? ns : want;
                ns = ns < 1 ? 1 : ns;
                for (int64_t h = 0; h < a->Hk; h++)
                    for (int64_t t = 0; t < ns; t++) {
                        if (pass) {
                            nr_item it = {s, h, c * rows, ja + (jb - ja) * t / ns,
                                          ja + (jb - ja) * (t + 1) / ns,
                                          ns > 1 ? slot + h * ns + t : -1, t, ns};
                            items[k] = it;
                        }
                        k++;
                    }
                if (ns > 1) slot += ns * a->Hk;
            }
        }
        if (!pass) {
            p->n_items = k;
            p->n_slots = slot;
            continue;
        }
        p->items = items;
    }
    size_t ws_n = nr_ws_tiled_floats(rows * group, a->D), ws_d = nr_ws_floats(rows * group, a->D);
    ws_n = ws_n > ws_d ? ws_n : ws_d;
    ws_d = nr_ws_bf16_floats(rows * group, a->D);
    p->ws_n = ws_n > ws_d ? ws_n : ws_d;
    p->psz = rows * group * (a->D + 2);
    if (p->n_slots) {
        p->parts = (float *)malloc((size_t)(p->n_slots * p->psz) * sizeof(float));
        if (p->parts == NULL) {
            nr_attn_plan_free(p);
            return -1;
        }
    }
    return 0;
}

/* Item `it` of plan p (ws: a scratch of p->ws_n floats). */
static void nr_attn_run_item(const nr_attn_args *a, const nr_attn_plan_t *p, int64_t it, float *ws) {
    const nr_item *x = &p->items[it];
    int64_t n_new = a->qstart[x->s + 1] - a->qstart[x->s];
    int64_t i1 = x->i0 + p->rows < n_new ? x->i0 + p->rows : n_new;
    /* NOTE: the tiled path pays a key-tile transposition that only several query vectors
     * (prefill rows x group heads) amortize; decode takes the direct one. Prompt rows take the
     * tiled path however few they are in their item (a bf16 cache's bf16 path at level 2), so
     * that a prompt row's precision does not follow how the prompt was cut into chunks, nor how
     * much of it the prefix cache held. */
    int tiled = x->s >= a->prompt_s0 || (i1 - x->i0) * p->group >= a->tiled_min;
    (!tiled ? nr_attn_item : a->kv_type == NR_KV_BF16 && a->level >= 2 ? nr_attn_item_bf16
                                                         : nr_attn_item_tiled)(
        a, x->s, x->h, x->i0, i1, x->ja, x->jb, ws, x->slot >= 0 ? p->parts + x->slot * p->psz : NULL);
}

/* After every item of p: the first split of split item `it` merges its splits (others: none). */
static void nr_attn_combine_item(const nr_attn_args *a, const nr_attn_plan_t *p, int64_t it) {
    const nr_item *x = &p->items[it];
    if (x->nsplit < 2 || x->t != 0) return;
    int64_t n_new = a->qstart[x->s + 1] - a->qstart[x->s];
    int64_t i1 = x->i0 + p->rows < n_new ? x->i0 + p->rows : n_new;
    nr_attn_combine(a, x->s, x->h, x->i0, i1, p->parts + x->slot * p->psz, x->nsplit, p->psz);
}

/* The items of plan p on the threads of the enclosing parallel region (orphaned worksharing:
 * every thread of the team calls it; it ends with a barrier). *err is set to 1 (by any thread)
 * when a thread's scratch cannot be allocated; out is then not fully written. */
static void nr_attn_exec(const nr_attn_args *a, const nr_attn_plan_t *p, int *err) {
    float *ws = (float *)malloc(p->ws_n * sizeof(float));
    if (ws == NULL) {
        #pragma omp atomic write
        *err = 1;
    }
    #pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < p->n_items; it++)
        if (ws != NULL) nr_attn_run_item(a, p, it, ws);
    /* NOTE: *err is read after the loop's barrier, so every thread takes the same branch */
    if (p->n_slots && !*err) {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < p->n_items; it++) nr_attn_combine_item(a, p, it);
    }
    free(ws);
}

/* 0, or -1 when out of memory (out is then not fully written). */
static int nr_paged_attention(const nr_attn_args *a) {
    nr_attn_plan_t p;
    if (nr_attn_plan(a, omp_get_max_threads(), &p) != 0) return -1;
    int err = 0;
    if (p.n_items) {
        #pragma omp parallel if (p.n_items > 1)
        nr_attn_exec(a, &p, &err);
    }
    nr_attn_plan_free(&p);
    return err ? -1 : 0;
}

#endif
