/* The routed experts of a mixture-of-experts block for the rows of a decode step, in one OpenMP
 * region (qgemm.pyx: MoEExperts; models/moe.py decides the routing).
 *
 * Op by op, each expert a step's rows chose is three calls (gate_up GEMV, silu, down GEMV), each
 * a Python call and most an OpenMP team: for Qwen3-30B-A3B's 8 experts a token, 24 calls a layer
 * at batch 1 and up to 3 x 128 in a batch, where a dense layer's MLP makes 3. Here the step's
 * (row, expert) pairs, grouped by expert (G groups, each expert streamed once for its rows), run as
 *
 *   each row -> int8 (gate_up's groups), copied to its pairs | gate_up GEMVs of every group, their
 *   column blocks shared out over the threads as one list (a group's rows QG_MR_Q8 at a time) |
 *   silu(gate) * up -> int8 (down's groups), pairs over threads | down GEMVs, as one list |
 *   out[r] = sum of coef[p] y[p] over row r's pairs in expert order (models/moe.py's sum)
 *
 * with a barrier between phases. The kernels are the int8-activation decode GEMV's (qgemm_q8.h:
 * the same row rounding, the same block kernel), each column block whole (no k slices: the list
 * of every group's blocks shares out evenly). Every expert of the block has one gate_up format
 * and one down format (the caller checks), so the int8 rows have one layout each.
 */
#ifndef QG_MOE_H
#define QG_MOE_H

#include "ops_kernels.h"
#include "qgemm_kernels.h"

typedef struct {
    long M, P, G, k;            /* rows; (row, expert) pairs; expert groups; pairs a row */
    long H, NI;                 /* hidden size; this rank's columns of an expert (gate_up: 2 NI) */
    const float* x;             /* [M, H] the block's input rows */
    const uint8_t* const* wg;   /* [G] packed gate_up weights of group g's expert */
    const uint8_t* const* wd;   /* [G] packed down weights */
    qg_format fg, fd;           /* their formats (fg.kp == H, fd.kp == NI) */
    const int64_t* gstart;      /* [G + 1] group g's pairs: gstart[g] .. gstart[g + 1] - 1 */
    const int64_t* prow;        /* [P] the row of pair p */
    const int64_t* rpairs;      /* [M, k] row r's pairs in expert order */
    const float* coef;          /* [P] each pair's routing weight */
    float* out;                 /* [M, H] */
    int level;                  /* qg_cpu_level */
    /* scratch: gu [P, 2 NI], act [P, NI], y [P, H]; int8 rows (qg_xq's layout: xq [., kp], sx,
     * xi [., nb], xs [., ng]) of the M input rows (_m), of the pairs for gate_up (_g, copies of
     * their rows') and for down (_d) */
    float *gu, *act, *y;
    int8_t *xq_m, *xq_g, *xq_d;
    float *sx_m, *xs_m, *sx_g, *xs_g, *sx_d, *xs_d;
    int32_t *xi_m, *xi_g, *xi_d;
} qg_moe_step;

static inline qg_xq qg_moe_row(const qg_format* f, int8_t* xq, float* sx, int32_t* xi, float* xs, long r) {
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f);
    const qg_xq q = {xq + r * f->kp, sx + r * nb, xi + r * nb, xs + r * ng, f->kp, nb, ng};
    return q;
}

/* Thread tid of nt: its contiguous share of the G * nblocks column blocks of out[p, :n] =
 * q(p) @ W_g^T for each group g's pairs p (their int8 rows consecutive in q's buffers). */
static void qg_moe_gemvs(const qg_format* f, const uint8_t* const* w, int8_t* xq, float* sx, int32_t* xi,
                         float* xs, const int64_t* gstart, long G, float* out, long ldo, qg_q8_fn fn,
                         int tid, int nt) {
    const long nblocks = (f->n + QG_NB - 1) / QG_NB, bb = qg_block_bytes(f), ng = f->kp / f->group;
    float acc[QG_MR_Q8 * QG_NB] __attribute__((aligned(64)));
    long t0, t1;
    nr_share(G * nblocks, tid, nt, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        const long g = t / nblocks, b = t % nblocks;
        for (long p0 = gstart[g]; p0 < gstart[g + 1]; p0 += QG_MR_Q8) {
            const int m = (int)(gstart[g + 1] - p0 < QG_MR_Q8 ? gstart[g + 1] - p0 : QG_MR_Q8);
            const qg_xq q = qg_moe_row(f, xq, sx, xi, xs, p0);
            fn(w[g] + b * bb, f, &q, 0, ng, m, acc);
            qg_store(acc, m, b * QG_NB, f->n, ldo, NULL, out + p0 * ldo);
        }
    }
}

static void qg_moe_run(const qg_moe_step* s) {
    const long M = s->M, P = s->P, G = s->G, H = s->H, NI = s->NI, k = s->k;
    const qg_q8_fn fn = qg_q8_kernel(s->level);
    const qg_format* fg = &s->fg;
    const long ngg = fg->kp / fg->group, nbg = ngg * qg_blocks_per_group(fg);
    #pragma omp parallel
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        for (long r = tid; r < M; r += nt) {
            const qg_xq q = qg_moe_row(fg, s->xq_m, s->sx_m, s->xi_m, s->xs_m, r);
            qg_quantize_row(s->x + r * H, fg, (int8_t*)q.xq, (float*)q.sx, (int32_t*)q.xi, (float*)q.xs, NULL);
        }
        #pragma omp barrier
        for (long p = tid; p < P; p += nt) {
            const long r = s->prow[p];
            memcpy(s->xq_g + p * fg->kp, s->xq_m + r * fg->kp, (size_t)fg->kp);
            memcpy(s->sx_g + p * nbg, s->sx_m + r * nbg, sizeof(float) * (size_t)nbg);
            memcpy(s->xi_g + p * nbg, s->xi_m + r * nbg, sizeof(int32_t) * (size_t)nbg);
            memcpy(s->xs_g + p * ngg, s->xs_m + r * ngg, sizeof(float) * (size_t)ngg);
        }
        #pragma omp barrier
        qg_moe_gemvs(fg, s->wg, s->xq_g, s->sx_g, s->xi_g, s->xs_g, s->gstart, G, s->gu, 2 * NI, fn, tid, nt);
        #pragma omp barrier
        for (long p = tid; p < P; p += nt) {
            nr_silu_row(s->gu + p * 2 * NI, s->gu + p * 2 * NI + NI, NI, s->act + p * NI);
            const qg_xq q = qg_moe_row(&s->fd, s->xq_d, s->sx_d, s->xi_d, s->xs_d, p);
            qg_quantize_row(s->act + p * NI, &s->fd, (int8_t*)q.xq, (float*)q.sx, (int32_t*)q.xi, (float*)q.xs, NULL);
        }
        #pragma omp barrier
        qg_moe_gemvs(&s->fd, s->wd, s->xq_d, s->sx_d, s->xi_d, s->xs_d, s->gstart, G, s->y, H, fn, tid, nt);
        #pragma omp barrier
        long i0, i1;
        nr_share(M * H, tid, nt, &i0, &i1);
        for (long i = i0; i < i1; i++) {
            const long r = i / H, j = i % H;
            float v = 0.0f;
            for (long e = 0; e < k; e++) {
                const long p = s->rpairs[r * k + e];
                const float t = s->coef[p] * s->y[p * H + j];
                v += t;
            }
            s->out[i] = v;
        }
    }
}

#endif
