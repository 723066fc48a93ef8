/* Int8-activation GEMM for many rows on AMX-INT8 (Sapphire Rapids and later): matrix tiles.
 *
 * The row tiles of qgemm_q8tile.h spend one vpdpbusd per 64 multiply-adds; an AMX tile
 * multiply (tdpbssd / tdpbsud) does 16 x 16 x 32 = 8192 of them. Operands, per activation
 * block of bk = 32 k (QG_QB), or 16 k in formats of groups of 16 (qg_amx_bk):
 *   A  16 activation rows x bk int8 k, loaded straight from xq (rows kp apart; int2-6 formats
 *      keep xq's k order 0 2 4 6 1 3 5 7, which the B rows below follow);
 *   B  bk / 4 rows of 16 columns x 4 k: int8 weights are the packed rows themselves (signed, so
 *      tdpbssd); int4 rows are split into their low and high nibbles (k 0 2 4 6 and 1 3 5 7 of
 *      each 8) and int2/3/5/6 units merged into the same two byte vectors (qg_hb_merge512):
 *      symmetric codes less their offset 2^(bits-1) (signed, tdpbssd), the NL levels looked up
 *      (signed), the others as they are (unsigned, tdpbsud). So no offset correction -off * xi
 *      is needed.
 *   C  16 x 16 int32: the block's exact integer sums, the very integers the VNNI kernels form.
 * After each block C goes to memory and the float epilogue runs in AVX-512 as in the VNNI
 * kernels (convert, scale product, fused multiply-add per block; the group's c term), in the
 * same order: results are bitwise equal to qg_q8_vnni's and the row tiles', whichever kernel a
 * row ran in. The epilogue (per block, because the activation scales are per block) is most of
 * the instructions; the tile multiply is a few cycles.
 *
 * Formats: every block a full bk k (group a multiple of 32, per channel with K a multiple of
 * 32: every real model's K, or 16), of whole packed units. Others keep the row tiles
 * (qg_amx_fits). `bench/bench_quant.py --decode-batch --model Llama-3.2-1B --formats Q4_0 ...`
 * on a 2-core Sapphire Rapids-class VM: at 16 rows the tiles ran 1.1-2.0x the VNNI row tiles on
 * Q4_0, Q8_0, Q4_K and Q5_K and 1.1-1.5x on the groups of 16 (Q6_K, Q3_K, Q2_K); at 64 rows
 * 1.2-1.7x and 1.0-1.25x (bench/RESULTS.md).
 * Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once
 * per process; oneDNN asks the same); each OpenMP thread loads its tile configuration at the
 * start of its share and releases it at the end.
 */
#ifndef NUMA_RUNTIME_QGEMM_AMX_H
#define NUMA_RUNTIME_QGEMM_AMX_H

#include "amx_tiles.h"

#define QG_TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))
#define QG_MR_AMX 16   /* activation rows per A tile */

/* 1: AMX-INT8 present and granted (qg_amx_init); tests and benchmarks switch it (qgemm._set_amx) */
static int qg_amx = 0;

/* 1 when this CPU has AMX-INT8 and the kernel lets this process use the tile state. */
static int qg_amx_init(void) {
    if (!nr_amx_has(NR_AMX_TILE | NR_AMX_INT8)) return 0;
    if (qg_cpu_level() < 2) return 0;  /* the epilogue and the int4 split: AVX-512 with VNNI */
    return nr_amx_grant();
}

/* k per tile multiply: QG_QB, or 16 for groups of 16 (GGUF Q6_K, Q3_K, Q2_K: their activation
 * blocks are 16 k too, qg_quantize_group). */
static inline long qg_amx_bk(const qg_format* f) { return f->group % QG_QB == 0 ? QG_QB : f->group; }

/* Every block a full qg_amx_bk k (the group, which divides kp, a multiple of 32 (per channel it
 * is kp), or 16), made of whole packed units. */
