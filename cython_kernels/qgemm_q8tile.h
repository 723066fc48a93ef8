/* Int8-activation GEMM for many rows on AVX-512 VNNI: row tiles.
 *
 * qgemm_q8.h's kernel meets each 64-byte weight row with up to QG_MR_Q8 activation rows, each
 * read from its own row of xq: fine for a decode step, where the weight bytes are the cost. With
 * more rows (a decode batch, a prefill on int8 activations) the integer dot products are the
 * cost, and there that kernel spends about as many instructions on addressing, broadcasts and
 * the per-block epilogue as on vpdpbusd. Here the quantized rows are first copied into tiles of
 * QG_MR_T rows, interleaved by 4 k (each dword of the tile is one row's 4 k), with each block's
 * scale and the offset correction -off * xi beside them in the same interleaved order: every
 * operand of the inner loop is then an embedded broadcast at a constant offset from one pointer,
 * and the integer accumulator starts at the offset correction instead of subtracting it.
 *
 * Per output element the integer block sums are the same exact integers as qg_q8_vnni's and the
 * float operations (convert, scale product, fused multiply-add per block; the group's c term)
 * run in the same order, so the two kernels give bitwise equal results: a row does not depend on
 * which kernel, pass or tile it ran in.
 */
#ifndef NUMA_RUNTIME_QGEMM_Q8TILE_H
#define NUMA_RUNTIME_QGEMM_Q8TILE_H

/* NOTE: rows per tile: the decode kernel's rows per pass (so both take QG_Q8_CASES). 12 fit the
 * registers (12 int32 + 12 f32 accumulators and the weights), but 8 ran as fast at M = 512 and
 * 1.2-1.4x as fast at 16 and 64 rows (896 x 9728 int4, 2-core Zen 4, a C harness around
 * qg_forward_q8, best of 40): more tasks, no 12 + 4 split of 16 rows. */
#define QG_MR_T QG_MR_Q8

/* 0: many rows take qgemm_q8.h's kernel too (tests and benchmarks: qgemm._set_q8_tiles) */
static int qg_q8_tiles = 1;

typedef struct {
    const int8_t* xt;   /* [kp / 4][QG_MR_T][4] */
    const float* st;    /* [nb][QG_MR_T] block scales */
    const int32_t* ot;  /* [nb][QG_MR_T] -off * (sum of the block's int8 values) */
    const float* xst;   /* [ng][QG_MR_T] the group sums xs (qg_xq) */
} qg_xt;

static inline long qg_tile_bytes(const qg_format* f) { return f->kp * QG_MR_T; }

/* Slot r of the row-interleaved scalar tables of a tile of R rows (qgemm_amx.h's tiles too):
 * row `row` of q's block scales into st [nb][R], its offset corrections -off * xi into ot
 * [nb][R] (ot NULL: none) and its group sums into xst [ng][R]; zeros for a row past Q. */
static void qg_row_scalars(const qg_xq* q, long Q, long row, int R, int r, long off, float* st,
                           int32_t* ot, float* xst) {
    const int in = row < Q;
    for (long b = 0; b < q->nb; b++) {
        st[b * R + r] = in ? q->sx[row * q->nb + b] : 0.0f;
        if (ot) ot[b * R + r] = in ? (int32_t)(-off * q->xi[row * q->nb + b]) : 0;
    }
    for (long g = 0; g < q->ng; g++) xst[g * R + r] = in ? q->xs[row * q->ng + g] : 0.0f;
}

/* Tile i of rows [QG_MR_T i, QG_MR_T (i + 1)) of q (Q rows; rows past Q are zeros). */
static void qg_tile_fill(const qg_xq* q, const qg_format* f, long Q, long i, int8_t* xt,
                         float* st, int32_t* ot, float* xst) {
    const long kc = f->kp / 4, off = qg_q8_off_vnni(f);
    for (int r = 0; r < QG_MR_T; r++) {
        const long row = i * QG_MR_T + r;
        const int32_t* src = (const int32_t*)(q->xq + row * q->kp);  /* kp % 4 == 0 */
        int32_t* dst = (int32_t*)xt + r;
        for (long c = 0; c < kc; c++) dst[c * QG_MR_T] = row < Q ? src[c] : 0;
        qg_row_scalars(q, Q, row, QG_MR_T, r, off, st, ot, xst);
    }
}

