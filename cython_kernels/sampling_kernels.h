/* Sampling and log_softmax behind sampling.pyx.
 *
 * sample() follows reference.sample step by step in f64: p = softmax(logits / T), order by
 * (p descending, index ascending), top_k, top_p, min_p, inverse-CDF pick with the given
 * uniform. Instead of sorting the vocabulary it sorts only a candidate prefix of that order:
 * the exact top_k set (quickselect) when top_k is on, else the tokens above a probability
 * threshold; whenever a step would need a token past the candidates the row falls back to a
 * full sort, so the result never depends on the shortcut.
 */
#ifndef NR_SAMPLING_KERNELS_H
#define NR_SAMPLING_KERNELS_H

#include <stdlib.h>
#include <omp.h>
#include "ops_math.h"

typedef struct { double p; int64_t i; } nr_pi;

/* a precedes b in the reference order */
static inline int nr_before(const nr_pi *a, const nr_pi *b) {
    return a->p > b->p || (a->p == b->p && a->i < b->i);
}

static int nr_cmp_pi(const void *x, const void *y) {
    const nr_pi *a = (const nr_pi *)x, *b = (const nr_pi *)y;
    return nr_before(a, b) ? -1 : (nr_before(b, a) ? 1 : 0);
}

/* Reorders c so that c[0..k) holds the k first elements of the order (unsorted). */
static void nr_select(nr_pi *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, t = k - 1;
    while (hi > lo) {
        int64_t mid = lo + (hi - lo) / 2;
        nr_pi a = c[lo], b = c[mid], d = c[hi], piv;
        if (nr_before(&a, &b)) piv = nr_before(&b, &d) ? b : (nr_before(&a, &d) ? d : a);
        else piv = nr_before(&a, &d) ? a : (nr_before(&b, &d) ? d : b);
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (nr_before(&c[i], &piv)) i++;
            while (nr_before(&piv, &c[j])) j--;
            if (i <= j) { nr_pi tmp = c[i]; c[i] = c[j]; c[j] = tmp; i++; j--; }
        }
        if (t <= j) hi = j;
        else if (t >= i) lo = i;
        else break;
    }
}

static int64_t nr_argmax(const float *x, int64_t V) {
    int64_t best = 0;
    float bv = x[0];
    if (bv != bv) return 0;
    for (int64_t i = 1; i < V; i++) {
        if (x[i] != x[i]) return i;  /* numpy: the first NaN wins */
        if (x[i] > bv) { bv = x[i]; best = i; }
    }
    return best;
}

typedef struct { double temperature, top_p, min_p, u; int64_t k; } nr_row_params;

/* Runs the reference steps on the sorted candidates c[0..n) (the true first n of the
 * order). complete: c is the whole top_k list. t: every token outside c has p < t.
 * total_k: mass of the whole top_k list. Returns the token, or -1 when c is too short. */
static int64_t nr_pick(const nr_pi *c, int64_t n, int complete, double t, double total_k,
                       const nr_row_params *rp) {
    int64_t L = complete ? n : -1;  /* -1: the kept list extends past c */
    if (rp->top_p < 1.0) {
        double cum = 0.0;
        int64_t cut = -1;
        for (int64_t i = 0; i < n; i++) {
            cum += c[i].p;
            if (cum / total_k >= rp->top_p) { cut = i + 1; break; }
        }
        if (cut > 0) L = cut;
    }
    if (rp->min_p > 0.0 && n > 0) {
        double thr = rp->min_p * c[0].p;
        int64_t m = L < 0 ? n : L, f = m;
        for (int64_t i = 0; i < m; i++)
            if (!(c[i].p >= thr)) { f = i; break; }
        /* NOTE: the most likely token is always kept (f = 0 only when its p is NaN: a NaN or
         * +inf logit; L = 0 read c[-1], an id outside the vocabulary) */
        if (f < m) L = f > 0 ? f : 1;
        else if (L < 0 && t <= thr) L = n;  /* everything past c is below thr */
    }
    double total;
    int64_t m = L < 0 ? n : L;
    if (L < 0) {
        if (rp->top_p < 1.0 || rp->min_p > 0.0) return -1;
        total = total_k;  /* the whole vocabulary is kept */
    } else {
        total = 0.0;
        for (int64_t i = 0; i < L; i++) total += c[i].p;
    }
    double target = rp->u * total, cum = 0.0;
    for (int64_t i = 0; i < m; i++) {
        cum += c[i].p;
        if (cum > target) return c[i].i;
    }
    return L < 0 ? -1 : c[L - 1].i;
}

/* exp(x) in f64 for x <= 0 (softmax arguments): Taylor to degree 13 after reduction by
 * ln 2, ~1-2 ulp, vectorisable; denormal results kept, 0 below -745.2 as in libm. */