static inline int qg_amx_fits(const qg_format* f) {
    const long bk = qg_amx_bk(f);
    return (bk == QG_QB || bk == 16) && bk % qg_pack_k(f) == 0;
}

/* Two sets, used alternately by even and odd blocks so that one block's multiply overlaps the
 * previous block's epilogue (tiles are not renamed: reusing one C tile would wait for its
 * store): tmm0/tmm1 C 16 x 16 int32; tmm2/tmm3 A 16 rows x bk bytes; tmm4/tmm5 B bk / 4 rows x 64 (bk: qg_amx_bk). */
static QG_TAMX void qg_amx_config(long bk) {
    nr_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) {
        c.rows[i] = 16; c.colsb[i] = 64;
        c.rows[2 + i] = 16; c.colsb[2 + i] = (uint16_t)bk;
        c.rows[4 + i] = (uint8_t)(bk / 4); c.colsb[4 + i] = 64;
    }
    nr_tile_loadconfig(&c);
}

/* Per 16-row tile, the scalars of its rows in row order (qg_row_scalars), so that the epilogue
 * reads each block's 16 of them from one place, as the VNNI row tiles do: st [nb][16] block
 * scales, xst [ng][16] the group sums xs. Rows past Q are zeros (their sums are not stored). */
typedef struct {
    float* st;
    float* xst;
    long ntiles;
} qg_amx_rows;

/* Bytes of qg_amx_rows for Q int8 rows of format f (qg_forward_q8 and the fused decoder's
 * scratch). */
static size_t qg_amx_rows_bytes(const qg_format* f, long Q) {
    const long ng = f->kp / f->group, nb = ng * qg_blocks_per_group(f), nt = (Q + QG_MR_AMX - 1) / QG_MR_AMX;
    return (size_t)nt * QG_MR_AMX * sizeof(float) * (size_t)(nb + ng) + 2 * 64;
}

static qg_amx_rows qg_amx_rows_at(char* buf, const qg_xq* q, long Q) {
    const long nt = (Q + QG_MR_AMX - 1) / QG_MR_AMX;
    qg_amx_rows t;
    uintptr_t p = ((uintptr_t)buf + 63) & ~(uintptr_t)63;
    t.st = (float*)p;
    p = (p + sizeof(float) * (size_t)(nt * q->nb * QG_MR_AMX) + 63) & ~(uintptr_t)63;
    t.xst = (float*)p;
    t.ntiles = nt;
    return t;
}

/* Thread tid of nt: its tiles' scalars. */
static void qg_amx_rows_fill(const qg_amx_rows* T, const qg_xq* q, long Q, int tid, int nt) {
    for (long i = tid; i < T->ntiles; i += nt)
        for (int r = 0; r < QG_MR_AMX; r++)
            qg_row_scalars(q, Q, i * QG_MR_AMX + r, QG_MR_AMX, r, 0, T->st + i * q->nb * QG_MR_AMX,
                           NULL, T->xst + i * q->ng * QG_MR_AMX);
}

/* NOTE: GCC's tile load and store intrinsics are asm statements without a memory clobber: this
 * compiler barrier keeps the stores of the unpacked B rows before the tile load that reads
 * them, and the loads of the sums after the tile store that writes them. */
#define QG_AMX_FENCE() __asm__ volatile("" ::: "memory")

/* The B rows of a block (block b_ of the group whose rows start at rows_) into bt, for int2-6
 * (int8 rows are B as they are: only their prefetch): int4 rows split into their low and high
 * nibbles, int2/3/5/6 units merged into the same two byte vectors (qg_hb_merge512); symmetric
 * codes less their offset 2^(bits-1) (so signed: the integer the VNNI kernels form with their
 * offset correction), the NL levels looked up (signed), the others unsigned. */
