/* How many slices along k to cut each column block of a decode GEMV into, so that a static
 * schedule of nblocks * slices equal tasks keeps nt threads evenly busy.
 *
 * NOTE: a static schedule, not a dynamic one: on 16 cores a dynamic schedule's shared counter
 * (one contended atomic per chunk, ~0.1 us each across the mesh) and the extra barrier cost
 * several microseconds per call, more than a small decode GEMV takes to stream its weights
 * (bench/RESULTS.md, "fixed cost per call"). Slicing adds a pass that sums the partials (one
 * more barrier), so a block is sliced only when whole blocks would leave threads idle for
 * more than `tol` of the call: the smallest slice count within `tol` of a perfect balance,
 * else the best one up to max_slices. */
#ifndef NUMA_RUNTIME_SPLIT_H
#define NUMA_RUNTIME_SPLIT_H

/* thread t of nt takes the contiguous tasks [*lo, *hi) of n (a static schedule's share) */
static inline void nr_share(long n, long t, long nt, long* lo, long* hi) {
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

/* the busiest thread's tasks over the mean, for `ntask` equal tasks on `nt` threads */
static inline double nr_imbalance(long ntask, long nt) {
    return (double)((ntask + nt - 1) / nt) * (double)nt / (double)ntask;
}

static inline long nr_split_count(long nblocks, long nt, long max_slices, double tol) {
    if (nt <= 1 || nblocks <= 0 || max_slices <= 1) return 1;
    long best = 1;
    double best_im = nr_imbalance(nblocks, nt);
    if (best_im <= 1.0 + tol) return 1;
    for (long s = 2; s <= max_slices; s++) {
        const double im = nr_imbalance(nblocks * s, nt);
        if (im <= 1.0 + tol) return s;
        if (im < best_im - 1e-9) {
            best = s;
            best_im = im;
        }
    }
    return best;
}

#endif
