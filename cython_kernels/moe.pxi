# MoEExperts: the routed experts of a mixture-of-experts block for a few decode rows in one
# OpenMP region (qgemm_moe.h). Included by qgemm.pyx, whose QLinear internals it reads.

cdef extern from "qgemm_moe.h" nogil:
    ctypedef struct qg_moe_step:
        long M, P, G, k, H, NI
        const float* x
        const uint8_t* const* wg
        const uint8_t* const* wd
        qg_format fg, fd
        const int64_t* gstart
        const int64_t* prow
        const int64_t* rpairs
        const float* coef
        float* out
        int level
        float* gu
        float* act
        float* y
        int8_t* xq_m
        int8_t* xq_g
        int8_t* xq_d
        float* sx_m
        float* xs_m
        float* sx_g
        float* xs_g
        float* sx_d
        float* xs_d
        int32_t* xi_m
        int32_t* xi_g
        int32_t* xi_d
    void qg_moe_run(const qg_moe_step* s)


def _same_format(QLinear a, QLinear b):
    return (a.fmt.bits == b.fmt.bits and a.fmt.kind == b.fmt.kind and a.fmt.group == b.fmt.group
            and a.fmt.kp == b.fmt.kp and a.fmt.n == b.fmt.n and a.fmt.ks == b.fmt.ks)


def moe_experts(gate_ups, downs):
    """MoEExperts over the experts' (gate_up, down) QLinears, or None when they are not all
    int8-activation QLinears without bias of one gate_up and one down format whose packed k is
    their in_features (dense, f32-exact, mixed or profiled experts run op by op)."""
    lins = list(gate_ups) + list(downs)
    if not gate_ups or len(gate_ups) != len(downs):
        return None
    for q in lins:
        if not isinstance(q, QLinear) or not q.act8 or q.act8_residual or (<QLinear>q).bias_arr is not None \
                or (<QLinear>q).fmt.kp != q.in_features:
            return None
    if not all(_same_format(gate_ups[0], q) for q in gate_ups) or not all(_same_format(downs[0], q) for q in downs):
        return None
    if gate_ups[0].out_features != 2 * downs[0].in_features or downs[0].out_features != gate_ups[0].in_features:
        return None
    return MoEExperts(gate_ups, downs)