#define QG_AMX_UNPACK(rows_, b_, bt)                                                              \
    {                                                                                             \
        const uint8_t* src_ = (rows_) + (b_) * (bk / pk) * ub;                                   \
        if (qg_pf_bytes)                                                                          \
            for (long l_ = 0; l_ < (bk / pk) * ub; l_ += 64)                                      \
                _mm_prefetch((const char*)src_ + l_ + qg_pf_bytes, _MM_HINT_T0);                  \
        if (bits != 8) {                                                                          \
            for (int i_ = 0; i_ < bk / 8; i_++) {                                                 \
                __m512i lo_, hi_;                                                                 \
                if (bits == 4) {                                                                  \
                    const __m512i v_ = _mm512_loadu_si512((const void*)(src_ + i_ * 64));         \
                    lo_ = _mm512_and_si512(v_, m4);                                               \
                    hi_ = _mm512_and_si512(_mm512_srli_epi32(v_, 4), m4);                         \
                } else {                                                                          \
                    const uint8_t* u_ = src_ + (8 * i_ / pk) * ub;                                \
                    qg_hb_merge512(u_, _mm512_loadu_si512((const void*)u_), bits,                 \
                                   (int)((8 * i_ % pk) / 8), &lo_, &hi_);                         \
                }                                                                                 \
                if (nl) {                                                                         \
                    lo_ = _mm512_shuffle_epi8(nls, lo_);                                          \
                    hi_ = _mm512_shuffle_epi8(nls, hi_);                                          \
                } else if (sym) {                                                                 \
                    lo_ = _mm512_sub_epi8(lo_, soff);                                             \
                    hi_ = _mm512_sub_epi8(hi_, soff);                                             \
                }                                                                                 \
                _mm512_store_si512((void*)((bt) + (2 * i_) * 64), lo_);                           \
                _mm512_store_si512((void*)((bt) + (2 * i_ + 1) * 64), hi_);                       \
            }                                                                                     \
        }                                                                                         \
    }

/* Block bi's bk k: A from xq, B from bt (int2-6, unpacked an iteration earlier: a tile load
 * waits for the stores it reads until they are written to the cache) or the packed int8 rows
 * (rows_, block b_ of the group), C = A . B stored to cb. TC, TA, TB: the tile set. */
#define QG_AMX_MUL(TC, TA, TB, bi, rows_, b_, bt, cb)                                             \
    {                                                                                             \
        _tile_loadd(TA, xa + (bi) * bk, kp);                                                      \
        _tile_zero(TC);                                                                           \
        if (bits != 8) {                                                                          \
            _tile_loadd(TB, (bt), 64);                                                            \
            if (sym || nl) _tile_dpbssd(TC, TA, TB);                                              \
            else _tile_dpbsud(TC, TA, TB);                                                        \
        } else {                                                                                  \
            _tile_loadd(TB, (rows_) + (b_) * (bk / 4) * 64, 64);                                  \
            _tile_dpbssd(TC, TA, TB);                                                             \
        }                                                                                         \
        _tile_stored(TC, (cb), 64);                                                               \
        QG_AMX_FENCE();                                                                           \
    }

/* The epilogue of block bi (sums in cbuf; group meta_, index g_; last_: the group's last
 * block): the VNNI kernels' float operations in their order. */
#define QG_AMX_EPI(bi, cbuf, meta_, g_, last_)                                                    \
    {                                                                                             \
        const __m512 s_ = qg_s512(blk, f, (meta_), (g_));                                          \
        const float* sb_ = st + (bi) * QG_MR_AMX;                                                 \
        _Pragma("GCC unroll 16")                                                                  \
        for (int r = 0; r < QG_MR_AMX; r++)                                                       \
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void*)((cbuf) + r * 16))), \
                                   _mm512_mul_ps(s_, _mm512_set1_ps(sb_[r])), a[r]);              \
        if (has_c && (last_)) {                                                                   \
            const __m512 c_ = qg_c512(blk, f, (meta_), (g_), s_);                                  \
            const float* xg_ = xst + (g_) * QG_MR_AMX;                                            \
            _Pragma("GCC unroll 16")                                                              \
            for (int r = 0; r < QG_MR_AMX; r++) a[r] = _mm512_fmadd_ps(c_, _mm512_set1_ps(xg_[r]), a[r]); \
        }                                                                                         \
    }