/* acc[r * 16 + j] for rows r < mr of tile t and the 16 columns of block blk, groups [g0, g1). */
QG_INLINE QG_T512VNNI void qg_q8t_vnni_mr(const uint8_t* blk, const qg_format* f, const qg_xt* t,
                                          long g0, long g1, float* acc, const int bits,
                                          const int mr) {
    const long pk = qg_pk_of(bits);  /* k per row or unit */
    const long ub = qg_ub_of(bits), mb = qg_meta_bytes(f);
    const uint8_t* gbase = qg_groups(blk, f);  /* group g: gbase + g gb */
    const long gb = qg_group_bytes(f);
    const long G = f->group, nbg = qg_blocks_per_group(f);
    const int has_c = bits != 8 && qg_has_c(f), nl = bits == 4 && f->kind == QG_NL;
    const int has_off = qg_q8_off_vnni(f) != 0;
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F), flip = _mm512_set1_epi32((int)0x80808080);
    const __m512i nlu = _mm512_xor_si512(QG_NL_S512(), flip);  /* the NL levels + 128 */
    __m512 a[QG_MR_T];
    for (int r = 0; r < mr; r++) a[r] = _mm512_setzero_ps();
    for (long g = g0; g < g1; g++) {
        const uint8_t* meta = gbase + g * gb;
        const __m512 s = qg_s512(blk, f, meta, g);
        const uint8_t* row = meta + mb;
        for (long b = 0; b < nbg; b++) {
            const long k0 = g * G + b * QG_QB;
            const long k1 = k0 + QG_QB < (g + 1) * G ? k0 + QG_QB : (g + 1) * G;
            const long bi = g * nbg + b;
            const int32_t* ob = t->ot + bi * QG_MR_T;
            __m512i ia[QG_MR_T];
            for (int r = 0; r < mr; r++)
                ia[r] = has_off ? _mm512_set1_epi32(ob[r]) : _mm512_setzero_si512();
            const int32_t* xb = (const int32_t*)t->xt + (k0 / 4) * QG_MR_T;
#define QG_T_STEP                                                                                 \
            {                                                                                     \
                if (qg_pf_bytes)                                                                  \
                    for (long l_ = 0; l_ < ub; l_ += 64)                                          \
                        _mm_prefetch((const char*)row + l_ + qg_pf_bytes, _MM_HINT_T0);           \
                const __m512i v = _mm512_loadu_si512((const void*)row);                          \
                if (bits != 4 && bits != 8) {  /* v: plane or crumbs (qgemm_q8.h's decode) */  \
                    for (int rr = 0; rr < pk / 8; rr++) {                                         \
                        __m512i lo, hi;                                                           \
                        qg_hb_merge512(row, v, bits, rr, &lo, &hi);                               \
                        for (int r = 0; r < mr; r++) {                                            \
                            ia[r] = qg_dpbusd_bcast(ia[r], lo, xb + 2 * rr * QG_MR_T + r);        \
                            ia[r] = qg_dpbusd_bcast(ia[r], hi, xb + (2 * rr + 1) * QG_MR_T + r);  \
                        }                                                                         \
                    }                                                                             \
                } else if (bits == 4) {                                                           \
                    __m512i lo = _mm512_and_si512(v, m4);                                         \
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);                   \
                    if (nl) {                                                                     \
                        lo = _mm512_shuffle_epi8(nlu, lo);                                        \
                        hi = _mm512_shuffle_epi8(nlu, hi);                                        \
                    }                                                                             \
                    for (int r = 0; r < mr; r++) {                                                \
                        ia[r] = qg_dpbusd_bcast(ia[r], lo, xb + r);                               \
                        ia[r] = qg_dpbusd_bcast(ia[r], hi, xb + QG_MR_T + r);                  \
                    }                                                                             \
                } else {                                                                          \
                    const __m512i u = _mm512_xor_si512(v, flip);                                  \
                    for (int r = 0; r < mr; r++)                                                  \
                        ia[r] = qg_dpbusd_bcast(ia[r], u, xb + r);                                \
                }                                                                                 \
                row += ub;                                                                        \
                xb += (pk / 4) * QG_MR_T;                                                         \
            }
            if (k1 - k0 == QG_QB) {  /* NOTE: a constant trip count: unrolled, no moves between steps */
                #pragma GCC unroll 8
                for (int st = 0; st < QG_QB / pk; st++) QG_T_STEP
            } else {
                for (long k = k0; k < k1; k += pk) QG_T_STEP
            }
#undef QG_T_STEP
            const float* sb = t->st + bi * QG_MR_T;
            for (int r = 0; r < mr; r++)
                a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(s, _mm512_set1_ps(sb[r])), a[r]);
        }
        if (has_c) {
            const __m512 c = qg_c512(blk, f, meta, g, s);
            const float* xg = t->xst + g * QG_MR_T;
            for (int r = 0; r < mr; r++) a[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(xg[r]), a[r]);
        }
    }
    for (int r = 0; r < mr; r++) _mm512_store_ps(acc + r * QG_NB, a[r]);
}

