/* Decode steps of a quantized Llama-family decoder in one OpenMP region (qgemm.pyx: FusedDecoder).
 *
 * A decode step runs a few rows (one token per sequence) through every layer. Op by op, each of a
 * layer's ~11 ops is a Python call and most start an OpenMP team; on 16 cores a team start and
 * its join cost several microseconds however little the op does, about as long as an int4
 * o_proj of Qwen2.5-0.5B takes to stream its weights. Here one region runs a range of half
 * layers (stages: 2 l = attention half of layer l, 2 l + 1 = its MLP half) with a barrier
 * between phases:
 *
 *   attention half: residual += delta (l > 0); h = rms_norm(residual); h -> int8 | qkv GEMV |
 *                   q/k norms, rotary, K/V into the cache | attention | attn -> int8 | o_proj
 *   MLP half:       residual += o; h = rms_norm(residual); h -> int8 | gate_up GEMV |
 *                   silu(gate) * up -> int8 (per group) | down_proj GEMV (into delta)
 *
 * Every phase calls the functions the op-by-op path calls (nr_add_rms_row, qg_quantize_row,
 * qg_q8_share with the same k slices, nr_rotary_token, nr_cache_write, nr_attn_plan/exec), so
 * both paths give the same values. A tensor-parallel model runs one stage per call and
 * all-reduces o and delta between calls (the caller); one rank runs all stages in one call.
 */
#ifndef NR_DECODE_LAYERS_H
#define NR_DECODE_LAYERS_H

#include "attention_kernels.h"
#include "ops_kernels.h"
#include "qgemm_kernels.h"

typedef struct {
    const uint8_t* w;     /* packed weights (qgemm_kernels.h) */
    qg_format f;          /* f.kp == in_features (the caller checks) */
    const float* bias;    /* [N] or NULL */
} nd_linear;

typedef struct {
    nd_linear qkv, o, gu, down;
    const float *in_norm, *post_norm;   /* [H] */
    const float *q_norm, *k_norm;       /* [D] or NULL (Qwen3) */
    void *kc, *vc;                      /* [nb, bs, Hk, row] of kv_type */
    int64_t window;                     /* sliding window in keys, 0 = none */
} nd_layer;

typedef struct {
    int64_t H, D, Hq, Hk, inter;        /* hidden; head dim; this rank's heads and MLP width */
    double eps;
    int kv_type;
    int64_t nb, bs;                     /* cache blocks and their size */
    float scale;
    const float* cos_sin;               /* [max_pos, rot] = [cos | sin] */
    int64_t rot;
    const nd_layer* layers;
} nd_model;

typedef struct {
    int64_t M;                          /* rows: one new token per sequence (M == S) */
    const int64_t *pos, *slots;         /* [M] */
    const int32_t *bt, *qstart, *ctx;   /* [S, bt_st], [S + 1], [S] */
    int64_t bt_st;
    /* activations: residual, h, o, delta [M, H]; qkv [M, (Hq + 2 Hk) D]; attn [M, Hq D];
     * gu [M, 2 inter] = [gate | up]; act [M, inter] */
    float *residual, *h, *qkv, *attn, *o, *gu, *act, *delta;
    /* int8 activations of the next GEMV: xq [M, kp], sx, xi [M, nb], xs [M, ng] (the layout of
     * qg_xq with each row at its own linear's sizes); part: k-slice partial sums */
    int8_t* xq;
    float *sx, *xs, *part;
    int32_t* xi;
    int qg_level, attn_level;
    int64_t tiled_min;
} nd_step;

typedef struct {
    int err;                            /* set before a barrier, read after it */
    nr_attn_plan_t plan;
} nd_shared;

/* Row r's int8 activations for linear format f, from x (kp values). */
static inline void nd_quant_row(const nd_step* st, const qg_format* f, const float* x, int64_t r) {
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f);
    qg_quantize_row(x, f, st->xq + r * f->kp, st->sx + r * nb, st->xi + r * nb, st->xs + r * ng,
                    NULL);
}

/* residual += x (x NULL: none); h = rms_norm(residual) * w; h -> int8 for f. Rows over threads. */
static void nd_norm_quant(const nd_model* m, const nd_step* st, const float* x, const float* w,
                          const qg_format* f, int tid, int nt) {
    const int64_t H = m->H;
    for (int64_t r = tid; r < st->M; r += nt) {
        float *res = st->residual + r * H, *h = st->h + r * H;
        if (x) nr_add_rms_row(x + r * H, res, w, m->eps, H, h);
        else nr_rms_row(res, w, m->eps, H, h);
        nd_quant_row(st, f, h, r);
    }
    #pragma omp barrier
}

/* out[M, N] = int8 activations @ W^T + bias, as qg_forward_q8 computes it; ends with a barrier. */
static void nd_gemv(const nd_step* st, const nd_linear* L, float* out, int tid, int nt) {
    const qg_format* f = &L->f;
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f), ns = qg_q8_slices(f, st->M, nt);
    const qg_xq q = {st->xq, st->sx, st->xi, st->xs, f->kp, nb, ng};
    qg_q8_share(L->w, f, &q, st->M, st->M, L->bias, out, st->part, ns, qg_q8_kernel(st->qg_level),
                0, tid, nt);
    #pragma omp barrier
    if (ns > 1) {
        qg_q8_sum_parts(st->part, ns, st->M, f->n, L->bias, out);
        #pragma omp barrier
    }
}

