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
 *                   q/k norms, rotary, K/V into the cache (each attention item its own:
 *                   nd_item_rope) | attention | attn -> int8 | o_proj
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

#include <sched.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "attention_kernels.h"
#include "ops_kernels.h"
#include "qgemm_kernels.h"

#define ND_MAX_PARTS 4

/* A linear of one or more parts (loader.ConcatLinear: formats that differ, e.g. a GGUF's Q4_K
 * q/k and Q6_K v), each writing its columns of the output row; every part reads the same input
 * but takes its own int8 rounding of it (its group and bit layout). */
typedef struct {
    int nparts;
    const uint8_t* w[ND_MAX_PARTS];   /* packed weights (qgemm_kernels.h) */
    qg_format f[ND_MAX_PARTS];        /* f.kp == in_features (the caller checks) */
    long n;                           /* output columns of all parts */
    const float* bias;                /* [n] or NULL */
    int bias_after;                   /* added after the parts' sums (ConcatLinear), not in them */
} nd_linear;

typedef struct {
    nd_linear qkv, o, gu, down;
    const float *in_norm, *post_norm;   /* [H] */
    const float *q_norm, *k_norm;       /* [D] or NULL (Qwen3) */
    void *kc, *vc;                      /* [nb, bs, Hk, row] of kv_type */
    int64_t window;                     /* sliding window in keys, 0 = none */
} nd_layer;

/* The final norm and lm_head (a model on one rank): logits rows in the region that ran the
 * last layer, as models/llama.py _head computes them op by op. */
typedef struct {
    const float* norm;                  /* [H] */
    const uint8_t* w;                   /* packed weights of one QLinear, f.kp == H */
    qg_format f;
    const float* bias;                  /* [f.n] or NULL */
    int resid;                          /* each row as two int8 rows (QLinear.act8_residual) */
} nd_head;

typedef struct {
    int64_t H, D, Hq, Hk, inter;        /* hidden; head dim; this rank's heads and MLP width */
    double eps;
    int kv_type;
    int64_t nb, bs;                     /* cache blocks and their size */
    float scale;
    const float* cos_sin;               /* [max_pos, rot] = [cos | sin] */
    int64_t rot;
    const nd_layer* layers;
    const nd_head* head;                /* NULL: the caller runs the head */
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
    float* part2;       /* the k-slice partial sums of o_proj and down_proj: apart from part (qkv,
                         * gate_up), as the next norm may read them after the next GEMV began
                         * (nd_gemv's fold, redundant steps) */
    char* tiles;        /* row tiles of the int8 activations (qgemm_q8tile.h); NULL: not used */
    int qg_level, attn_level;
    int64_t tiled_min;
    int barrier;        /* 0: ours unless the team outnumbers the cpus, 1: ours, 2: libgomp's (tests) */
    int redundant;      /* 0: as nd_red_ok decides, 1: always (M <= QG_MR_Q8), 2: never (tests) */
    /* after the last stage, with logits != NULL: the head (nd_model.head) of rows lidx [nlog]
     * into logits [nlog, head.f.n]; (head.resid ? 2 : 1) nlog <= QG_MR_Q8 (the caller checks).
     * amax (NULL: not asked): [nlog] the first index of each row's largest logit among the
     * first `vocab` (a NaN counts as largest: numpy's argmax) */
    int64_t nlog, vocab;
    const int64_t* lidx;
    float* logits;
    int64_t* amax;
} nd_step;

/* ---- synchronization inside the region: a dissemination barrier (Hensgen, Finkel and Manber)
 * NOTE: libgomp's barrier is one counter that every thread increments: 16 atomic updates of one
 * cache line in a row, about 2.5 us a barrier on SPR-16 (bench_engine.py --overhead: tiny24 at
 * 16 threads, ~13 barriers a layer). Here each of ceil(log2 nt) rounds is one store to another
 * thread's flag and one wait on one's own, each flag on its own cache line. */
typedef struct {
    int v;              /* the round's flag: the sense of the episode that set it */
    int sleeping;       /* its waiter sleeps on v (futex) */
    char pad[64 - 2 * sizeof(int)];
} nd_cell;

typedef struct {
    nd_cell* cells;     /* [nt][2][rmax] */
    int rmax;
    long spins;         /* pauses before a waiter sleeps */
    int omp;            /* more threads than cpus: libgomp's barrier instead */
} nd_bar;

/* NOTE: pauses before a waiting thread sleeps: 2^17 is 3-8 ms (a pause is 65-140 cycles), the
 * order of libgomp's own spin (GOMP_SPINCOUNT 300000), so a thread sleeps only when a step
 * stalls for milliseconds (a wake-up on a futex costs tens of microseconds in a VM). */
#define ND_SPINS (1L << 17)

static inline int nd_rounds(int nt) {
    int r = 0;
    while ((1 << r) < nt) r++;
    return r;
}

/* The int8 activations of a GEMV's input: xq [M, kp], sx, xi [M, nb], xs [M, ng] per part (the
 * layout of qg_xq with each row at its own linear's sizes, parts one after another). */
typedef struct {
    int8_t* xq;
    float *sx, *xs;
    int32_t* xi;
} nd_xqbuf;

/* k-slice partial sums of a GEMV not yet added up (folded into the phase that reads them). */
typedef struct {
    const float* part;  /* [ns][M][n], NULL: none pending */
    long ns, n;
    const float* bias;  /* [n] or NULL */
} nd_pending;