QG_Q8_INST_ALL(qg_q8t_vnni_mr, QG_T512VNNI, qg_xt)

/* 0: the row tiles of every format take qg_q8t_vnni_mr (tests and benchmarks: qgemm._set_q8t_lean) */
static int qg_q8t_lean_on = 1;

/* qg_q8t_lean: qg_q8t_lean_mr takes f (qgemm_q8.h) and it is on */
static inline int qg_q8t_lean(const qg_format* f) { return qg_q8t_lean_on && qg_q8t_lean_takes(f); }

/* qg_q8t_vnni_mr for the formats qg_q8t_lean takes (Q4_0, Q4_1, Q8_0, int4 and int8 at load):
 * the same integer block sums and float operations in the same order (bitwise equal results),
 * with every pointer advanced in place and no test inside the group loop. NOTE: the generic
 * kernel kept its 8 float accumulators on the stack over the block loop (GCC 12 spilled them
 * around its format tests); one core of the 2-core Zen 5 ran it at 42% of its vpdpbusd peak at
 * 16 rows. */
QG_INLINE QG_T512VNNI void qg_q8t_lean_mr(const uint8_t* blk, const qg_format* f, const qg_xt* t,
                                          long g0, long g1, float* acc, const int bits, const int mr,
                                          const int has_c) {
    /* has_c: int4 with a zero point or min (no offset); else an offset (int4 sym: 8, int8: 128)
     * and no c. NOTE: the prefetch runs whatever qg_pf_bytes is (0: a line already read) */
    const long G = f->group, nbg = G / QG_QB, mb = has_c ? 64 : 32, gb = qg_group_bytes(f);
    const int has_off = !has_c;
    const long pf = qg_pf_bytes;
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F), flip = _mm512_set1_epi32((int)0x80808080);
    const uint8_t* meta = qg_groups(blk, f) + g0 * gb;
    const int32_t* xb = (const int32_t*)t->xt + g0 * (G / 4) * QG_MR_T;
    const float* sb = t->st + g0 * nbg * QG_MR_T;
    const int32_t* ob = t->ot + g0 * nbg * QG_MR_T;
    const float* xg = t->xst + g0 * QG_MR_T;
    __m512 a[QG_MR_T];
    for (int r = 0; r < mr; r++) a[r] = _mm512_setzero_ps();
    for (long g = g0; g < g1; g++, meta += gb, xg += QG_MR_T) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)meta));
        const uint8_t* row = meta + mb;
        for (long b = 0; b < nbg; b++, sb += QG_MR_T, ob += QG_MR_T) {
            __m512i ia[QG_MR_T];
            for (int r = 0; r < mr; r++) ia[r] = has_off ? _mm512_set1_epi32(ob[r]) : _mm512_setzero_si512();
            if (bits == 4) {
                #pragma GCC unroll 4
                for (int st = 0; st < QG_QB / 8; st++, row += 64, xb += 2 * QG_MR_T) {
                    _mm_prefetch((const char*)row + pf, _MM_HINT_T0);
                    const __m512i v = _mm512_loadu_si512((const void*)row);
                    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
                    for (int r = 0; r < mr; r++) {
                        ia[r] = qg_dpbusd_bcast(ia[r], lo, xb + r);
                        ia[r] = qg_dpbusd_bcast(ia[r], hi, xb + QG_MR_T + r);
                    }
                }
            } else {
                #pragma GCC unroll 8
                for (int st = 0; st < QG_QB / 4; st++, row += 64, xb += QG_MR_T) {
                    _mm_prefetch((const char*)row + pf, _MM_HINT_T0);
                    const __m512i u = _mm512_xor_si512(_mm512_loadu_si512((const void*)row), flip);
                    for (int r = 0; r < mr; r++) ia[r] = qg_dpbusd_bcast(ia[r], u, xb + r);
                }
            }
            for (int r = 0; r < mr; r++)
                a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(s, _mm512_set1_ps(sb[r])), a[r]);
        }
        if (has_c) {
            const __m512 c = qg_c512(blk, f, meta, g, s);
            for (int r = 0; r < mr; r++) a[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(xg[r]), a[r]);
        }
    }
    for (int r = 0; r < mr; r++) _mm512_store_ps(acc + r * QG_NB, a[r]);
}

QG_Q8_LEAN_INST(qg_q8t_lean, qg_xt)