/* q/k norms and rotary on every head of qkv, K and V rows into the cache: (row, head) units. */
static void nd_rope_cache(const nd_model* m, const nd_step* st, const nd_layer* ly, int tid,
                          int nt) {
    const int64_t D = m->D, Hq = m->Hq, Hk = m->Hk, W = (Hq + 2 * Hk) * D;
    const int64_t row = nr_kv_row(m->kv_type, D), heads = Hq + Hk;
    long u0, u1;
    nr_share(st->M * heads, tid, nt, &u0, &u1);
    for (long u = u0; u < u1; u++) {
        const int64_t r = u / heads, h = u % heads;  /* h < Hq: query head; else kv head h - Hq */
        float* x = st->qkv + r * W + h * D;
        const float* norm = h < Hq ? ly->q_norm : ly->k_norm;
        if (norm) nr_rms_row(x, norm, m->eps, D, x);
        nr_rotary_token(x, 1, D, m->cos_sin + st->pos[r] * m->rot, m->rot);
        if (h >= Hq && st->slots[r] >= 0)
            nr_cache_write(x, x + Hk * D, ly->kc, ly->vc, m->kv_type,
                           (st->slots[r] * Hk + (h - Hq)) * row, D);
    }
    #pragma omp barrier
}

static void nd_attention(const nd_model* m, const nd_step* st, const nd_layer* ly, nd_shared* sh,
                         int nt) {
    const int64_t D = m->D, Hq = m->Hq, Hk = m->Hk;
    nr_attn_args a;
    a.q = st->qkv;
    a.q_st = (Hq + 2 * Hk) * D;
    a.q_sh = D;
    a.kc = ly->kc;
    a.vc = ly->vc;
    a.kv_type = m->kv_type;
    a.nb = m->nb;
    a.bs = m->bs;
    a.Hq = Hq;
    a.Hk = Hk;
    a.D = D;
    a.bt = st->bt;
    a.bt_st = a.max_blocks = st->bt_st;
    a.qstart = st->qstart;
    a.ctx = st->ctx;
    a.S = st->M;
    a.scale = m->scale;
    a.window = ly->window;
    a.level = st->attn_level;
    a.tiled_min = st->tiled_min;
    a.out = st->attn;
    a.o_st = Hq * D;
    a.o_sh = D;
    #pragma omp single
    {
        if (nr_attn_plan(&a, nt, &sh->plan) != 0) sh->err = 1;
    }
    if (sh->err) return;
    if (sh->plan.n_items) nr_attn_exec(&a, &sh->plan, &sh->err);
    /* NOTE: no barrier needed after the free: the next plan is a layer (several barriers) away */
    #pragma omp single nowait
    nr_attn_plan_free(&sh->plan);
}

static void nd_attention_half(const nd_model* m, const nd_step* st, const nd_layer* ly, int first,
                              nd_shared* sh, int tid, int nt) {
    nd_norm_quant(m, st, first ? NULL : st->delta, ly->in_norm, &ly->qkv.f, tid, nt);
    nd_gemv(st, &ly->qkv, st->qkv, tid, nt);
    nd_rope_cache(m, st, ly, tid, nt);
    nd_attention(m, st, ly, sh, nt);
    if (sh->err) return;
    const int64_t A = m->Hq * m->D;
    for (int64_t r = tid; r < st->M; r += nt) nd_quant_row(st, &ly->o.f, st->attn + r * A, r);
    #pragma omp barrier
    nd_gemv(st, &ly->o, st->o, tid, nt);
}

static void nd_mlp_half(const nd_model* m, const nd_step* st, const nd_layer* ly, int tid, int nt) {
    nd_norm_quant(m, st, st->o, ly->post_norm, &ly->gu.f, tid, nt);
    nd_gemv(st, &ly->gu, st->gu, tid, nt);
    /* silu(gate) * up and its int8 rounding, one (row, group of down_proj) at a time */
    const qg_format* f = &ly->down.f;
    const long G = f->group, ng = f->kp / G, nb = ng * qg_blocks_per_group(f);
    const int64_t In = m->inter;
    long u0, u1;
    nr_share(st->M * ng, tid, nt, &u0, &u1);
    for (long u = u0; u < u1; u++) {
        const int64_t r = u / ng, g = u % ng;
        const float* gate = st->gu + r * 2 * In;
        float* act = st->act + r * In;
        nr_silu_row(gate + g * G, gate + In + g * G, G, act + g * G);
        qg_quantize_group(act, f, g, st->xq + r * f->kp, st->sx + r * nb, st->xi + r * nb,
                          st->xs + r * ng, NULL);
    }
    #pragma omp barrier
    nd_gemv(st, &ly->down, st->delta, tid, nt);
}

/* Stages [s0, s1) (2 l: attention half of layer l, 2 l + 1: its MLP half) on the OpenMP threads.
 * The caller checked every index (positions, slots, block tables). 0, or -1 when out of memory
 * (the outputs are then not fully written). */
static int nd_run(const nd_model* m, const nd_step* st, int64_t s0, int64_t s1) {
    nd_shared sh;
    memset(&sh, 0, sizeof sh);
    #pragma omp parallel
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t s = s0; s < s1; s++) {
            const nd_layer* ly = &m->layers[s / 2];
            if (s % 2 == 0) nd_attention_half(m, st, ly, s == 0, &sh, tid, nt);
            else nd_mlp_half(m, st, ly, tid, nt);
            if (sh.err) break;  /* NOTE: written before a barrier, so every thread agrees */
        }
    }
    return sh.err ? -1 : 0;
}

#endif