/* One thread's view of the region: its barrier state, its share of dynamic work, its scratch. */
typedef struct {
    const nd_bar* bar;
    int parity, sense, tid, nt;
    int64_t* counter;   /* shared: items taken so far, over every dynamic loop of the region */
    int64_t base;       /* the counter's value when this thread's current dynamic loop began */
    float* ws;          /* attention scratch */
    /* redundant small steps (nd_red_ok): every thread computes the norms and the int8 rounding
     * of each GEMV input itself, into its own buffers, instead of a share of the rows and a
     * barrier; the residual alternates between two buffers (thread 0 writes the one that is
     * not being read) */
    int red;
    nd_xqbuf own;       /* this thread's int8 activations */
    float *res, *xrow, *hrow;    /* [H] each */
    float* arow;        /* [M, Hq D]: attention rows merged by this thread */
    float* qrow;        /* [(Hq + 2 Hk) D]: one qkv row, the heads of this thread's attention
                         * item (nd_item_rope) */
    float* rbuf[2];     /* the residual: the caller's and a scratch one */
    int cur;            /* rbuf[cur] holds the residual */
    nd_pending pend;    /* partial sums left by nd_gemv's fold: qkv's (added by nd_rope_cache
                         * or nd_item_rope),
                         * o_proj's or down_proj's (added by the next nd_norm_quant or nd_head_phase) */
    /* the weights of the GEMV after the current one (set by the caller, NULL: none or not known),
     * and the bytes of this thread's share of them that its barrier waits prefetch (nd_pf_arm) */
    const uint8_t* nw;
    const qg_format* nf;
    const char *pf, *pf_end;
} nd_thread;

/* Bytes of its share of the next GEMV's weights that a thread prefetches into L2 while it waits
 * at the barriers before that GEMV (0: off; qgemm._set_wait_prefetch). NOTE: a decode step's
 * phases between GEMVs (norms, rotary, attention of short contexts, barriers) read little from
 * DRAM, and a GEMV's first lines come at DRAM latency; on 16 threads a thread's share of an int4
 * q/k/v or o_proj of Qwen2.5-0.5B is 28-36 KB, a few microseconds of streaming. On SPR-16 at 16
 * threads (`bench/bench_engine.py --wait-prefetch`, bench/RESULTS.md) 128 KiB took batch-1 decode
 * steps to 0.98x (int4, Q4_0 GGUF, Llama-3.2-1B int4) and 0.97x (int8) those without; 16-32 KiB
 * gained less; on the 2-core Zen 5 (shares 8x larger) it was within noise (0.99x). */
static long nd_pf_wait = 131072;

/* Aim the barrier waits' prefetches at this thread's share of the next GEMV's weights (t->nw,
 * t->nf) as qg_q8_share divides them among the threads (a byte range of whole column blocks, or
 * of a block's k slices: approximate there, a prefetch is only a hint); steps of more rows than
 * QG_MR_Q8 run on row or AMX tiles and do not. */
static inline void nd_pf_arm(nd_thread* t, int64_t M) {
    const uint8_t* w = t->nw;
    const qg_format* f = t->nf;
    t->nw = NULL;
    t->pf = t->pf_end = NULL;
    if (!w || !nd_pf_wait || M > QG_MR_Q8) return;
    const long ns = qg_q8_slices(f, M, t->nt), nblocks = (f->n + QG_NB - 1) / QG_NB, bb = qg_block_bytes(f);
    long t0, t1;
    nr_share(nblocks * ns, t->tid, t->nt, &t0, &t1);
    if (t0 >= t1) return;
    const char *p = (const char*)w + t0 * bb / ns, *e = (const char*)w + t1 * bb / ns;
    t->pf = (const char*)((uintptr_t)p & ~(uintptr_t)63);
    t->pf_end = e - t->pf > nd_pf_wait ? t->pf + nd_pf_wait : e;
}

/* Wait until cell c holds `sense`: spin, then sleep on a futex. NOTE: with more threads than
 * cpus (or a busy host) the thread it waits for may need this cpu to arrive; spinning or
 * sched_yield alone made a 5-thread step on 2 cpus 10x slower than libgomp's barrier. */
static inline void nd_wait(nd_cell* c, int sense, long spins, nd_thread* t) {
    for (long spin = 0; __atomic_load_n(&c->v, __ATOMIC_ACQUIRE) != sense; spin++) {
        if (t->pf < t->pf_end) {  /* a line of the next GEMV's weights instead of a pause */
            _mm_prefetch(t->pf, _MM_HINT_T1);
            t->pf += 64;
            continue;
        }
        if (spin < spins) {
            _mm_pause();
            continue;
        }
        __atomic_store_n(&c->sleeping, 1, __ATOMIC_SEQ_CST);
        /* the signaller stores v, then reads sleeping (both seq_cst): it wakes us, or we see v */
        if (__atomic_load_n(&c->v, __ATOMIC_SEQ_CST) != sense)
            syscall(SYS_futex, &c->v, FUTEX_WAIT_PRIVATE, !sense, NULL, NULL, 0);
        __atomic_store_n(&c->sleeping, 0, __ATOMIC_RELAXED);
    }
}