static QG_T512VNNI void qg_q8t_vnni(const uint8_t* blk, const qg_format* f, const qg_xt* q,
                                    long g0, long g1, int m, float* acc) {
    if (qg_q8t_lean(f)) {
        QG_Q8_LEAN_CASES(qg_q8t_lean)
        return;
    }
    switch (f->bits) {
        case 2: { QG_Q8_CASES(qg_q8t_vnni_mr, 2) } break;
        case 3: { QG_Q8_CASES(qg_q8t_vnni_mr, 3) } break;
        case 4: { QG_Q8_CASES(qg_q8t_vnni_mr, 4) } break;
        case 5: { QG_Q8_CASES(qg_q8t_vnni_mr, 5) } break;
        case 6: { QG_Q8_CASES(qg_q8t_vnni_mr, 6) } break;
        default: { QG_Q8_CASES(qg_q8t_vnni_mr, 8) } break;
    }
}

/* Buffers of the tiles of Q rows: [nt][...] each, 64-byte aligned parts. */
typedef struct {
    int8_t* xt;
    float* st;
    int32_t* ot;
    float* xst;
    long ntiles;
} qg_tiles;

static size_t qg_tiles_bytes(const qg_format* f, long Q) {
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f), nt = (Q + QG_MR_T - 1) / QG_MR_T;
    return (size_t)nt * ((size_t)qg_tile_bytes(f) + sizeof(float) * QG_MR_T * (size_t)(2 * nb + ng)) + 4 * 64;
}

static qg_tiles qg_tiles_at(char* buf, const qg_format* f, long Q) {
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f), nt = (Q + QG_MR_T - 1) / QG_MR_T;
    qg_tiles t;
    uintptr_t p = ((uintptr_t)buf + 63) & ~(uintptr_t)63;
    t.xt = (int8_t*)p;
    p = (p + (size_t)nt * qg_tile_bytes(f) + 63) & ~(uintptr_t)63;
    t.st = (float*)p;
    p = (p + sizeof(float) * (size_t)(nt * nb * QG_MR_T) + 63) & ~(uintptr_t)63;
    t.ot = (int32_t*)p;
    p = (p + sizeof(int32_t) * (size_t)(nt * nb * QG_MR_T) + 63) & ~(uintptr_t)63;
    t.xst = (float*)p;
    t.ntiles = nt;
    return t;
}

static inline qg_xt qg_tile(const qg_tiles* T, const qg_format* f, long i) {
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f);
    const qg_xt t = {T->xt + i * qg_tile_bytes(f), T->st + i * nb * QG_MR_T, T->ot + i * nb * QG_MR_T,
                     T->xst + i * ng * QG_MR_T};
    return t;
}

/* Thread tid of nt: its tiles of q's Q rows (each tile is written by one thread). */
static void qg_tiles_fill(const qg_tiles* T, const qg_xq* q, const qg_format* f, long Q, int tid, int nt) {
    for (long i = tid; i < T->ntiles; i += nt) {
        const qg_xt x = qg_tile(T, f, i);
        qg_tile_fill(q, f, Q, i, (int8_t*)x.xt, (float*)x.st, (int32_t*)x.ot, (float*)x.xst);
    }
}

/* Thread tid of nt: its share of the (column block, tile) tasks of out[M, N] (rows ldo apart),
 * block-major (a block's weights stay in cache over its tiles); `resid`: int8 rows 2i and
 * 2i + 1 are output row i. */
static QG_T512VNNI void qg_q8t_share(const uint8_t* w, const qg_format* f, const qg_tiles* T, long Q,
                                     const float* bias, float* out, long ldo, int resid, int tid, int nt) {
    const long nblocks = (f->n + QG_NB - 1) / QG_NB, bb = qg_block_bytes(f), ng = f->kp / f->group;
    float acc[QG_MR_T * QG_NB] __attribute__((aligned(64)));
    long t0, t1;
    nr_share(nblocks * T->ntiles, tid, nt, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        const long b = t / T->ntiles, i = t % T->ntiles, r0 = i * QG_MR_T;
        int m = (int)(Q - r0 < QG_MR_T ? Q - r0 : QG_MR_T);
        const qg_xt x = qg_tile(T, f, i);
        qg_q8t_vnni(w + b * bb, f, &x, 0, ng, m, acc);
        m = qg_fold_resid(acc, m, resid);  /* m is even with resid: QG_MR_T is */
        qg_store(acc, m, b * QG_NB, f->n, ldo, bias, out + (resid ? r0 / 2 : r0) * ldo);
    }
}

#endif
