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
    if (rp->min_p > 0.0) {
        double thr = rp->min_p * c[0].p;
        int64_t m = L < 0 ? n : L, f = m;
        for (int64_t i = 0; i < m; i++)
            if (!(c[i].p >= thr)) { f = i; break; }
        if (f < m) L = f;
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

/* One non-greedy row; p: [V] f64 scratch, c: [V] scratch pairs. */
static int64_t nr_sample_row(const float *x, int64_t V, const nr_row_params *rp, double *p,
                             nr_pi *c) {
    double zmax = -INFINITY, temp = rp->temperature;
    for (int64_t i = 0; i < V; i++) {
        double z = (double)x[i] / temp;
        p[i] = z;
        zmax = z > zmax ? z : zmax;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < V; i++) { p[i] = exp(p[i] - zmax); sum += p[i]; }
    double total = 0.0, pmax = 0.0;
    for (int64_t i = 0; i < V; i++) {
        p[i] /= sum;
        total += p[i];
        pmax = p[i] > pmax ? p[i] : pmax;
    }
    int64_t n, tok = -1;
    if (rp->k > 0 && rp->k < V) {
        for (int64_t i = 0; i < V; i++) { c[i].p = p[i]; c[i].i = i; }
        nr_select(c, V, rp->k);
        qsort(c, (size_t)rp->k, sizeof(nr_pi), nr_cmp_pi);
        double tk = 0.0;
        for (int64_t i = 0; i < rp->k; i++) tk += c[i].p;
        return nr_pick(c, rp->k, 1, 0.0, tk, rp);
    }
    /* whole vocabulary: candidates above a threshold that covers the mass we need */
    double t;
    if (rp->min_p > 0.0) t = rp->min_p * pmax;
    else if (rp->top_p < 1.0) t = (1.0 - rp->top_p) * total / (2.0 * (double)V);
    else t = (1.0 - rp->u) * total / (2.0 * (double)V);
    if (t > 0.0) {
        n = 0;
        for (int64_t i = 0; i < V; i++)
            if (p[i] >= t) { c[n].p = p[i]; c[n].i = i; n++; }
        qsort(c, (size_t)n, sizeof(nr_pi), nr_cmp_pi);
        tok = nr_pick(c, n, n == V, t, total, rp);
    }
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