#pragma omp declare simd notinbranch
static inline double nr_exp_f64(double x) {
    double xc = x < -745.0 ? -745.0 : (x > 0.0 ? 0.0 : x);
    double n = __builtin_rint(xc * 1.4426950408889634);
    double r = xc - n * 6.93147180369123816490e-01 - n * 1.90821492927058770002e-10;
    double y = 1.0 / 6227020800.0;
    y = y * r + 1.0 / 479001600.0;
    y = y * r + 1.0 / 39916800.0;
    y = y * r + 1.0 / 3628800.0;
    y = y * r + 1.0 / 362880.0;
    y = y * r + 1.0 / 40320.0;
    y = y * r + 1.0 / 5040.0;
    y = y * r + 1.0 / 720.0;
    y = y * r + 1.0 / 120.0;
    y = y * r + 1.0 / 24.0;
    y = y * r + 1.0 / 6.0;
    y = y * r + 0.5;
    y = y * r + 1.0;
    y = y * r + 1.0;
    int64_t ni = (int64_t)n, h = ni / 2;  /* 2^n as two factors: n may reach -1075 */
    union { uint64_t u; double d; } a, b;
    a.u = (uint64_t)(h + 1023) << 52;
    b.u = (uint64_t)(ni - h + 1023) << 52;
    y = y * a.d * b.d;
    return x < -745.2 ? 0.0 : y;
}

#define NR_NBUCKET 2048   /* log-probability histogram: bucket b holds zmax - z in [b, b+1)/32 */
#define NR_BUCKET_W 32.0

/* c[0..n) = every token with p >= t, in the reference order. */
/* top_k keeps every token tied with the k-th, as vLLM (it masks only logits below the k-th):
 * c[0..k) sorted, c[k..n) the rest; ties move up to c[k..), sorted. Returns the kept count. */
static int64_t nr_keep_ties(nr_pi *c, int64_t n, int64_t k) {
    int64_t kk = k;
    double pk = c[k - 1].p;
    for (int64_t i = k; i < n; i++)
        if (c[i].p == pk) { nr_pi tmp = c[kk]; c[kk] = c[i]; c[i] = tmp; kk++; }
    if (kk > k + 1) qsort(c + k, (size_t)(kk - k), sizeof(nr_pi), nr_cmp_pi);
    return kk;
}

static int64_t nr_collect(const double *p, int64_t V, double t, nr_pi *c) {
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++)
        if (p[i] >= t) { c[n].p = p[i]; c[n].i = i; n++; }
    qsort(c, (size_t)n, sizeof(nr_pi), nr_cmp_pi);
    return n;
}

/* Sorted candidates c[0..n): every token with p >= t, where t is the lower edge of the first
 * histogram bucket at which the counts reach `need_count` or the mass reaches `need_mass`. */
static int64_t nr_candidates(const double *p, int64_t V, const double *mass, const int64_t *cnt,
                             int64_t need_count, double need_mass, double sum, nr_pi *c,
                             double *t_out) {
    double m = 0.0;
    int64_t k = 0, b = 0;
    for (; b < NR_NBUCKET - 1; b++) {
        m += mass[b];
        k += cnt[b];
        if ((need_count > 0 && k >= need_count) || (need_count <= 0 && m >= need_mass)) break;
    }
    double t = b >= NR_NBUCKET - 1 ? 0.0
             : exp(-(double)(b + 1) / NR_BUCKET_W) / sum * (1.0 - 1e-9);
    *t_out = t;
    return nr_collect(p, V, t, c);
}