static inline void nd_signal(nd_cell* c, int sense) {
    __atomic_store_n(&c->v, sense, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->sleeping, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &c->v, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static inline void nd_barrier(nd_thread* t) {
    if (t->bar->omp) {
        #pragma omp barrier
        return;
    }
    const int R = nd_rounds(t->nt), rm = t->bar->rmax;
    nd_cell* c = t->bar->cells;
    for (int r = 0; r < R; r++) {
        nd_signal(&c[(((t->tid + (1 << r)) % t->nt) * 2 + t->parity) * rm + r], t->sense);
        nd_wait(&c[(t->tid * 2 + t->parity) * rm + r], t->sense, t->bar->spins, t);
    }
    if (t->parity) t->sense = !t->sense;
    t->parity ^= 1;
}

/* The next item of a dynamic loop of n items, or -1 when none is left. Every thread of the team
 * runs the loop until -1 (one failed take each), so the loop advances the shared counter by
 * exactly n + nt and each thread knows where the next loop begins. */
static inline int64_t nd_take(nd_thread* t, int64_t n) {
    const int64_t i = __atomic_fetch_add(t->counter, 1, __ATOMIC_RELAXED) - t->base;
    if (i < n) return i;
    t->base += n + t->nt;
    return -1;
}

/* Where part p of L keeps the int8 activations of M rows in b: after the parts before it (each
 * M kp int8, M nb block scales and sums, M ng group sums). */
static inline qg_xq nd_part_xq(const nd_xqbuf* b, int64_t M, const nd_linear* L, int p) {
    long oq = 0, ob = 0, og = 0;
    for (int i = 0; i < p; i++) {
        const long ng = L->f[i].kp / L->f[i].group;
        oq += M * L->f[i].kp;
        ob += M * ng * qg_blocks_per_group(&L->f[i]);
        og += M * ng;
    }
    const qg_format* f = &L->f[p];
    const long ng = f->kp / f->group;
    const qg_xq q = {b->xq + oq, b->sx + ob, b->xi + ob, b->xs + og, f->kp, ng * qg_blocks_per_group(f), ng};
    return q;
}

/* The int8-activation sizes of L's input over its parts: int8 values, block scales, groups. */
static inline void nd_xq_sizes(const nd_linear* L, long* kq, long* nb, long* ng) {
    *kq = *nb = *ng = 0;
    for (int p = 0; p < L->nparts; p++) {
        const long g = L->f[p].kp / L->f[p].group;
        *kq += L->f[p].kp;
        *ng += g;
        *nb += g * qg_blocks_per_group(&L->f[p]);
    }
}

/* Row r's int8 activations in b for every part of L, from x (kp values). */
static inline void nd_quant_row(const nd_xqbuf* b, int64_t M, const nd_linear* L, const float* x, int64_t r) {
    for (int p = 0; p < L->nparts; p++) {
        const qg_xq q = nd_part_xq(b, M, L, p);
        qg_quantize_row(x, &L->f[p], (int8_t*)q.xq + r * q.kp, (float*)q.sx + r * q.nb,
                        (int32_t*)q.xi + r * q.nb, (float*)q.xs + r * q.ng, NULL);
    }
}

static inline nd_xqbuf nd_shared_xq(const nd_step* st) {
    const nd_xqbuf b = {st->xq, st->sx, st->xs, st->xi};
    return b;
}

/* residual += x, or += the partial sums pending from the GEMV before (t->pend; then no sum of
 * its own and no barrier before this), or nothing (x NULL, none pending);
 * h = rms_norm(residual) * w; h -> int8 for L.
 * Shared: rows over threads into the step's buffers, then a barrier. Redundant (t->red): every
 * thread computes every row into its own buffers and thread 0 stores the new residual into the
 * buffer nobody reads now; no barrier: each thread's GEMV reads only its own int8 activations. */
static void nd_norm_quant(const nd_model* m, const nd_step* st, const float* x, const float* w,
                          const nd_linear* L, nd_thread* t) {
    const int64_t H = m->H, M = st->M;
    const int pending = t->pend.part != NULL, add = pending || x != NULL;
    const int64_t r0 = t->red ? 0 : t->tid, dr = t->red ? 1 : t->nt;
    const nd_xqbuf shared = nd_shared_xq(st);
    for (int64_t r = r0; r < M; r += dr) {
        const float* xr = pending ? t->xrow : add ? x + r * H : NULL;
        if (pending)  /* row r's sums into xrow (ldo 0: each row into the same one) */
            qg_q8_sum_parts(t->pend.part, t->pend.ns, M, t->pend.n, t->pend.bias, t->xrow, 0, r * H, (r + 1) * H);
        if (!t->red) {
            float *res = st->residual + r * H, *h = st->h + r * H;
            if (xr) nr_add_rms_row(xr, res, w, m->eps, H, h);
            else nr_rms_row(res, w, m->eps, H, h);
            nd_quant_row(&shared, M, L, h, r);
            continue;
        }
        const float* src = t->rbuf[t->cur] + r * H;
        if (xr) {
            memcpy(t->res, src, sizeof(float) * (size_t)H);
            nr_add_rms_row(xr, t->res, w, m->eps, H, t->hrow);
            if (t->tid == 0) memcpy(t->rbuf[!t->cur] + r * H, t->res, sizeof(float) * (size_t)H);
        } else {
            nr_rms_row(src, w, m->eps, H, t->hrow);
        }
        nd_quant_row(&t->own, M, L, t->hrow, r);
    }
    t->pend.part = NULL;
    if (!t->red) nd_barrier(t);
    else if (add) t->cur ^= 1;
}

/* The GEMV after the current one is L's: the barrier waits before it prefetch this thread's
 * share of L's first part, the one it reads first. */
static inline void nd_next(nd_thread* t, const nd_linear* L) {
    t->nw = L->w[0];
    t->nf = &L->f[0];
}

/* GEMV parts the decode region ran on AMX-INT8 tiles (qgemm._fused_amx_gemvs: tests) */
static long nd_amx_gemvs = 0;

/* out[M, n] = int8 activations b @ W^T + bias, part by part as qg_forward_q8 computes each (and
 * loader.ConcatLinear adds its bias after them); ends with a barrier. `part`: the k-slice
 * scratch. With `fold`, k-slice partial sums of a one-part linear are left in t->pend for the
 * next phase to add up (nd_norm_quant, nd_rope_cache), one barrier fewer. */
static void nd_gemv(const nd_step* st, const nd_linear* L, const nd_xqbuf* b, float* out, float* part,
                    int fold, nd_thread* t) {
    const long M = st->M, N = L->n;
    long col = 0;
    for (int p = 0; p < L->nparts; col += L->f[p].n, p++) {
        const qg_format* f = &L->f[p];
        const long ns = qg_q8_slices(f, M, t->nt), Np = f->n;
        const qg_xq q = nd_part_xq(b, M, L, p);
        const float* bias = L->bias_after || !L->bias ? NULL : L->bias + col;
        if (st->tiles && M > QG_MR_Q8 && st->qg_level >= 2 && qg_q8_tiles && qg_tileable(f)) {  /* as qg_forward_q8 */
            if (qg_amx && qg_amx_fits(f) && b->xq == st->xq) {
                /* AMX-INT8 matrix tiles (qgemm_amx.h): they read whole 16-row tiles of the shared
                 * int8 rows, whose buffer is padded for the last one (decode.pxi _scratch) */
                const qg_amx_rows A = qg_amx_rows_at(st->tiles, &q, M);
                qg_amx_rows_fill(&A, &q, M, t->tid, t->nt);
                nd_barrier(t);
                qg_amx_share(L->w[p], f, &q, &A, M, bias, out + col, N, 0, t->tid, t->nt);
                if (t->tid == 0) nd_amx_gemvs++;
                nd_barrier(t);
                continue;
            }
            const qg_tiles T = qg_tiles_at(st->tiles, f, M);
            qg_tiles_fill(&T, &q, f, M, t->tid, t->nt);
            nd_barrier(t);
            qg_q8t_share(L->w[p], f, &T, M, bias, out + col, N, 0, t->tid, t->nt);
            nd_barrier(t);
            continue;
        }
        /* NOTE: a static share each. On SPR-16 at 16 threads the threads' GEMV times in a step
         * differ (a shared host), yet tasks taken in chunks as threads came free (about 6 a
         * thread, one atomic a chunk) decoded slower there in a one-off probe (batch 1 and 4,
         * Qwen2.5-0.5B and Llama-3.2-1B int4), so that path was removed */
        qg_q8_share(L->w[p], f, &q, M, M, bias, out + col, N, part, ns, qg_q8_kernel(st->qg_level),
                    0, t->tid, t->nt);
        if (p == L->nparts - 1) nd_pf_arm(t, M);
        nd_barrier(t);
        if (ns > 1 && fold && L->nparts == 1 && !L->bias_after) {
            const nd_pending pd = {part, ns, Np, bias};
            t->pend = pd;
            return;
        }
        if (ns > 1) {
            long i0, i1;
            nr_share(M * Np, t->tid, t->nt, &i0, &i1);
            qg_q8_sum_parts(part, ns, M, Np, bias, out + col, N, i0, i1);
            nd_barrier(t);
        }
    }
    if (L->bias_after && L->bias) {
        long i0, i1;
        nr_share(M * N, t->tid, t->nt, &i0, &i1);
        for (long i = i0; i < i1; i++) out[i] += L->bias[i % N];
        nd_barrier(t);
    }
}

/* q/k norms and rotary on every head of qkv, K and V rows into the cache: (row, head) units. A
 * unit first adds up its head's columns (and a kv head's V columns) when the qkv GEMV left its
 * k-slice partial sums pending. */
static void nd_rope_cache(const nd_model* m, const nd_step* st, const nd_layer* ly, nd_thread* t) {
    const int64_t D = m->D, Hq = m->Hq, Hk = m->Hk, W = (Hq + 2 * Hk) * D, M = st->M;
    const int64_t row = nr_kv_row(m->kv_type, D), heads = Hq + Hk;
    const nd_pending* pd = t->pend.part ? &t->pend : NULL;
    long u0, u1;
    nr_share(M * heads, t->tid, t->nt, &u0, &u1);
    for (long u = u0; u < u1; u++) {
        const int64_t r = u / heads, h = u % heads;  /* h < Hq: query head; else kv head h - Hq */
        float* x = st->qkv + r * W + h * D;
        if (pd) {  /* the head's columns, and a kv head's V columns (qkv is one part: n == W) */
            qg_q8_sum_parts(pd->part, pd->ns, M, pd->n, pd->bias, st->qkv, W, r * W + h * D, r * W + (h + 1) * D);
            if (h >= Hq)
                qg_q8_sum_parts(pd->part, pd->ns, M, pd->n, pd->bias, st->qkv, W, r * W + (h + Hk) * D,
                                r * W + (h + Hk + 1) * D);
        }
        const float* norm = h < Hq ? ly->q_norm : ly->k_norm;
        if (norm) nr_rms_row(x, norm, m->eps, D, x);
        nr_rotary_token(x, 1, D, m->cos_sin + st->pos[r] * m->rot, m->rot);
        if (h >= Hq && st->slots[r] >= 0)
            nr_cache_write(x, x + Hk * D, ly->kc, ly->vc, m->kv_type,
                           (st->slots[r] * Hk + (h - Hq)) * row, D);
    }
    t->pend.part = NULL;
    nd_barrier(t);
}

/* Whether each attention item does its own share of nd_rope_cache (nd_item_rope) instead of a
 * phase and a barrier before the items (qgemm._set_rope_in_items). NOTE: one barrier a layer
 * fewer; the query heads of a kv head are rotated once for each item of it (a few hundred
 * floats), and the item whose keys end at the newest one writes that key and value into the
 * cache, which no other item of the step reads. */
static int nd_rope_items = 1;

/* Columns [c0, c1) of row r of the qkv GEMV's output into buf[c0, c1) (buf: one qkv row): added
 * up from the pending k-slice partial sums as nd_rope_cache adds them, or copied. */
static inline void nd_qkv_cols(const nd_step* st, const nd_pending* pd, int64_t W, int64_t r,
                               int64_t c0, int64_t c1, float* buf) {
    if (pd) qg_q8_sum_parts(pd->part, pd->ns, st->M, pd->n, pd->bias, buf, 0, r * W + c0, r * W + c1);
    else memcpy(buf + c0, st->qkv + r * W + c0, sizeof(float) * (size_t)(c1 - c0));
}

/* What nd_rope_cache computes for attention item x (one decode row, kv head x->h), in this
 * thread's qkv row t->qrow: the q norm and rotary of the kv head's query heads, and, when x's
 * keys end at the newest (x->jb == ctx: one item per row and kv head), the k norm and rotary of
 * its key and the key and value into the cache. The same functions on the same floats. */
static void nd_item_rope(const nd_model* m, const nd_step* st, const nd_layer* ly, const nr_attn_args* a,
                         const nr_item* x, nd_thread* t) {
    const int64_t D = m->D, Hq = m->Hq, Hk = m->Hk, W = (Hq + 2 * Hk) * D, g = Hq / Hk, h = x->h;
    const int64_t r = a->qstart[x->s] + x->i0;
    const nd_pending* pd = t->pend.part ? &t->pend : NULL;
    const float* cs = m->cos_sin + st->pos[r] * m->rot;
    float* q = t->qrow;
    nd_qkv_cols(st, pd, W, r, h * g * D, (h + 1) * g * D, q);
    for (int64_t qh = h * g; qh < (h + 1) * g; qh++) {
        float* y = q + qh * D;
        if (ly->q_norm) nr_rms_row(y, ly->q_norm, m->eps, D, y);
        nr_rotary_token(y, 1, D, cs, m->rot);
    }
    if (x->jb != a->ctx[x->s] || st->slots[r] < 0) return;
    float *k = q + (Hq + h) * D, *v = q + (Hq + Hk + h) * D;
    nd_qkv_cols(st, pd, W, r, (Hq + h) * D, (Hq + h + 1) * D, q);
    nd_qkv_cols(st, pd, W, r, (Hq + Hk + h) * D, (Hq + Hk + h + 1) * D, q);
    if (ly->k_norm) nr_rms_row(k, ly->k_norm, m->eps, D, k);
    nr_rotary_token(k, 1, D, cs, m->rot);
    nr_cache_write(k, v, ly->kc, ly->vc, m->kv_type, (st->slots[r] * Hk + h) * nr_kv_row(m->kv_type, D), D);
}

/* The attention arguments of layer ly over the step's qkv (as paged_attention receives them). */
static void nd_attn_args(const nd_model* m, const nd_step* st, const nd_layer* ly, nr_attn_args* a) {
    const int64_t D = m->D, Hq = m->Hq, Hk = m->Hk;
    a->q = st->qkv;
    a->q_st = (Hq + 2 * Hk) * D;
    a->q_sh = D;
    a->kc = ly->kc;
    a->vc = ly->vc;
    a->kv_type = m->kv_type;
    a->nb = m->nb;
    a->bs = m->bs;
    a->Hq = Hq;
    a->Hk = Hk;
    a->D = D;
    a->bt = st->bt;
    a->bt_st = a->max_blocks = st->bt_st;
    a->qstart = st->qstart;
    a->ctx = st->ctx;
    a->S = st->M;
    a->scale = m->scale;
    a->window = ly->window;
    a->level = st->attn_level;
    a->tiled_min = st->tiled_min;
    a->prompt_s0 = st->M;  /* decode rows only */
    a->out = st->attn;
    a->o_st = Hq * D;
    a->o_sh = D;
}

/* The items of plan p (made before the region), then the merges of split items. Returns the
 * attention rows [M, Hq D]: the step's, or, redundant with split items, this thread's own copy
 * with every merge made in it (no barrier after the merges). `rope`: each item first does its
 * share of nd_rope_cache (nd_item_rope) and reads its queries from this thread's qkv row. */
static const float* nd_attention(const nd_model* m, const nd_step* st, const nd_layer* ly,
                                 const nr_attn_plan_t* p, int rope, nd_thread* t) {
    nr_attn_args a;
    nd_attn_args(m, st, ly, &a);
    nr_attn_args aq = a;
    if (rope) {  /* every row's queries at the same place: an item has one row (decode) */
        aq.q = t->qrow;
        aq.q_st = 0;
    }
    for (int64_t i; (i = nd_take(t, p->n_items)) >= 0;) {
        if (rope) nd_item_rope(m, st, ly, &a, &p->items[i], t);
        nr_attn_run_item(&aq, p, i, t->ws);
    }
    t->pend.part = NULL;
    nd_barrier(t);
    if (!p->n_slots) return st->attn;
    if (t->red) {
        memcpy(t->arow, st->attn, sizeof(float) * (size_t)(st->M * m->Hq * m->D));
        a.out = t->arow;
        for (int64_t i = 0; i < p->n_items; i++) nr_attn_combine_item(&a, p, i);
        return t->arow;
    }
    for (int64_t i; (i = nd_take(t, p->n_items)) >= 0;) nr_attn_combine_item(&a, p, i);
    nd_barrier(t);
    return st->attn;
}

/* `fold`: the next stage runs in this region too (it adds up o_proj's partial sums itself). */
static void nd_attention_half(const nd_model* m, const nd_step* st, const nd_layer* ly, int first,
                              const nr_attn_plan_t* plan, int fold, nd_thread* t) {
    const nd_xqbuf shared = nd_shared_xq(st), *in = t->red ? &t->own : &shared;
    nd_norm_quant(m, st, first ? NULL : st->delta, ly->in_norm, &ly->qkv, t);
    nd_next(t, &ly->o);
    nd_gemv(st, &ly->qkv, in, st->qkv, st->part, 1, t);
    if (!nd_rope_items) nd_rope_cache(m, st, ly, t);
    const float* attn = nd_attention(m, st, ly, plan, nd_rope_items, t);
    const int64_t A = m->Hq * m->D;
    if (t->red) {
        for (int64_t r = 0; r < st->M; r++) nd_quant_row(&t->own, st->M, &ly->o, attn + r * A, r);
    } else {
        for (int64_t r = t->tid; r < st->M; r += t->nt) nd_quant_row(&shared, st->M, &ly->o, attn + r * A, r);
        nd_barrier(t);
    }
    nd_next(t, &ly->gu);
    nd_gemv(st, &ly->o, in, st->o, st->part2, fold, t);
}

/* `next`: the layer whose attention half this region runs next (NULL: none; then the head's
 * weights when `head`), for the barrier waits' prefetches. */
static void nd_mlp_half(const nd_model* m, const nd_step* st, const nd_layer* ly, int fold, const nd_layer* next,
                        const nd_head* head, nd_thread* t) {
    const nd_xqbuf shared = nd_shared_xq(st);
    nd_norm_quant(m, st, st->o, ly->post_norm, &ly->gu, t);
    nd_next(t, &ly->down);
    nd_gemv(st, &ly->gu, t->red ? &t->own : &shared, st->gu, st->part, 0, t);
    /* silu(gate) * up and its int8 rounding, one (row, group of down_proj) at a time (down_proj
     * is one weight, so one part: the caller checks) */
    const qg_format* f = &ly->down.f[0];
    const long G = f->group, ng = f->kp / G, nb = ng * qg_blocks_per_group(f);
    const int64_t In = m->inter;
    long u0, u1;
    nr_share(st->M * ng, t->tid, t->nt, &u0, &u1);
    for (long u = u0; u < u1; u++) {
        const int64_t r = u / ng, g = u % ng;
        const float* gate = st->gu + r * 2 * In;
        float* act = st->act + r * In;
        nr_silu_row(gate + g * G, gate + In + g * G, G, act + g * G);
        qg_quantize_group(act, f, g, st->xq + r * f->kp, st->sx + r * nb, st->xi + r * nb,
                          st->xs + r * ng, NULL);
    }
    nd_barrier(t);
    if (next) nd_next(t, &next->qkv);
    else if (head) {
        t->nw = head->w;
        t->nf = &head->f;
    }
    nd_gemv(st, &ly->down, &shared, st->delta, st->part2, fold, t);
}

/* Scratch of the head phase (nd_run allocates it): the int8 rows of the normed logits rows
 * (shared steps), the k-slice partial sums, and each thread's argmax candidates. */
typedef struct {
    nd_xqbuf xq;
    float* part;        /* [ns][nlog][n] when ns > 1 */
    long ns;
    float* cval;        /* [nt][nlog] */
    int64_t* cidx;      /* [nt][nlog]; -1: the thread had no column */
} nd_head_buf;

/* The head of the logits rows: hn = rms_norm(residual + delta) * norm on a copy of the residual
 * (the residual itself is not updated), its int8 rows, the lm_head GEMV into st->logits, then each
 * thread's argmax candidate over its columns. Shared steps: rows over threads, then a barrier;
 * redundant ones: every thread every row, into its own buffers. */
static void nd_head_phase(const nd_model* m, const nd_step* st, const nd_head_buf* hb, nd_thread* t) {
    const nd_head* hd = m->head;
    const qg_format* f = &hd->f;
    const int64_t H = m->H, M = st->M, S = st->nlog, N = f->n;
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f), Q = hd->resid ? 2 * S : S;
    const nd_xqbuf* b = t->red ? &t->own : &hb->xq;
    const float* res = t->red ? t->rbuf[t->cur] : st->residual;
    for (int64_t i = t->red ? 0 : t->tid; i < S; i += t->red ? 1 : t->nt) {
        const int64_t r = st->lidx[i];
        if (t->pend.part)  /* row r of down_proj's sums (ldo 0: into hrow) */
            qg_q8_sum_parts(t->pend.part, t->pend.ns, M, t->pend.n, t->pend.bias, t->hrow, 0, r * H, (r + 1) * H);
        else
            memcpy(t->hrow, st->delta + r * H, sizeof(float) * (size_t)H);
        memcpy(t->res, res + r * H, sizeof(float) * (size_t)H);
        nr_add_rms_row(t->hrow, t->res, hd->norm, m->eps, H, t->hrow);
        qg_quantize_row_at(t->hrow, i, f, b->xq, b->sx, b->xi, b->xs, hd->resid, t->xrow);
    }
    t->pend.part = NULL;
    if (!t->red) nd_barrier(t);
    const qg_xq q = {b->xq, b->sx, b->xi, b->xs, f->kp, nb, ng};
    qg_q8_share(hd->w, f, &q, Q, S, hd->bias, st->logits, N, hb->part, hb->ns, qg_q8_kernel(st->qg_level),
                hd->resid, t->tid, t->nt);
    if (hb->ns > 1) {
        long i0, i1;
        nr_share(S * N, t->tid, t->nt, &i0, &i1);
        nd_barrier(t);
        qg_q8_sum_parts(hb->part, hb->ns, S, N, hd->bias, st->logits, N, i0, i1);
        nd_barrier(t);
    }
    if (!st->amax) return;
    /* NOTE: with one slice these are the columns this thread just stored (no barrier before) */
    long b0, b1;
    nr_share((N + QG_NB - 1) / QG_NB, t->tid, t->nt, &b0, &b1);
    const int64_t c0 = b0 * QG_NB, c1 = b1 * QG_NB < st->vocab ? b1 * QG_NB : st->vocab;
    for (int64_t i = 0; i < S; i++) {
        const float* x = st->logits + i * N;
        int64_t best = c0 < c1 ? c0 : -1;
        for (int64_t c = c0; c < c1 && x[best] == x[best]; c++)
            if (x[c] > x[best] || x[c] != x[c]) best = c;
        hb->cval[t->tid * S + i] = best >= 0 ? x[best] : 0.0f;
        hb->cidx[t->tid * S + i] = best;
    }
}

/* Whether a step of M rows runs redundant (nd_thread.red): when a row's norm and int8 rounding
 * on every thread cost less than the barriers they save. NOTE: batch 1 only: on SPR-16 at 16
 * threads (Qwen2.5-0.5B int4, a one-off probe) redundant steps of 4 and 8 rows decoded clearly
 * slower than with barriers (16 threads reading every row that other threads wrote), one row
 * about as fast or a little faster; past QG_MR_Q8 rows the GEMVs run in row tiles or AMX tiles, with
 * barriers of their own. */
static inline int nd_red_ok(const nd_step* st, int nt) {
    if (st->redundant == 2 || nt < 2 || st->M > QG_MR_Q8) return 0;
    return st->redundant == 1 || st->M == 1;
}

static inline size_t nd_up64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Stages [s0, s1) (2 l: attention half of layer l, 2 l + 1: its MLP half) on the OpenMP threads.
 * The caller checked every index (positions, slots, block tables). Everything the region needs
 * is allocated before it: the attention plans (one per distinct window, as paged_attention
 * plans them), each thread's scratch and the barrier's flags. 0, or -1 when out of memory. */
static int nd_run(const nd_model* m, const nd_step* st, int64_t s0, int64_t s1) {
    const int ntmax = omp_get_max_threads();
    const int64_t l0 = s0 / 2, nl = (s1 + 1) / 2 - l0;
    nr_attn_plan_t* plans = (nr_attn_plan_t*)calloc((size_t)nl, sizeof(nr_attn_plan_t));
    const nr_attn_plan_t** use = (const nr_attn_plan_t**)calloc((size_t)nl, sizeof(void*));
    int err = plans == NULL || use == NULL;
    size_t ws_n = 0;
    for (int64_t i = 0; i < nl && !err; i++) {
        if (2 * (l0 + i) < s0) continue;  /* this call runs only the layer's MLP half */
        const int64_t w = m->layers[l0 + i].window;
        for (int64_t j = 0; j < i && !use[i]; j++)
            if (use[j] && m->layers[l0 + j].window == w) use[i] = use[j];
        if (use[i]) continue;
        nr_attn_args a;
        nd_attn_args(m, st, &m->layers[l0 + i], &a);
        err = nr_attn_plan(&a, ntmax, &plans[i]) != 0;
        use[i] = &plans[i];
        ws_n = plans[i].ws_n > ws_n ? plans[i].ws_n : ws_n;
    }
    const size_t ws_st = (ws_n + 15) / 16 * 16;
    const int rmax = nd_rounds(ntmax);
    /* each thread's own buffers (nd_thread): res, xrow, hrow [H]; redundant steps only: the
     * attention rows [M, Hq D] and the int8 activations of the largest input of qkv, o_proj and
     * gate_up */
    const int red_any = nd_red_ok(st, ntmax);
    const int64_t M = st->M, H = m->H, Mr = red_any ? M : 0;
    long kq = 0, nbq = 0, ngq = 0;
    for (int64_t l = l0; l < l0 + nl; l++) {
        const nd_linear* Ls[3] = {&m->layers[l].qkv, &m->layers[l].o, &m->layers[l].gu};
        for (int i = 0; i < 3; i++) {
            long a, b, c;
            nd_xq_sizes(Ls[i], &a, &b, &c);
            kq = a > kq ? a : kq;
            nbq = b > nbq ? b : nbq;
            ngq = c > ngq ? c : ngq;
        }
    }
    /* the head: its int8 rows (two a row with resid), shared or in each thread's own buffers */
    const nd_head* hd = st->logits ? m->head : NULL;
    long hq = 0, hnb = 0, hng = 0, hrows = 0;
    if (hd) {
        const long g = hd->f.kp / hd->f.group, per = hd->resid ? 2 : 1;
        hrows = per * st->nlog;
        hq = hd->f.kp;
        hng = g;
        hnb = g * qg_blocks_per_group(&hd->f);
        kq = per * hq > kq ? per * hq : kq;
        nbq = per * hnb > nbq ? per * hnb : nbq;
        ngq = per * hng > ngq ? per * hng : ngq;
    }
    nd_head_buf hb;
    memset(&hb, 0, sizeof hb);
    const int64_t S = hd ? st->nlog : 0;
    hb.ns = hd ? qg_q8_slices(&hd->f, hrows, ntmax) : 1;
    const size_t h_sx = nd_up64(sizeof(float) * (size_t)(hrows * hnb));
    const size_t h_xs = nd_up64(sizeof(float) * (size_t)(hrows * hng));
    const size_t h_xi = nd_up64(sizeof(int32_t) * (size_t)(hrows * hnb)), h_xq = nd_up64((size_t)(hrows * hq));
    const size_t h_part = hb.ns > 1 ? nd_up64(sizeof(float) * (size_t)(hb.ns * S * hd->f.n)) : 0;
    const size_t h_cand = nd_up64((sizeof(float) + sizeof(int64_t)) * (size_t)(ntmax * S));
    char* hbuf = err || !hd ? NULL : (char*)aligned_alloc(64, h_sx + h_xs + h_xi + h_xq + h_part + h_cand);
    if (hbuf) {
        hb.xq.sx = (float*)hbuf;
        hb.xq.xs = (float*)(hbuf + h_sx);
        hb.xq.xi = (int32_t*)(hbuf + h_sx + h_xs);
        hb.xq.xq = (int8_t*)(hbuf + h_sx + h_xs + h_xi);
        hb.part = hb.ns > 1 ? (float*)(hbuf + h_sx + h_xs + h_xi + h_xq) : NULL;
        hb.cidx = (int64_t*)(hbuf + h_sx + h_xs + h_xi + h_xq + h_part);
        hb.cval = (float*)(hb.cidx + ntmax * S);
    }
    const size_t o_qr = nd_up64(sizeof(float) * (size_t)(3 * H));
    const size_t o_ar = o_qr + nd_up64(sizeof(float) * (size_t)((m->Hq + 2 * m->Hk) * m->D));
    const size_t o_sx = o_ar + nd_up64(sizeof(float) * (size_t)(Mr * m->Hq * m->D));
    const size_t o_xs = o_sx + nd_up64(sizeof(float) * (size_t)(Mr * nbq));
    const size_t o_xi = o_xs + nd_up64(sizeof(float) * (size_t)(Mr * ngq));
    const size_t o_xq = o_xi + nd_up64(sizeof(int32_t) * (size_t)(Mr * nbq));
    const size_t own_st = o_xq + nd_up64((size_t)(Mr * kq));
    float* ws = err ? NULL : (float*)aligned_alloc(64, sizeof(float) * (ws_st * ntmax + 16));
    nd_cell* cells = err ? NULL : (nd_cell*)aligned_alloc(64, sizeof(nd_cell) * (size_t)(ntmax * 2 * (rmax + 1)));
    char* own = err ? NULL : (char*)aligned_alloc(64, own_st * (size_t)ntmax);
    float* rbuf1 = err || !red_any ? NULL : (float*)aligned_alloc(64, nd_up64(sizeof(float) * (size_t)(M * H)));
    err = err || ws == NULL || cells == NULL || own == NULL || (red_any && rbuf1 == NULL) || (hd && hbuf == NULL);
    if (!err) {
        memset(cells, 0, sizeof(nd_cell) * (size_t)(ntmax * 2 * (rmax + 1)));
        /* NOTE: waiters that spin on every cpu starve the threads they wait for when the team is
         * larger than the cpus it may use (5 threads on 2 cpus: 10x slower than op by op, 1.5x
         * when they sleep at once); libgomp's barrier, which counts the cpus too, serves there */
        cpu_set_t cpus;
        const int ncpu = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : ntmax;
        const nd_bar bar = {cells, rmax + 1, ND_SPINS,
                            st->barrier == 2 || (st->barrier == 0 && ntmax > ncpu)};
        int64_t counter = 0;
        int last = 0, team = 1;
        #pragma omp parallel
        {
            nd_thread t;
            memset(&t, 0, sizeof t);
            t.bar = &bar;
            t.sense = 1;
            t.tid = omp_get_thread_num();
            t.nt = omp_get_num_threads();
            t.counter = &counter;
            t.ws = ws + (size_t)t.tid * ws_st;
            char* mine = own + (size_t)t.tid * own_st;
            t.res = (float*)mine;
            t.xrow = t.res + H;
            t.hrow = t.xrow + H;
            t.qrow = (float*)(mine + o_qr);
            t.arow = (float*)(mine + o_ar);
            t.own.sx = (float*)(mine + o_sx);
            t.own.xs = (float*)(mine + o_xs);
            t.own.xi = (int32_t*)(mine + o_xi);
            t.own.xq = (int8_t*)(mine + o_xq);
            t.red = red_any && nd_red_ok(st, t.nt);
            t.rbuf[0] = st->residual;
            t.rbuf[1] = rbuf1;
            for (int64_t s = s0; s < s1; s++) {
                const nd_layer* ly = &m->layers[s / 2];
                const int fold = s + 1 < s1 || hd != NULL;
                if (s % 2 == 0) nd_attention_half(m, st, ly, s == 0, use[s / 2 - l0], fold, &t);
                else nd_mlp_half(m, st, ly, fold, s + 1 < s1 ? &m->layers[(s + 1) / 2] : NULL,
                                 s + 1 == s1 ? hd : NULL, &t);
            }
            if (hd) nd_head_phase(m, st, &hb, &t);
            if (t.tid == 0) {
                last = t.cur;
                team = t.nt;
            }
        }
        /* each row's argmax: the first thread's candidate that is a NaN, else the largest (the
         * lowest index on ties: the threads' columns ascend with tid) */
        for (int64_t i = 0; hd && st->amax && i < S; i++) {
            int64_t best = -1;
            float v = 0.0f;
            for (int k = 0; k < team && !(best >= 0 && v != v); k++) {
                const int64_t c = hb.cidx[k * S + i];
                const float x = hb.cval[k * S + i];
                if (c >= 0 && (best < 0 || x > v || x != x)) {
                    best = c;
                    v = x;
                }
            }
            st->amax[i] = best;
        }
        /* the residual ended in the scratch buffer (an odd number of updates) */
        if (last) memcpy(st->residual, rbuf1, sizeof(float) * (size_t)(M * H));
    }
    for (int64_t i = 0; plans && i < nl; i++) nr_attn_plan_free(&plans[i]);
    free(plans);
    free(use);
    free(ws);
    free(cells);
    free(own);
    free(rbuf1);
    free(hbuf);
    return err ? -1 : 0;
}

#endif
