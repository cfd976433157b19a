"""The MoE gating top-k kernel (``moe_routing.gating_topk``): router logits [T, E] fp32 -> weights and ids.
Bit-identity with torch's softmax, topk and sum orders: ``moe_routing``'s module docstring, item 1. The gating
macro is shared, unchanged, with the fused route kernel (``_moe_permute.build_route``)."""

from ._prim_func_cache import cached_prim_func
from ._tilelang import T, tilelang

MAX_EXPERTS = 256  # gating: one warp per token, E / 32 slots a lane
MAX_TOP_K = 16
METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORINGS = ("softmax", "sigmoid")


def _last_pow2(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


# ---- summation orders (Python-side expression builders, evaluated while the kernel is parsed) -----------------
def _sum_last_dim_torch(vals):
    """torch's CUDA sum over a contiguous last dim of size k <= 32 (Reduce.cuh): block.x = last_pow2(k) threads,
    thread x sums elements x, x + block.x (ident 0, exact), then ``block_x_reduce``'s shfl_down tree with offsets
    block.x / 2, ..., 2, 1 (decreasing on CUDA builds since 2025; ROCm keeps 1, 2, 4, ...). Measured on the H200
    (torch 2.11): the increasing tree and the sequential sum both differ by 2-3 ulp from torch."""
    k = len(vals)
    bw = _last_pow2(k)
    r = [vals[x] + vals[x + bw] if x + bw < k else vals[x] for x in range(bw)]
    off = bw // 2
    while off >= 1:
        for x in range(off):
            r[x] = r[x] + r[x + off]
        off //= 2
    return r[0]


def _sum_strided_dim_torch(vals):
    """torch's CUDA sum over a strided (non-innermost) dim of size k: one thread per output, four interleaved
    accumulators (vt0 = 4) filled in chunks of four, the tail into accumulators 0, 1, ..., then ((a0+a1)+a2)+a3.
    The identity adds (0 + x) are exact and left out."""
    k = len(vals)
    acc = [None] * 4
    full = (k // 4) * 4
    for c in range(0, full, 4):
        for i in range(4):
            acc[i] = vals[c + i] if acc[i] is None else acc[i] + vals[c + i]
    for i, v in enumerate(vals[full:]):
        acc[i] = v if acc[i] is None else acc[i] + v
    out = None
    for a in acc:
        if a is not None:
            out = a if out is None else out + a
    return out


def _sum_sequential(vals):
    out = vals[0]
    for v in vals[1:]:
        out = out + v
    return out


SUM_ORDERS = {"torch_last": _sum_last_dim_torch, "torch_strided": _sum_strided_dim_torch, "seq": _sum_sequential}


# ---- 1. gating top-k -----------------------------------------------------------------------------------------
def _radix_key(v):
    """float32 -> uint32 in torch's topk radix order (TopKTypeConfig<float>::convert): NaN largest."""
    b = T.reinterpret(v, "uint32")
    flipped = T.if_then_else((b & T.uint32(0x80000000)) != T.uint32(0), ~b, b | T.uint32(0x80000000))
    return T.if_then_else(T.isnan(v), T.uint32(0xFFFFFFFF), flipped)


def _gating_macro(
    num_experts: int,
    top_k: int,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    norm_order: str = "torch_last",
    has_bias: bool = True,
):
    """The gating of one token by one warp, as a ``@T.macro``: ``gating_token(L, Bias, row, lane, sb, gb, s_c, s_w,
    s_g, s_sel, wo, io)`` reads logits row ``row`` (lane ``lane`` of the warp holds experts ``lane + 32 i``) and
    leaves the k weights / ids, in torch.topk(sorted=False)'s order, in the local arrays ``wo`` [k] f32 / ``io`` [k]
    i32 of every lane. Shared scratch: ``s_c`` / ``s_w`` [sb, sb + E) f32, ``s_g`` u32 / ``s_sel`` i32 [gb, gb + 32).
    It calls ``T.sync_threads()`` (4 times grouped, once greedy): every thread of the CTA must run it."""
    E, K, G, TG = num_experts, top_k, n_group, topk_group
    assert E % 32 == 0 and E <= MAX_EXPERTS and 1 <= K <= min(E, MAX_TOP_K)
    assert scoring_func in SCORINGS and topk_method in METHODS
    grouped = topk_method != "greedy"
    if grouped:
        assert E % G == 0 and 1 <= TG <= G <= 32
    VPT, PG = E // 32, E // max(G, 1)
    if topk_method == "noaux_tc":
        assert PG >= 2, "noaux_tc ranks groups by their top-2 sum"
    rsf = float(routed_scaling_factor)
    sum_fn = SUM_ORDERS[norm_order]
    f32, u32, u64, i32 = T.float32, T.uint32, T.uint64, T.int32
    softmax, noaux = scoring_func == "softmax", topk_method == "noaux_tc"

    @T.macro
    def gating_token(L, Bias, row, lane, sb, gb, s_c, s_w, s_g, s_sel, wo, io):
        x = T.alloc_local([VPT], f32)  # scores
        c = T.alloc_local([VPT], f32)  # selection values (biased / group-masked)
        key = T.alloc_local([VPT], u64)
        pk = T.alloc_local([K], u32)  # picks: radix key, expert index, output slot
        pi = T.alloc_local([K], i32)
        pos = T.alloc_local([K], i32)
        mx = T.alloc_var(f32)
        sm = T.alloc_var(f32)
        best = T.alloc_var(u64)
        m1 = T.alloc_var(f32)
        m2 = T.alloc_var(f32)
        rank = T.alloc_var(i32)
        tot = T.alloc_var(f32)

        for i in T.unroll(VPT, explicit=True):
            x[i] = L[row, i * 32 + lane]
        if softmax:  # torch softmax_warp_forward, bit for bit
            mx = x[0]
            for i in T.unroll(1, VPT, explicit=True):
                mx = T.if_then_else(mx > x[i], mx, x[i])
            for o in T.unroll(5, explicit=True):
                other = T.shfl_xor(mx, 16 >> o)
                mx = T.if_then_else(mx > other, mx, other)
            sm = T.float32(0)
            for i in T.unroll(VPT, explicit=True):
                x[i] = T.exp(x[i] - mx)
                sm = sm + x[i]
            for o in T.unroll(5, explicit=True):
                sm = sm + T.shfl_xor(sm, 16 >> o)
            for i in T.unroll(VPT, explicit=True):
                x[i] = x[i] / sm
        else:
            for i in T.unroll(VPT, explicit=True):
                x[i] = T.float32(1) / (T.float32(1) + T.exp(-x[i]))
        for i in T.unroll(VPT, explicit=True):
            if noaux and has_bias:
                c[i] = x[i] + Bias[i * 32 + lane]
            else:
                c[i] = x[i]

        if grouped:
            for i in T.unroll(VPT, explicit=True):
                s_c[sb + i * 32 + lane] = c[i]
            T.sync_threads()
            if lane < G:  # group score: max (V2) or sum of the top-2 (V3)
                m1 = -T.infinity(f32)
                m2 = -T.infinity(f32)
                for e in T.serial(PG):
                    v = s_c[sb + lane * PG + e]
                    if v > m1:
                        m2 = m1
                        m1 = v
                    elif v > m2:
                        m2 = v
                if noaux:
                    s_g[gb + lane] = _radix_key(m1 + m2)
                else:
                    s_g[gb + lane] = _radix_key(m1)
            T.sync_threads()
            if lane < G:  # keep the topk_group best groups, ties to the lower group index
                rank = 0
                for h in T.serial(G):
                    rank = rank + T.if_then_else(
                        (s_g[gb + h] > s_g[gb + lane]) | ((s_g[gb + h] == s_g[gb + lane]) & (h < lane)), 1, 0
                    )
                s_sel[gb + lane] = T.if_then_else(rank < TG, 1, 0)
            T.sync_threads()
            for i in T.unroll(VPT, explicit=True):
                if s_sel[gb + (i * 32 + lane) // PG] == 0:
                    if noaux:
                        c[i] = -T.infinity(f32)
                    else:
                        c[i] = T.float32(0)

        for i in T.unroll(VPT, explicit=True):
            if noaux:  # the bias only steers the choice; the weights are the raw scores
                s_w[sb + i * 32 + lane] = x[i]
            else:
                s_w[sb + i * 32 + lane] = c[i]
            key[i] = (T.Cast(u64, _radix_key(c[i])) << T.uint64(32)) | T.Cast(
                u64, T.int32(0x7FFFFFFF) - (i * 32 + lane)
            )
        # k rounds of warp arg-max: value descending, ties to the lowest expert index
        for p in T.unroll(K, explicit=True):
            best = key[0]
            for i in T.unroll(1, VPT, explicit=True):
                best = T.max(best, key[i])
            for o in T.unroll(5, explicit=True):
                best = T.max(best, T.shfl_xor(best, 16 >> o))
            pk[p] = T.Cast(u32, best >> T.uint64(32))
            pi[p] = T.int32(0x7FFFFFFF) - T.Cast(i32, best & T.uint64(0xFFFFFFFF))
            for i in T.unroll(VPT, explicit=True):
                if i * 32 + lane == pi[p]:
                    key[i] = T.uint64(0)
        T.sync_threads()
        # torch.topk(sorted=False) on CUDA: picks > k-th value by index, then picks == k-th value by index
        for p in T.unroll(K, explicit=True):
            pos[p] = 0
            for q in T.unroll(K, explicit=True):
                if q != p:
                    pos[p] = pos[p] + T.if_then_else(
                        ((pk[q] != pk[K - 1]) & (pk[p] == pk[K - 1]))
                        | (((pk[q] == pk[K - 1]) == (pk[p] == pk[K - 1])) & (pi[q] < pi[p])),
                        1,
                        0,
                    )
        for j in T.unroll(K, explicit=True):
            io[j] = 0
            for p in T.unroll(K, explicit=True):
                if pos[p] == j:
                    io[j] = pi[p]
            wo[j] = s_w[sb + io[j]]
        if norm_topk_prob:
            tot = sum_fn([wo[j] for j in range(K)]) + T.float32(1e-20)
            for j in T.unroll(K, explicit=True):
                wo[j] = wo[j] / tot
        if rsf != 1.0:
            for j in T.unroll(K, explicit=True):
                wo[j] = wo[j] * T.float32(rsf)

    return gating_token


@cached_prim_func
def build_gating_topk(
    num_experts: int,
    top_k: int,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    norm_order: str = "torch_last",
    has_bias: bool = True,
):
    """PrimFunc (logits [T, E] f32, bias [E] f32, weights [T, k] f32 out, ids [T, k] i32 out); T is dynamic.
    The bias is read only for noaux_tc with ``has_bias``. One warp (one CTA) a token: ``_gating_macro``."""
    assert tilelang is not None, "tilelang is not installed"
    E, K = num_experts, top_k
    gating_token = _gating_macro(num_experts, top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
                                 routed_scaling_factor, norm_order, has_bias)
    f32, u32, i32 = T.float32, T.uint32, T.int32
    M = T.dynamic("num_tokens")

    @T.prim_func
    def gating_topk(
        L: T.Tensor([M, E], f32),
        Bias: T.Tensor([E], f32),
        W: T.Tensor([M, K], f32),
        Ids: T.Tensor([M, K], i32),
    ):
        with T.Kernel(M, threads=32) as bx:
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            lane = T.get_thread_binding()
            wo = T.alloc_local([K], f32)  # outputs in torch's order
            io = T.alloc_local([K], i32)
            s_c = T.alloc_shared([E], f32)
            s_w = T.alloc_shared([E], f32)
            s_g = T.alloc_shared([32], u32)
            s_sel = T.alloc_shared([32], i32)
            gating_token(L, Bias, bx, lane, 0, 0, s_c, s_w, s_g, s_sel, wo, io)
            if lane == 0:
                for j in T.unroll(K, explicit=True):
                    W[bx, j] = wo[j]
                    Ids[bx, j] = io[j]

    return gating_topk