cdef class MoEExperts:
    """The experts of one MoE block (models/moe.py): forward(x, top, coef, out) runs the rows'
    (row, expert) pairs of a decode step (up to MAX_ROWS rows) in one region, grouped by expert
    (each expert's weights streamed once for its rows), each pair's SwiGLU output scaled by its
    coefficient and summed into its row in expert order; the values of the op-by-op
    int8-activation path up to the order of its k-slice sums."""
    MAX_ROWS = ACT8_DECODE_M_MAX
    cdef const uint8_t** wg_all
    cdef const uint8_t** wd_all
    cdef qg_format fg, fd
    cdef readonly long num_experts, hidden, inter
    cdef object keep

    def __cinit__(self):
        self.wg_all = NULL
        self.wd_all = NULL

    def __dealloc__(self):
        free(self.wg_all)
        free(self.wd_all)

    def __init__(self, gate_ups, downs):
        cdef long E = len(gate_ups), e
        self.wg_all = <const uint8_t**>malloc(sizeof(uint8_t*) * E)
        self.wd_all = <const uint8_t**>malloc(sizeof(uint8_t*) * E)
        if self.wg_all == NULL or self.wd_all == NULL:
            raise MemoryError()
        for e in range(E):
            self.wg_all[e] = <const uint8_t*>cnp.PyArray_DATA((<QLinear>gate_ups[e]).packed)
            self.wd_all[e] = <const uint8_t*>cnp.PyArray_DATA((<QLinear>downs[e]).packed)
        self.fg, self.fd = (<QLinear>gate_ups[0]).fmt, (<QLinear>downs[0]).fmt
        self.num_experts, self.hidden, self.inter = E, gate_ups[0].in_features, downs[0].in_features
        self.keep = (list(gate_ups), list(downs))  # NOTE: the packed arrays the pointers read

    def usable(self, long M):
        """Whether a step's M rows take this path: rows whose experts' QLinears would take int8
        activations (a few rows, or a decode batch of up to MAX_ROWS)."""
        return 0 < M <= ACT8_DECODE_M_MAX and _decode_rows(M)

    def forward(self, x, top, coef, out):
        """x [M, H], out [M, H] f32 (out C-contiguous); top [M, k] the experts of each row,
        coef [M, k] their weights."""
        cdef long M, k, P, G, H = self.hidden, I = self.inter, p
        cdef qg_moe_step s
        xa = np.ascontiguousarray(x, dtype=np.float32)
        ta = np.asarray(top, dtype=np.int64)
        ca = np.asarray(coef, dtype=np.float32)
        if xa.ndim != 2 or xa.shape[1] != H or not _is_c(out, cnp.NPY_FLOAT32, 2) or out.shape[0] != xa.shape[0] \
                or out.shape[1] != H:
            raise ValueError("MoEExperts.forward: x and out must be float32 [M, %d] (out C-contiguous)" % H)
        M = xa.shape[0]
        if ta.ndim != 2 or ta.shape[0] != M or ta.shape[1] < 1 or ca.shape != (<object>ta).shape:
            raise ValueError("MoEExperts.forward: top and coef must be [M, k], k >= 1")
        if (ta < 0).any() or (ta >= self.num_experts).any():
            raise ValueError("MoEExperts.forward: an expert out of range")
        k = ta.shape[1]
        P = M * k
        flat = ta.reshape(-1)
        order = np.argsort(flat, kind="stable")                   # pairs grouped by expert
        experts, gstart = np.unique(flat[order], return_index=True)
        G = experts.shape[0]
        where = np.empty(P, np.int64)
        where[order] = np.arange(P)
        rpairs = np.ascontiguousarray(np.sort(where.reshape(M, k), axis=1))  # each row's pairs in expert order
        gs = np.ascontiguousarray(np.append(gstart, P), dtype=np.int64)
        prow = np.ascontiguousarray(order // k, dtype=np.int64)
        cf = np.ascontiguousarray(ca.reshape(-1)[order], dtype=np.float32)
        cdef long ngg = self.fg.kp // self.fg.group, ngd = self.fd.kp // self.fd.group
        cdef long nbg = ngg * qg_blocks_per_group(&self.fg), nbd = ngd * qg_blocks_per_group(&self.fd)
        gu = np.empty((P, 2 * I), np.float32)
        act = np.empty((P, I), np.float32)
        y = np.empty((P, H), np.float32)
        xq = np.empty((M + P) * self.fg.kp + P * self.fd.kp, np.int8)
        fl = np.empty((M + P) * (nbg + ngg) + P * (nbd + ngd), np.float32)
        xi = np.empty((M + P) * nbg + P * nbd, np.int32)
        wg = np.empty(G, np.uintp)
        wd = np.empty(G, np.uintp)
        cdef const int64_t* ep = <const int64_t*>cnp.PyArray_DATA(np.ascontiguousarray(experts, dtype=np.int64))
        cdef size_t* wgp = <size_t*>cnp.PyArray_DATA(wg)
        cdef size_t* wdp = <size_t*>cnp.PyArray_DATA(wd)
        for p in range(G):
            wgp[p] = <size_t>self.wg_all[ep[p]]
            wdp[p] = <size_t>self.wd_all[ep[p]]
        s.M, s.P, s.G, s.k, s.H, s.NI = M, P, G, k, H, I
        s.x = <const float*>cnp.PyArray_DATA(xa)
        s.wg = <const uint8_t* const*>wgp
        s.wd = <const uint8_t* const*>wdp
        s.fg, s.fd = self.fg, self.fd
        s.gstart = <const int64_t*>cnp.PyArray_DATA(gs)
        s.prow = <const int64_t*>cnp.PyArray_DATA(prow)
        s.rpairs = <const int64_t*>cnp.PyArray_DATA(rpairs)
        s.coef = <const float*>cnp.PyArray_DATA(cf)
        s.out = <float*>cnp.PyArray_DATA(out)
        s.level = _level
        s.gu = <float*>cnp.PyArray_DATA(gu)
        s.act = <float*>cnp.PyArray_DATA(act)
        s.y = <float*>cnp.PyArray_DATA(y)
        s.xq_m = <int8_t*>cnp.PyArray_DATA(xq)
        s.xq_g = s.xq_m + M * self.fg.kp
        s.xq_d = s.xq_g + P * self.fg.kp
        s.sx_m = <float*>cnp.PyArray_DATA(fl)
        s.xs_m = s.sx_m + M * nbg
        s.sx_g = s.xs_m + M * ngg
        s.xs_g = s.sx_g + P * nbg
        s.sx_d = s.xs_g + P * ngg
        s.xs_d = s.sx_d + P * nbd
        s.xi_m = <int32_t*>cnp.PyArray_DATA(xi)
        s.xi_g = s.xi_m + M * nbg
        s.xi_d = s.xi_g + P * nbg
        with nogil:
            qg_moe_run(&s)
        return out
