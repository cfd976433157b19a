"""The MoE dispatch and combine kernels: permute (counting sort of the assignments), route (gating + permute in one
launch, decode batches) and unpermute (the weighted combine in torch's summation order). Contracts and
measurements: ``moe_routing``'s module docstring, items 2-4."""

from ._prim_func_cache import cached_prim_func
from ._tilelang import T, tilelang
from ._moe_gating import SUM_ORDERS, _gating_macro

MAX_SCAN_EXPERTS = 256  # permute's fused scan: one thread an expert, hit count in 9 bits (moe_gemm.MAX_EXPERTS)
MAX_ROUTE_TOKENS = 16  # route (gating + permute in one launch): every CTA gates all T tokens (decode batches)
MAX_ASSIGN = 8192  # permute / unpermute: every CTA scans all T*k assignments (decode and small prefill chunks)


# ---- 2. permute (dispatch) -----------------------------------------------------------------------------------
def _scan_width(num_experts: int) -> int:
    return 1 << max(0, (num_experts - 1).bit_length())  # a power of two >= E, one scan entry a thread


def _permute_macro(hidden_size, top_k, num_experts, dtype, threads, with_scan, Tn, Na):
    """permute's CTA body as a ``@T.macro`` ``body(X, Ids, Sorted, Counts, Order, Scan, bx)`` over ``Tn`` tokens and
    ``Na`` = Tn * k assignments; ``Ids`` [Na] i32 is a global buffer (permute) or a shared one the caller has filled
    before a barrier (build_route)."""
    D, K, E = hidden_size, top_k, num_experts
    VEC = 16 // (2 if dtype == "bfloat16" else 4)
    NTS = _scan_width(E)  # scan width: a power of two >= E, one entry a thread
    # the packed scan keeps the running hit count in 9 bits: at most 256 experts (moe_gemm's MAX_EXPERTS too)
    assert D % VEC == 0 and threads % 32 == 0 and (not with_scan or (E <= MAX_SCAN_EXPERTS and threads >= NTS))
    LOG = (NTS - 1).bit_length()
    NV = D // VEC
    ITERS = (NV + threads - 1) // threads
    NW = threads // 32
    EI = (E + threads - 1) // threads
    i32, i64 = T.int32, T.int64

    @T.macro
    def scan_tail(Scan, s_hist, bx, tid):
        # CTA 0 only (bx is uniform in a CTA, so every thread of it reaches the barriers)
        if bx == 0:
            s_scan = T.alloc_shared([2, NTS], i32)
            own = T.alloc_var(i32)
            incl = T.alloc_var(i32)
            own = 0
            if tid < E:
                own = s_hist[tid] * 512 + T.if_then_else(s_hist[tid] > 0, 1, 0)
            if tid < NTS:
                s_scan[0, tid] = own
            T.sync_threads()
            for st in T.unroll(LOG, explicit=True):
                if tid < NTS:
                    s_scan[(st + 1) % 2, tid] = s_scan[st % 2, tid] + T.if_then_else(
                        tid >= (1 << st), s_scan[st % 2, T.max(tid - (1 << st), 0)], 0)
                T.sync_threads()
            if tid < NTS:
                incl = s_scan[LOG % 2, tid]
            if tid < E:
                Scan[tid] = (incl - own) // 512
                Scan[E + 1 + tid] = -1
            if tid == E - 1:
                Scan[E] = incl // 512
            T.sync_threads()  # the -1 fill before the hits (global writes of one CTA, ordered by the barrier)
            if tid < E:
                if s_hist[tid] > 0:
                    Scan[E + 1 + (incl - own) % 512] = tid

    @T.macro
    def body(X, Ids, Sorted, Counts, Order, Scan, bx):
        tid = T.get_thread_binding()
        s_hist = T.alloc_shared([E], i32)
        s_red = T.alloc_shared([NW * K + K], i32)  # per-warp partial ranks, then the k destination rows
        eid = T.alloc_local([K], i32)
        cnt = T.alloc_local([K], i32)
        row = T.alloc_local([ITERS * VEC], dtype)
        p = T.alloc_var(i32)

        for it in T.unroll(EI, explicit=True):
            if it * threads + tid < E:
                s_hist[it * threads + tid] = 0
        for j in T.unroll(K, explicit=True):
            eid[j] = Ids[bx * K + j]
            cnt[j] = 0
        for it in T.unroll(ITERS, explicit=True):  # the token's row, loaded once, stored k times
            if it * threads + tid < NV:
                for v in T.vectorized(VEC):
                    row[it * VEC + v] = X[bx, (it * threads + tid) * VEC + v]
        T.sync_threads()
        for it in T.serial(T.ceildiv(Na, threads)):
            b = it * threads + tid
            if b < Na:
                e = Ids[b]
                if (e >= 0) & (e < E):
                    T.atomic_add(s_hist[e], 1)
                for j in T.unroll(K, explicit=True):
                    cnt[j] = cnt[j] + T.if_then_else((e < eid[j]) | ((e == eid[j]) & (b < bx * K + j)), 1, 0)
        for j in T.unroll(K, explicit=True):
            cnt[j] = T.warp_reduce_sum(cnt[j])
            if tid % 32 == 0:
                s_red[(tid // 32) * K + j] = cnt[j]
        T.sync_threads()
        if tid < K:
            p = 0
            for w in T.unroll(NW, explicit=True):
                p = p + s_red[w * K + tid]
            s_red[NW * K + tid] = p
            if p < Na:
                Order[p] = T.Cast(i64, bx * K + tid)
        for it in T.unroll(EI, explicit=True):  # expert e's count is written by CTA e % T
            if it * threads + tid < E:
                if (it * threads + tid) % Tn == bx:
                    Counts[it * threads + tid] = T.Cast(i64, s_hist[it * threads + tid])
        T.sync_threads()
        for j in T.unroll(K, explicit=True):
            if s_red[NW * K + j] < Na:
                for it in T.unroll(ITERS, explicit=True):
                    if it * threads + tid < NV:
                        for v in T.vectorized(VEC):
                            Sorted[s_red[NW * K + j], (it * threads + tid) * VEC + v] = row[it * VEC + v]
        if with_scan:
            T.sync_threads()  # s_red's last reads above before the scan's shared buffer (TileLang may overlap them)
            scan_tail(Scan, s_hist, bx, tid)

    return body


@cached_prim_func
def build_permute(hidden_size: int, top_k: int, num_experts: int, dtype: str = "bfloat16", threads: int = 128,
                  with_scan: bool = False):
    """PrimFunc (x [T, D], ids [N] i32, sorted [N, D] out, counts [E] i64 out, order [N] i64 out), N = T * k.
    ``with_scan``: also scan [2E + 1] i32 out, ``moe_gemm.expert_starts``' layout (the exclusive scan of the counts,
    then the experts with rows, ascending, -1 padded), written by CTA 0 from the histogram every CTA builds, so
    the expert GEMMs need no scan launch of their own. One Hillis-Steele scan in shared memory over packed values
    ``count * 512 + (count > 0)`` gives both the row starts and the hit positions (counts <= MAX_ASSIGN < 2^22)."""
    assert tilelang is not None, "tilelang is not installed"
    D, K, E = hidden_size, top_k, num_experts
    if with_scan:
        threads = max(threads, _scan_width(E))
    i32, i64 = T.int32, T.int64
    Tn = T.dynamic("num_tokens")
    Na = T.dynamic("num_assign")
    body = _permute_macro(D, K, E, dtype, threads, with_scan, Tn, Na)
    if with_scan:

        @T.prim_func
        def moe_permute_scan(
            X: T.Tensor([Tn, D], dtype),
            Ids: T.Tensor([Na], i32),
            Sorted: T.Tensor([Na, D], dtype),
            Counts: T.Tensor([E], i64),
            Order: T.Tensor([Na], i64),
            Scan: T.Tensor([2 * E + 1], i32),
        ):
            with T.Kernel(Tn, threads=threads) as bx:
                T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
                T.pdl_trigger()
                body(X, Ids, Sorted, Counts, Order, Scan, bx)

        return moe_permute_scan

    @T.prim_func
    def moe_permute(
        X: T.Tensor([Tn, D], dtype),
        Ids: T.Tensor([Na], i32),
        Sorted: T.Tensor([Na, D], dtype),
        Counts: T.Tensor([E], i64),
        Order: T.Tensor([Na], i64),
    ):
        with T.Kernel(Tn, threads=threads) as bx:
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            body(X, Ids, Sorted, Counts, Order, None, bx)

    return moe_permute


# ---- 2b. route: gating + permute(with_scan) in one launch (decode batches) --------------------------------------
@cached_prim_func
def build_route(
    hidden_size: int,
    top_k: int,
    num_experts: int,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    norm_order: str = "torch_last",
    has_bias: bool = True,
    dtype: str = "bfloat16",
    threads: int = 128,
):
    """PrimFunc (logits [T, E] f32, bias [E] f32, x [T, D], weights [T, k] f32 out, ids [T, k] i32 out,
    sorted [N, D] out, counts [E] i64 out, order [N] i64 out, scan [2E + 1] i32 out), N = T * k, T <=
    MAX_ROUTE_TOKENS: ``gating_topk`` then ``permute(with_scan=True)`` in one launch. One CTA a token (the permute
    body's grid); warp w of every CTA first runs the gating of tokens w, w + NW, ... (``_gating_macro``, the
    standalone kernel's code, its own slice of the shared scratch; a uniform trip count ceil(T / NW), idle warps
    redo token T - 1 and write nothing, so every thread reaches every barrier) into a shared ids buffer (CTA 0
    also writes weights / ids to global memory), then a barrier and the permute body reads the ids from shared
    memory. Each CTA recomputes all T gatings (T <= 16: at most ceil(16 / NW) warp-gatings a warp)."""
    assert tilelang is not None, "tilelang is not installed"
    D, K, E = hidden_size, top_k, num_experts
    threads = max(threads, _scan_width(E))
    NW = threads // 32
    gating_token = _gating_macro(E, K, scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
                                 routed_scaling_factor, norm_order, has_bias)
    f32, u32, i32, i64 = T.float32, T.uint32, T.int32, T.int64
    Tn = T.dynamic("num_tokens")
    Na = T.dynamic("num_assign")
    body = _permute_macro(D, K, E, dtype, threads, True, Tn, Na)

    @T.prim_func
    def moe_route(
        L: T.Tensor([Tn, E], f32),
        Bias: T.Tensor([E], f32),
        X: T.Tensor([Tn, D], dtype),
        W: T.Tensor([Tn, K], f32),
        Ids: T.Tensor([Tn, K], i32),
        Sorted: T.Tensor([Na, D], dtype),
        Counts: T.Tensor([E], i64),
        Order: T.Tensor([Na], i64),
        Scan: T.Tensor([2 * E + 1], i32),
    ):
        with T.Kernel(Tn, threads=threads) as bx:
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            wo = T.alloc_local([K], f32)
            io = T.alloc_local([K], i32)
            s_ids = T.alloc_shared([MAX_ROUTE_TOKENS * K], i32)
            s_c = T.alloc_shared([NW * E], f32)  # one E-slice a warp
            s_w = T.alloc_shared([NW * E], f32)
            s_g = T.alloc_shared([NW * 32], u32)
            s_sel = T.alloc_shared([NW * 32], i32)
            for r in T.serial(T.ceildiv(Tn, NW)):  # the same trip count in every warp: the macro's barriers match
                tok = r * NW + wid
                gating_token(L, Bias, T.min(tok, Tn - 1), lane, wid * E, wid * 32, s_c, s_w, s_g, s_sel, wo, io)
                if (lane == 0) & (tok < Tn):
                    for j in T.unroll(K, explicit=True):
                        s_ids[tok * K + j] = io[j]
                    if bx == 0:
                        for j in T.unroll(K, explicit=True):
                            W[tok, j] = wo[j]
                            Ids[tok, j] = io[j]
                T.sync_threads()  # s_w's reads of this round before the next round's writes (other lanes)
            body(X, s_ids, Sorted, Counts, Order, Scan, bx)

    return moe_route


# ---- 3. unpermute (combine) ----------------------------------------------------------------------------------
@cached_prim_func
def build_unpermute(
    hidden_size: int, top_k: int, dtype: str = "bfloat16", sum_order: str = "torch_strided", threads: int = 128,
    with_addend: bool = False, by_position: bool = False,
):
    """PrimFunc (expert_out [N, D], order [N] i64, weights [T, k] f32, out [T, D] out), N = T * k; ``with_addend``:
    (expert_out, order, weights, addend [T, D], out) and out = addend + the combine, added as torch adds two tensors
    of ``dtype`` (the combine rounded to ``dtype`` first, the sum in fp32, rounded once more): the MoE layer's
    ``routed + shared`` without its own launch. ``by_position``: the second argument is the inverse of the order,
    positions [N] i32 (the row of assignment t*k + j), read directly instead of scanned for: O(N) work, any N."""
    assert tilelang is not None, "tilelang is not installed"
    D, K = hidden_size, top_k
    VEC = 16 // (2 if dtype == "bfloat16" else 4)
    assert D % VEC == 0 and threads % 32 == 0
    NV = D // VEC
    ITERS = (NV + threads - 1) // threads
    sum_fn = SUM_ORDERS[sum_order]
    f32, i32, i64 = T.float32, T.int32, T.int64
    Tn = T.dynamic("num_tokens")
    Na = T.dynamic("num_assign")
    index = i32 if by_position else i64  # positions (the inverse) or the order itself

    @T.macro
    def body(Y, Order, W, Add, Out, bx):
        tid = T.get_thread_binding()
        s_pos = T.alloc_shared([K], i32)
        pos = T.alloc_local([K], i32)
        w = T.alloc_local([K], f32)
        xb = T.alloc_local([K * VEC], dtype)
        ob = T.alloc_local([VEC], dtype)

        if by_position:
            for j in T.unroll(K, explicit=True):
                pos[j] = Order[bx * K + j]
                w[j] = W[bx, j]
        else:
            for it in T.serial(T.ceildiv(Na, threads)):  # invert the order for this token's k assignments
                if it * threads + tid < Na:
                    a = Order[it * threads + tid]
                    if (a >= T.Cast(i64, bx * K)) & (a < T.Cast(i64, bx * K + K)):
                        s_pos[T.Cast(i32, a - T.Cast(i64, bx * K))] = it * threads + tid
            T.sync_threads()
            for j in T.unroll(K, explicit=True):
                pos[j] = s_pos[j]
                w[j] = W[bx, j]
        for it in T.unroll(ITERS, explicit=True):
            if it * threads + tid < NV:
                for j in T.unroll(K, explicit=True):
                    for v in T.vectorized(VEC):
                        xb[j * VEC + v] = Y[pos[j], (it * threads + tid) * VEC + v]
                for v in T.unroll(VEC, explicit=True):
                    ob[v] = T.Cast(dtype, sum_fn([T.Cast(f32, xb[j * VEC + v]) * w[j] for j in range(K)]))
                if with_addend:
                    for v in T.unroll(VEC, explicit=True):
                        ob[v] = T.Cast(dtype, T.Cast(f32, ob[v]) + T.Cast(f32, Add[bx, (it * threads + tid) * VEC + v]))
                for v in T.vectorized(VEC):
                    Out[bx, (it * threads + tid) * VEC + v] = ob[v]

    if with_addend:

        @T.prim_func
        def moe_unpermute_add(
            Y: T.Tensor([Na, D], dtype),
            Order: T.Tensor([Na], index),
            W: T.Tensor([Tn, K], f32),
            Add: T.Tensor([Tn, D], dtype),
            Out: T.Tensor([Tn, D], dtype),
        ):
            with T.Kernel(Tn, threads=threads) as bx:
                T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
                T.pdl_trigger()
                body(Y, Order, W, Add, Out, bx)

        return moe_unpermute_add

    @T.prim_func
    def moe_unpermute(
        Y: T.Tensor([Na, D], dtype),
        Order: T.Tensor([Na], index),
        W: T.Tensor([Tn, K], f32),
        Out: T.Tensor([Tn, D], dtype),
    ):
        with T.Kernel(Tn, threads=threads) as bx:
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            body(Y, Order, W, None, Out, bx)

    return moe_unpermute