/* acc[r * 16 + j] for the 16 rows of tile i and the 16 columns of block blk, all groups.
 * bt: 64-byte aligned 4 x 512-byte scratch (int2-6 B rows); cb: 4 x 1 KiB (C). Software
 * pipelined: each iteration unpacks the B rows of blocks 2p + 2 and 2p + 3, multiplies blocks
 * 2p and 2p + 1 (unpacked the iteration before) on the two tile sets, and runs the epilogue of
 * blocks 2p - 2 and 2p - 1 on sums stored an iteration earlier (a load waits for a tile store
 * until it is written to the cache, and a tile load for vector stores). NOTE: unpacked right
 * before the tile load that read it, int4 at 16 and 64 rows ran about as fast as on the VNNI row
 * tiles (a one-off timing, 2048 x 8192, 2-core Sapphire Rapids-class VM). */
QG_INLINE QG_TAMX void qg_amx_block(const uint8_t* blk, const qg_format* f, const qg_xq* q,
                                    const qg_amx_rows* T, long i, float* acc, uint8_t* bt,
                                    int32_t* cb, const int bits) {
    const long bk = qg_amx_bk(f), pk = qg_pk_of(bits), ub = qg_ub_of(bits);
    const long gb = qg_group_bytes(f), mb = qg_meta_bytes(f), nbg = f->group / bk;
    const long ng = q->ng, nb = q->nb, kp = q->kp, nbk = ng * nbg;
    const int has_c = bits != 8 && qg_has_c(f), sym = bits != 8 && f->kind == QG_SYM;
    const int nl = bits == 4 && f->kind == QG_NL;
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F);
    const __m512i soff = _mm512_set1_epi8((char)(bits != 8 ? 1 << (bits - 1) : 0));
    const __m512i nls = QG_NL_S512();
    const int8_t* xa = q->xq + i * QG_MR_AMX * kp;
    const float* st = T->st + i * nb * QG_MR_AMX;
    const float* xst = T->xst + i * ng * QG_MR_AMX;
    __m512 a[QG_MR_AMX];
    for (int r = 0; r < QG_MR_AMX; r++) a[r] = _mm512_setzero_ps();
    const uint8_t* metas[8];  /* block x: its group's meta, index and block in it, at x & 7 */
    long gs[8], bs[8];
    long g = 0, b = 0;  /* the next block to unpack is block b of group g */
    const uint8_t* meta = qg_groups(blk, f);
#define QG_AMX_NEXT(x)                                                                            \
    {                                                                                             \
        metas[(x) & 7] = meta; gs[(x) & 7] = g; bs[(x) & 7] = b;                                  \
        if (++b == nbg) { b = 0; g++; meta += gb; }                                               \
        QG_AMX_UNPACK(metas[(x) & 7] + mb, bs[(x) & 7], bt + ((x) & 3) * 512)                     \
    }
#define QG_AMX_MUL_AT(x, TC, TA, TB) \
    QG_AMX_MUL(TC, TA, TB, x, metas[(x) & 7] + mb, bs[(x) & 7], bt + ((x) & 3) * 512, cb + ((x) & 3) * 256)
#define QG_AMX_EPI_AT(x) QG_AMX_EPI(x, cb + ((x) & 3) * 256, metas[(x) & 7], gs[(x) & 7], bs[(x) & 7] == nbg - 1)
    if (0 < nbk) QG_AMX_NEXT(0)
    if (1 < nbk) QG_AMX_NEXT(1)
    for (long bi = 0; bi < nbk + 2; bi += 2) {
        if (bi + 2 < nbk) QG_AMX_NEXT(bi + 2)
        if (bi + 3 < nbk) QG_AMX_NEXT(bi + 3)
        QG_AMX_FENCE();
        if (bi < nbk) QG_AMX_MUL_AT(bi, 0, 2, 4)
        if (bi + 1 < nbk) QG_AMX_MUL_AT(bi + 1, 1, 3, 5)
        if (bi >= 2) {
            QG_AMX_EPI_AT(bi - 2)
            if (bi - 1 < nbk) QG_AMX_EPI_AT(bi - 1)
        }
    }