/* One non-greedy row; p: [V] f64 scratch, c: [V] scratch pairs. */
static int64_t nr_sample_row(const float *x, int64_t V, const nr_row_params *rp, double *p,
                             nr_pi *c) {
    double zmax = -INFINITY, temp = rp->temperature;
    #pragma omp simd reduction(max:zmax)
    for (int64_t i = 0; i < V; i++) {
        double z = (double)x[i] / temp;
        p[i] = z;
        zmax = z > zmax ? z : zmax;
    }
    double sum = 0.0, mass[NR_NBUCKET];
    int64_t cnt[NR_NBUCKET];
    memset(mass, 0, sizeof(mass));
    memset(cnt, 0, sizeof(cnt));
    #pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < V; i++) { p[i] = nr_exp_f64(p[i] - zmax); sum += p[i]; }
    double total = 0.0, pmax = 0.0;
    #pragma omp simd reduction(+:total) reduction(max:pmax)
    for (int64_t i = 0; i < V; i++) {
        p[i] /= sum;
        total += p[i];
        pmax = p[i] > pmax ? p[i] : pmax;
    }
    int64_t n, tok = -1, k = rp->k > 0 && rp->k < V ? rp->k : 0;
    double t = 0.0;
    if (rp->min_p > 0.0 && rp->top_p < 1.0) {
        /* vLLM V1's order: min_p first (relative to the most likely token), then top_k, then
         * top_p over the mass that is left (with top_p off the order changes nothing: min_p
         * and top_k both keep a prefix of the sorted tokens) */
        n = nr_collect(p, V, rp->min_p * pmax, c);
        if (n > 0) {  /* NOTE: 0 only for a NaN pmax: the path below handles it */
            if (k > 0 && k < n) n = nr_keep_ties(c, n, k);
            double kept = 0.0;
            for (int64_t i = 0; i < n; i++) kept += c[i].p;
            nr_row_params top_p_only = *rp;
            top_p_only.min_p = 0.0;
            return nr_pick(c, n, 1, 0.0, kept, &top_p_only);
        }
    }
    if (k > 0) {
        for (int64_t i = 0; i < V; i++) {
            double d = (zmax - ((double)x[i] / temp)) * NR_BUCKET_W;
            cnt[d < (double)(NR_NBUCKET - 1) ? (int64_t)d : NR_NBUCKET - 1]++;
        }
        n = nr_candidates(p, V, mass, cnt, k, 0.0, sum, c, &t);
        if (n < k) {  /* rounding at the edge: exact selection instead */
            for (int64_t i = 0; i < V; i++) { c[i].p = p[i]; c[i].i = i; }
            nr_select(c, V, k);
            qsort(c, (size_t)k, sizeof(nr_pi), nr_cmp_pi);
            n = V;
        }
        int64_t kept = nr_keep_ties(c, n, k);
        double tk = 0.0;
        for (int64_t i = 0; i < kept; i++) tk += c[i].p;
        return nr_pick(c, kept, 1, 0.0, tk, rp);
    }
    /* whole vocabulary: candidates covering the mass the later steps look at */
    if (rp->min_p > 0.0 && rp->top_p >= 1.0) {  /* min_p alone: its threshold decides */
        t = rp->min_p * pmax;
        n = nr_collect(p, V, t, c);
    } else {
        for (int64_t i = 0; i < V; i++) {
            double d = (zmax - ((double)x[i] / temp)) * NR_BUCKET_W;
            mass[d < (double)(NR_NBUCKET - 1) ? (int64_t)d : NR_NBUCKET - 1] += p[i];
        }
        double need = rp->top_p < 1.0 ? rp->top_p * total : rp->u * total;
        n = nr_candidates(p, V, mass, cnt, 0, need * (1.0 + 1e-9), sum, c, &t);
    }
    if (rp->min_p > 0.0 && rp->min_p * pmax > t) {
        double thr = rp->min_p * pmax;
        while (n > 0 && c[n - 1].p < thr) n--;  /* c is sorted: drop the tail below min_p */
        t = thr;
    }
    tok = nr_pick(c, n, n == V, t, total, rp);
    if (tok < 0) {  /* fallback: the reference's full sort */
        for (int64_t i = 0; i < V; i++) { c[i].p = p[i]; c[i].i = i; }
        qsort(c, (size_t)V, sizeof(nr_pi), nr_cmp_pi);
        tok = nr_pick(c, V, 1, 0.0, total, rp);
    }
    return tok;
}

static int nr_sample(const float *logits, int64_t ls, int64_t N, int64_t V, const float *temp,
                     const int32_t *top_k, const float *top_p, const float *min_p,
                     const double *uniform, int64_t *ids) {
    int err = 0;
    #pragma omp parallel if (N > 1)
    {
        double *p = NULL;
        nr_pi *c = NULL;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < N; r++) {
            const float *x = logits + r * ls;
            if (!(temp[r] > 0.0f)) { ids[r] = nr_argmax(x, V); continue; }
            if (p == NULL) {
                p = (double *)malloc((size_t)V * sizeof(double));
                c = (nr_pi *)malloc((size_t)V * sizeof(nr_pi));
                if (p == NULL || c == NULL) {
                    #pragma omp atomic write
                    err = 1;
                    continue;
                }
            }
            nr_row_params rp = {temp[r], top_p[r], min_p[r], uniform[r],
                                top_k[r] > 0 ? (int64_t)top_k[r] : 0};
            ids[r] = nr_sample_row(x, V, &rp, p, c);
        }
        free(p);
        free(c);
    }
    return err;
}

static void nr_log_softmax(const float *x, int64_t xs, int64_t N, int64_t V, float *out,
                           int64_t os) {
    #pragma omp parallel for schedule(static) if (N * V > 65536 && N > 1)
    for (int64_t r = 0; r < N; r++) {
        const float *xr = x + r * xs;
        float *o = out + r * os;
        float m = -INFINITY, s = 0.0f;
        #pragma omp simd reduction(max:m)
        for (int64_t i = 0; i < V; i++) m = xr[i] > m ? xr[i] : m;
        #pragma omp simd reduction(+:s)
        for (int64_t i = 0; i < V; i++) s += nr_expf(xr[i] - m);
        float lse = logf(s) + m;
        #pragma omp simd
        for (int64_t i = 0; i < V; i++) o[i] = xr[i] - lse;
    }
}

#endif
