"""MoE routing for Hopper, in TileLang: gating top-k, permute (dispatch) and unpermute (combine).

Op contracts: docs/interfaces.md ``moe_gating_topk`` / ``moe_dispatch`` / ``moe_combine``; semantics follow the CPU
reference (backends/cpu/moe.py) as it runs on CUDA tensors, where it replaces ~20 small torch kernels per MoE layer
(softmax/sigmoid, topk, radix argsort, index_select, zeros + scatter_add, the 6-7 kernel combine) by three.

1. ``gating_topk``: router logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int32). One warp (one CTA) per
   token, expert ``e`` in lane ``e % 32``, slot ``e // 32`` (E % 32 == 0, E <= 256): the layout of torch's warp
   softmax (``softmax_warp_forward``: max, ``expf(x - max)`` summed per lane in slot order, then a xor-butterfly
   add, then ``x / sum``), so the scores are bit-identical to ``logits.softmax(-1)`` on CUDA; sigmoid is
   ``1 / (1 + expf(-x))`` as torch's. Groups (``group_limited_greedy``: max per group; ``noaux_tc``: sum of the top-2
   bias-corrected scores per group) go through shared memory, one lane per group. Top-k: k rounds of a warp
   arg-max over a 64-bit key (radix-converted float << 32 | (0x7fffffff - index)), i.e. value descending, ties to
   the lowest index, values compared in torch's radix order (``TopKTypeConfig<float>::convert``). The k picks are
   then written in torch.topk(sorted=False)'s CUDA order: first every pick strictly greater than the k-th value,
   by index, then the picks equal to it, by index (``gatherTopK``: a ``>`` pass then a ``==`` pass). The
   normalisation sum follows torch's reduction tree for a [T, k] last-dim sum (``norm_order="torch_last"``).
2. ``permute``: ids [T, k] -> (sorted rows [T*k, D], counts [E] int64, order [T*k] int64) by counting sort: the
   row of assignment a = t*k + j goes to ``#{b: id_b < id_a} + #{b < a: id_b == id_a}``, exactly the stable
   argsort's position. One CTA per token scans all T*k ids (O((T*k)^2) work: decode sizes only, T*k <= MAX_ASSIGN),
   counts experts with shared-memory atomics, writes the token's k order entries and k copies of its row.
   No host reads: CUDA-graph capturable.
3. ``unpermute``: expert_out [T*k, D], order, weights [T, k] fp32 -> [T, D]: the CTA of token t finds its k rows by
   scanning ``order`` (its inverse is not stored in DispatchState; above MAX_ASSIGN the ``by_position`` variant
   reads the inverse, one scatter computes it), then per element ``sum_j w[t, j] *
   float(expert_out[pos_j])`` with products rounded to fp32 (``--fmad=false``: no FMA contraction) and summed in
   torch's reduction order for ``(x * w).sum(dim=1)`` over [T, k, D] (four interleaved accumulators,
   ``sum_order="torch_strided"``), then one cast: bit-exact with the reference on CUDA.
4. ``route`` (decode batches, T <= MAX_ROUTE_TOKENS): ``gating_topk`` + ``permute(with_scan=True)`` in one launch,
   every output bit-identical to the two kernels'. One CTA a token, as permute; warp w of every CTA first gates
   tokens w, w + NW, ... with the standalone kernel's own code (``_gating_macro``, the gating kernel's generated
   source unchanged by it, byte for byte) into shared memory, then the permute body reads the ids from there.
   Checked on an H200 (weights 0 ulp from the reference, graph replay; tests/kernels_cuda/test_moe_routing.py).

Measured on one H200 (torch 2.11 + cu130, TileLang 0.1.15; 2026-11-29), against the reference ops on the same CUDA
tensors: gating ids identical (order included) in 24/24 cases (V2-Lite, V2, V3, T = 1..1000, tie-
heavy integer logits, all-equal rows) and the weights bit-exact in 24/24; permute order / counts / rows identical
(11 cases, bf16 and fp32, up to T*k = 8192); unpermute 0 ulp in 9/9; the three kernels captured in a CUDA graph and
replayed: bit-exact. Control: the sequential sum instead of torch's orders is 3 ulp off (normalisation) and 3-16
bf16 ulp off (combine). CUDA-graph replay timings (``bench.py moe_routing``)
(median, first run), kernel vs the torch path it replaces (us):

| shape | T | gating | permute (dispatch) | unpermute (combine) |
|---|---|---|---|---|
| V2-Lite (E 64, k 6, D 2048) | 1 | 2.2 vs 7.7 | 2.1 vs 21.5 | 2.1 vs 11.6 |
| V2-Lite | 64 | 2.7 vs 11.0 | 2.8 vs 42.1 | 2.7 vs 16.6 |
| V2-Lite | 256 | 2.8 vs 11.8 | 6.0 vs 48.3 | 5.3 vs 37.3 |
| V2-Lite | 1024 | 3.2 vs 12.6 | 20.4 vs 97.2 | 18.8 vs 144.9 |
| V3 (E 256, k 8, D 7168) | 1 | 5.5 vs 42.4 | 3.6 vs 22.8 | 3.8 vs 12.1 |
| V3 | 64 | 5.8 vs 53.1 | 4.9 vs 44.8 | 4.9 vs 42.1 |
| V3 | 256 | 5.8 vs 59.8 | 12.5 vs 55.5 | 9.7 vs 163.2 |
| V3 | 1024 | 6.9 vs 83.3 | 58.6 vs 135.6 | 63.8 vs 607.8 |
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
# Products must round to fp32 before the sums, as in torch's separate multiply and sum kernels.
COMPILE_FLAGS = ["--fmad=false"]

MAX_EXPERTS = 256  # gating: one warp per token, E / 32 slots a lane
MAX_TOP_K = 16
MAX_SCAN_EXPERTS = 256  # permute's fused scan: one thread an expert, hit count in 9 bits (moe_gemm.MAX_EXPERTS)
MAX_ROUTE_TOKENS = 16  # route (gating + permute in one launch): every CTA gates all T tokens (decode batches)
MAX_ASSIGN = 8192  # permute / unpermute: every CTA scans all T*k assignments (decode and small prefill chunks)
METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORINGS = ("softmax", "sigmoid")
DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


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


# ---- compile / launch ------------------------------------------------------------------------------------------
def _compile(func, target=None):
    return tilelang.compile(
        func, out_idx=None, target=dict(target or SM90_TARGET), compile_flags=list(COMPILE_FLAGS)
    )


_CACHE = KernelCache({"gating": build_gating_topk, "permute": build_permute, "unpermute": build_unpermute,
                      "route": build_route}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels  # (kind, cfg) -> compiled kernel


def _get_kernel(kind, cfg):
    return _CACHE.get(kind, cfg)


def precompile(items):
    """Compile (kind, cfg) pairs in parallel threads (nvcc runs in subprocesses) and keep them for the launchers."""
    _CACHE.precompile(items)


def _gating_cfg(params, norm_order="torch_last", has_bias=True):
    return (
        int(params.num_experts),
        int(params.top_k),
        str(params.scoring_func),
        str(params.topk_method),
        int(params.n_group),
        int(params.topk_group),
        bool(params.norm_topk_prob),
        float(params.routed_scaling_factor),
        norm_order,
        bool(has_bias and params.topk_method == "noaux_tc"),
    )


def get_gating_kernel(*cfg):
    return _get_kernel("gating", tuple(cfg))


def get_permute_kernel(hidden_size, top_k, num_experts, dtype, with_scan=False):
    if with_scan:  # the 6-item key: (..., threads, with_scan); the plain kernel keeps its 4-item key
        return _get_kernel("permute", (hidden_size, top_k, num_experts, dtype, 128, True))
    return _get_kernel("permute", (hidden_size, top_k, num_experts, dtype))


def _route_cfg(params, hidden_size, dtype, has_bias=True):
    """The ("route", cfg) key: (D, k, E, the gating cfg's scoring ... has_bias, dtype), torch_last normalisation."""
    g = _gating_cfg(params, "torch_last", has_bias)
    return (int(hidden_size), g[1], g[0], *g[2:], dtype)


def get_route_kernel(hidden_size, top_k, num_experts, scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
                     routed_scaling_factor, norm_order, has_bias, dtype):
    return _get_kernel("route", (hidden_size, top_k, num_experts, scoring_func, topk_method, n_group, topk_group,
                                 norm_topk_prob, routed_scaling_factor, norm_order, has_bias, dtype))


def get_unpermute_kernel(hidden_size, top_k, dtype, sum_order="torch_strided", with_addend=False, by_position=False):
    return _get_kernel("unpermute", unpermute_cfg(hidden_size, top_k, dtype, sum_order, with_addend, by_position))


def unpermute_cfg(hidden_size, top_k, dtype, sum_order="torch_strided", with_addend=False, by_position=False):
    """The ("unpermute", cfg) key: 4 items for the plain kernel, 6 with the addend, 7 by position."""
    if by_position:
        return (int(hidden_size), int(top_k), dtype, sum_order, 128, bool(with_addend), True)
    if with_addend:
        return (int(hidden_size), int(top_k), dtype, sum_order, 128, True)
    return (int(hidden_size), int(top_k), dtype, sum_order)


def gating_reason(router_logits, bias, params) -> str | None:
    """None when ``gating_topk`` handles these arguments (host facts only), else why not."""
    e, k, g, tg = int(params.num_experts), int(params.top_k), int(params.n_group), int(params.topk_group)
    if router_logits.dim() != 2 or router_logits.shape[1] != e:
        return f"logits shape {tuple(router_logits.shape)} is not [T, {e}]"
    if router_logits.shape[0] == 0:
        return "no tokens"
    if params.scoring_func not in SCORINGS or params.topk_method not in METHODS:
        return f"{params.scoring_func}/{params.topk_method}: not implemented in the kernel"
    if e % 32 or e > MAX_EXPERTS:
        return f"{e} experts: kernel needs a multiple of 32, at most {MAX_EXPERTS}"
    if not 1 <= k <= min(e, MAX_TOP_K):
        return f"top_k {k}: kernel handles 1..{MAX_TOP_K}"
    if params.topk_method != "greedy":
        if g < 1 or e % g or g > 32 or not 1 <= tg <= g:
            return f"n_group {g}, topk_group {tg}: kernel needs E % n_group == 0, n_group <= 32"
        if params.topk_method == "noaux_tc" and e // g < 2:
            return "noaux_tc with fewer than 2 experts a group"
    if bias is not None and (bias.numel() != e or not bias.is_cuda):
        return "correction bias is not a CUDA tensor of E values"
    return None


def gating_topk(router_logits, bias, params, norm_order="torch_last"):
    """(weights [T, k] fp32, ids [T, k] int32) like ``backends.cpu.moe.moe_gating_topk`` on CUDA tensors."""
    logits = router_logits.float().contiguous()
    t, k = logits.shape[0], int(params.top_k)
    # Without a bias the kernel is built not to read it; any [E] fp32 tensor fills the argument (no allocation, so
    # nothing uninitialised when the first call happens inside a CUDA-graph capture).
    b = logits[0] if bias is None else bias.float().reshape(-1).contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    get_gating_kernel(*_gating_cfg(params, norm_order, bias is not None))(logits, b, weights, ids)
    return weights, ids


def _rows_reason(x, what) -> str | None:
    if x.dtype not in DTYPES:
        return f"{what} {x.dtype}: kernel handles bf16 / fp32"
    vec = 16 // x.element_size()
    if x.dim() != 2 or x.shape[1] % vec:
        return f"{what} shape {tuple(x.shape)}: rows must be a multiple of {vec} elements"
    if not x.is_contiguous() or x.data_ptr() % 16:
        return f"{what} is not contiguous / 16-byte aligned"
    return None


def permute_reason(hidden, ids, num_experts) -> str | None:
    if ids.dim() != 2 or hidden.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        return "shapes"
    n = ids.numel()
    if n == 0:
        return "no tokens"
    if n > MAX_ASSIGN:
        return f"{n} assignments > {MAX_ASSIGN} (the kernel is O((T*k)^2): decode sizes)"
    if ids.dtype not in (torch.int32, torch.int64):
        return f"ids {ids.dtype}"
    if ids.shape[1] > MAX_TOP_K:
        return f"top_k {ids.shape[1]} > {MAX_TOP_K}"
    if num_experts > 4096:
        return f"{num_experts} experts > 4096"
    return _rows_reason(hidden, "hidden")


def permute(hidden, ids, num_experts, with_scan=False):
    """(sorted_hidden [T*k, D], counts [E] int64, order [T*k] int64) like ``backends.cpu.moe.moe_dispatch``;
    ``with_scan`` (E <= MAX_SCAN_EXPERTS): also ``moe_gemm.expert_starts(counts)`` [2E + 1] int32, from the same
    launch."""
    t, k = ids.shape
    n, d = t * k, hidden.shape[1]
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    sorted_hidden = torch.empty(n, d, dtype=hidden.dtype, device=hidden.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=hidden.device)
    order = torch.empty(n, dtype=torch.int64, device=hidden.device)
    if with_scan and num_experts > MAX_SCAN_EXPERTS:
        raise ValueError(f"permute: {num_experts} experts; the fused scan handles 1..{MAX_SCAN_EXPERTS}")
    kern = get_permute_kernel(d, k, int(num_experts), DTYPES[hidden.dtype], with_scan)
    if not with_scan:
        kern(hidden, flat, sorted_hidden, counts, order)
        return sorted_hidden, counts, order
    scan = torch.empty(2 * num_experts + 1, dtype=torch.int32, device=hidden.device)
    kern(hidden, flat, sorted_hidden, counts, order, scan)
    return sorted_hidden, counts, order, scan


def route_reason(router_logits, bias, params, hidden, num_experts) -> str | None:
    """None when ``route`` (gating + permute(with_scan=True) in one launch) handles these arguments (host facts
    only), else why not: the gating's and the permute's own limits, T <= MAX_ROUTE_TOKENS, E <= MAX_SCAN_EXPERTS."""
    if router_logits.dim() != 2:
        return f"logits shape {tuple(router_logits.shape)} is not [T, E]"
    t = int(router_logits.shape[0])
    if t > MAX_ROUTE_TOKENS:
        return f"{t} tokens > MAX_ROUTE_TOKENS {MAX_ROUTE_TOKENS} (route gates every token in every CTA: decode only)"
    if int(num_experts) > MAX_SCAN_EXPERTS:
        return f"{num_experts} experts > MAX_SCAN_EXPERTS {MAX_SCAN_EXPERTS} (the fused expert scan)"
    if int(num_experts) != int(params.num_experts):
        return f"num_experts {num_experts} != the gating's {params.num_experts}"
    if not router_logits.is_floating_point():
        return f"logits {router_logits.dtype}: not a floating-point tensor"
    if hidden.dim() != 2 or int(hidden.shape[0]) != t:
        return f"hidden {tuple(hidden.shape)} is not [T={t}, D] (the logits' tokens)"
    if hidden.dtype not in DTYPES:
        return f"hidden {hidden.dtype}: kernel handles bf16 / fp32"
    if not (router_logits.is_cuda and hidden.is_cuda) or router_logits.device != hidden.device:
        return "tensor not on a CUDA device (logits and hidden on one CUDA device)"
    why = gating_reason(router_logits, bias, params)
    if why is not None:
        return why
    ids = torch.empty((t, int(params.top_k)), dtype=torch.int32, device="meta")  # the shape gating_topk gives
    return permute_reason(hidden, ids, int(num_experts))


def route(router_logits, bias, params, hidden, num_experts):
    """(weights [T, k] fp32, ids [T, k] int32, sorted_hidden [T*k, D], counts [E] int64, order [T*k] int64,
    scan [2E + 1] int32) in one launch, bit-identical to ``gating_topk(router_logits, bias, params)`` followed by
    ``permute(hidden, ids, num_experts, with_scan=True)``; ``route_reason`` says when it applies (T <= 16)."""
    logits = router_logits.float().contiguous()
    t, k, e, d = logits.shape[0], int(params.top_k), int(num_experts), hidden.shape[1]
    if t > MAX_ROUTE_TOKENS:  # the shared ids buffer holds MAX_ROUTE_TOKENS * k (route_reason says so too)
        raise ValueError(f"route: {t} tokens > MAX_ROUTE_TOKENS {MAX_ROUTE_TOKENS}")
    b = logits[0] if bias is None else bias.float().reshape(-1).contiguous()  # as gating_topk: no allocation
    dev = logits.device
    weights = torch.empty(t, k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, k, dtype=torch.int32, device=dev)
    sorted_hidden = torch.empty(t * k, d, dtype=hidden.dtype, device=dev)
    counts = torch.empty(e, dtype=torch.int64, device=dev)
    order = torch.empty(t * k, dtype=torch.int64, device=dev)
    scan = torch.empty(2 * e + 1, dtype=torch.int32, device=dev)
    kern = get_route_kernel(*_route_cfg(params, d, DTYPES[hidden.dtype], bias is not None))
    kern(logits, b, hidden, weights, ids, sorted_hidden, counts, order, scan)
    return weights, ids, sorted_hidden, counts, order, scan


def unpermute_reason(expert_out, order, weights, num_tokens, top_k, by_position=False) -> str | None:
    """None when ``unpermute`` takes these arguments (host facts only); ``by_position``: the variant that reads the
    order's inverse (no MAX_ASSIGN limit)."""
    n = order.numel()
    if n == 0 or num_tokens == 0:
        return "no tokens"
    if n != num_tokens * top_k or expert_out.shape[0] != n or tuple(weights.shape) != (num_tokens, top_k):
        return "shapes"
    if by_position and n >= 2**31:
        return f"{n} assignments: int32 positions"
    if not by_position and n > MAX_ASSIGN:
        return f"{n} assignments > {MAX_ASSIGN} (every CTA scans the order: decode sizes)"
    if top_k > MAX_TOP_K:
        return f"top_k {top_k} > {MAX_TOP_K}"
    if order.dtype != torch.int64:
        return f"order {order.dtype}"
    return _rows_reason(expert_out, "expert_out")


def addend_reason(expert_out, addend, num_tokens) -> str | None:
    """None when ``unpermute(..., addend=addend)`` takes ``addend`` (shape [T, D], expert_out's dtype, contiguous)."""
    want = (int(num_tokens), int(expert_out.shape[1]))
    if tuple(addend.shape) != want or addend.dtype != expert_out.dtype or addend.device != expert_out.device:
        return f"addend {addend.dtype} {list(addend.shape)} on {addend.device}, want {expert_out.dtype} {list(want)}"
    if not addend.is_contiguous():
        return "addend not contiguous"
    return None


def positions_of(order):
    """The inverse of a dispatch order as int32: ``positions[order[i]] = i`` (one scatter; no host read)."""
    n = order.numel()
    positions = torch.empty(n, dtype=torch.int32, device=order.device)
    positions.scatter_(0, order, torch.arange(n, dtype=torch.int32, device=order.device))
    return positions


def unpermute(expert_out, order, weights, num_tokens, top_k, sum_order="torch_strided", addend=None,
              by_position=False):
    """[T, D] = sum_j weights[t, j] * expert_out[row of t*k+j], like ``backends.cpu.moe.moe_combine``; with
    ``addend`` [T, D] (``addend_reason``): that sum rounded to the dtype, plus ``addend`` as torch adds them.
    ``by_position``: invert ``order`` first (``positions_of``) and take the O(T*k) kernel (prefill sizes)."""
    d = expert_out.shape[1]
    out = torch.empty(num_tokens, d, dtype=expert_out.dtype, device=expert_out.device)
    w = weights.float().contiguous()
    index = positions_of(order) if by_position else order.contiguous()
    kern = get_unpermute_kernel(d, int(top_k), DTYPES[expert_out.dtype], sum_order, addend is not None, by_position)
    if addend is None:
        kern(expert_out, index, w, out)
    else:
        kern(expert_out, index, w, addend, out)
    return out


# ---- CI compile --------------------------------------------------------------------------------------------------
CI_CONFIGS = [
    ("gating", (64, 6, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False)),  # V2-Lite
    ("gating", (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, "torch_last", True)),  # V3
    ("permute", (2048, 6, 64, "bfloat16")),
    ("permute", (2048, 6, 64, "bfloat16", 128, True)),  # + moe_gemm's expert scan
    ("unpermute", (2048, 6, "bfloat16", "torch_strided")),
    ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True)),  # + the shared experts' output
    ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True, True)),  # by position (prefill sizes)
    ("route", (2048, 6, 64, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False, "bfloat16")),  # V2-Lite
    ("route", (7168, 8, 256, "sigmoid", "noaux_tc", 8, 4, True, 2.5, "torch_last", True, "bfloat16")),  # V3
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)