#undef QG_AMX_NEXT
#undef QG_AMX_MUL_AT
#undef QG_AMX_EPI_AT
    for (int r = 0; r < QG_MR_AMX; r++) _mm512_store_ps(acc + r * QG_NB, a[r]);
}
#undef QG_AMX_UNPACK
#undef QG_AMX_MUL
#undef QG_AMX_EPI

/* One function per bit width (qg_amx_block_b<bits>), each compiled on its own (as QG_Q8_INST). */
#define QG_AMX_INST(b)                                                                            \
    static QG_TAMX __attribute__((noinline)) void qg_amx_block_b##b(                              \
        const uint8_t* blk, const qg_format* f, const qg_xq* q, const qg_amx_rows* T, long i,      \
        float* acc, uint8_t* bt, int32_t* cb) {                                                   \
        qg_amx_block(blk, f, q, T, i, acc, bt, cb, b);                                            \
    }
QG_AMX_INST(2)
QG_AMX_INST(3)
QG_AMX_INST(4)
QG_AMX_INST(5)
QG_AMX_INST(6)
QG_AMX_INST(8)
#undef QG_AMX_INST

/* Thread tid of nt: its share of the (column block, 16-row tile) tasks of out[M, N] (rows ldo
 * apart), block-major; `resid`: int8 rows 2i and 2i + 1 are output row i. xq must be readable
 * for 16 rows past any tile's first row (qg_forward_q8 pads it). */
static QG_TAMX void qg_amx_share(const uint8_t* w, const qg_format* f, const qg_xq* q,
                                 const qg_amx_rows* T, long Q, const float* bias, float* out,
                                 long ldo, int resid, int tid, int nt) {
    const long nblocks = (f->n + QG_NB - 1) / QG_NB, bb = qg_block_bytes(f);
    float acc[QG_MR_AMX * QG_NB] __attribute__((aligned(64)));
    int32_t cb[4 * QG_MR_AMX * 16] __attribute__((aligned(64)));
    uint8_t bt[4 * QG_QB / 4 * 64] __attribute__((aligned(64)));
    long t0, t1;
    nr_share(nblocks * T->ntiles, tid, nt, &t0, &t1);
    if (t0 >= t1) return;
    qg_amx_config(qg_amx_bk(f));
    for (long t = t0; t < t1; t++) {
        const long b = t / T->ntiles, i = t % T->ntiles, r0 = i * QG_MR_AMX;
        int m = (int)(Q - r0 < QG_MR_AMX ? Q - r0 : QG_MR_AMX);
        switch (f->bits) {
            case 2: qg_amx_block_b2(w + b * bb, f, q, T, i, acc, bt, cb); break;
            case 3: qg_amx_block_b3(w + b * bb, f, q, T, i, acc, bt, cb); break;
            case 4: qg_amx_block_b4(w + b * bb, f, q, T, i, acc, bt, cb); break;
            case 5: qg_amx_block_b5(w + b * bb, f, q, T, i, acc, bt, cb); break;
            case 6: qg_amx_block_b6(w + b * bb, f, q, T, i, acc, bt, cb); break;
            default: qg_amx_block_b8(w + b * bb, f, q, T, i, acc, bt, cb); break;
        }
        m = qg_fold_resid(acc, m, resid);  /* m is even with resid: Q and QG_MR_AMX are */
        qg_store(acc, m, b * QG_NB, f->n, ldo, bias, out + (resid ? r0 / 2 : r0) * ldo);
    }
    _tile_release();
}

#endif
