"""Skinny GEMM for decode (a few rows x a weight matrix), in TileLang: ``out = a @ w^T`` streamed at HBM speed.

Op: the ``linear`` of docs/interfaces.md §2 for 1-row steps (batch-1 decode; the backend's routing,
``engine_reason``), the gate/up GEMM of ``dense_mlp`` with the SwiGLU fused, and the router's fp32 GEMM on bf16
rows; grouped, W_UV at one token (the heads as experts, one row each: ``backends/cuda/ops/mla_epilogue.py``).
``a`` [M, K] (bf16 or fp32), ``w`` [N, K] (the checkpoint's ``[out, in]`` layout; bf16, or fp32 for the router)
or, grouped, [E, N, K] with ``a``'s rows sorted by expert and ``moe_gemm.expert_starts``' scan. fp32
accumulation; the output is rounded once to its dtype.
``gated=True`` fuses the SwiGLU activation: ``w`` is [gate | up] = [2I, K] and the output [M, I] is
``silu(bf16(a @ gate^T)) * bf16(a @ up^T)`` with the CPU reference's roundings (``silu_and_mul`` of a bf16 GEMM
result: silu in fp32 rounded to bf16, the product in fp32 rounded to bf16; precise expf, no fast math).

Why: at M = 1 the library GEMM tiles (cuBLAS ``nvjet 64x8``, split-K + reduce for narrow N) streamed the V2-Lite
projections at about half the copy bandwidth on an H200 (1.19 ms of a 3.2 ms batch-1 step for ~0.53 ms of bytes;
profile_decode.py). Tensor cores buy nothing at M <= 8 (compute is free, bytes are not), so this is a
CUDA-core kernel: each warp owns R output columns, each lane streams 16-byte vectors of those weight rows along K
(U vectors per row in flight before any FMA), multiplies them with the ``a`` rows of its row block (RB rows, read
through L1), and a warp shuffle sums the lanes. A CTA of 4 warps covers 4R columns (R = 1: kv_a's 576 columns are
144 CTAs), so the narrow projections still spread over the SMs without split-K (one launch, no workspace,
deterministic).
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
MAX_ROWS = 8  # row block RB <= 8 (registers: RB * R * G fp32 accumulators a lane)
# What the engine routes here (reason()): one row, K <= DENSE_MAX_K. Measured on an H200 (bench.py skinny_gemm):
# at 1 row 1.35-2.4x cuBLAS on the V2-Lite projections, but at 6 rows 2-8x slower (the FMAs, not the bytes,
# then bound a CUDA-core kernel), and at K = 10944 (one CTA walks 43 vectors a lane) slower than cuBLAS' split-K.
DENSE_MAX_ROWS = 1
DENSE_MAX_K = 8192
THREADS = 128
ROWS_PER_WARP = 1  # R: output columns a warp owns  ((1, 4) was the best or within 10 % at 1 row)
UNROLL = 4  # U: 16-byte weight vectors per row a lane loads before its FMAs
_BYTES = {"bfloat16": 2, "float32": 4}


def default_variant() -> tuple[int, int]:
    """(rows_per_warp, unroll) of the engine's launches (``bench.py skinny_gemm --variants`` times others)."""
    return ROWS_PER_WARP, UNROLL


def vec_for(w_dtype: str) -> int:
    return 16 // _BYTES[w_dtype]


def rows_block(m: int) -> int:
    """RB for M rows: the next power of two >= M, at most MAX_ROWS (more rows: ceil(M / RB) row blocks)."""
    return min(MAX_ROWS, 1 << max(0, (int(m) - 1).bit_length()))


def reduce_and_store(rb: int, r: int, g: int, out_dtype: str):
    """The warp's epilogue (also ``fp8_skinny_gemm``'s): each of the ``rb * r * g`` per-lane fp32 sums reduced
    over the warp, then lane 0 writes rows ``row0 + mb * rb ..`` (those below ``cnt``) of its ``r`` columns from
    ``n0`` (those below ``out_cols``); ``g == 2``: the gated SwiGLU with the reference's roundings (bf16 GEMM outputs,
    bf16 silu, bf16 product; precise expf)."""
    RB, R, G = rb, r, g
    f32, bf16 = T.float32, T.bfloat16

    @T.macro
    def store(Out, acc, row0, cnt, mb, n0, lane, out_cols):  # out_cols: the kernel's dynamic NO (its name)
        for i in T.unroll(RB * R * G, explicit=True):
            acc[i] = T.warp_reduce_sum(acc[i])
        if lane == 0:
            for m in T.unroll(RB, explicit=True):
                for rr in T.unroll(R, explicit=True):
                    if (mb * RB + m < cnt) & (n0 + rr < out_cols):
                        if G == 2:
                            gv = T.Cast(f32, T.Cast(bf16, acc[(m * R + rr) * G]))
                            s = T.Cast(bf16, gv / (T.float32(1) + T.exp(-gv)))
                            Out[row0 + mb * RB + m, n0 + rr] = T.Cast(
                                bf16, T.Cast(f32, s) * T.Cast(f32, T.Cast(bf16, acc[(m * R + rr) * G + 1])))
                        else:
                            Out[row0 + mb * RB + m, n0 + rr] = T.Cast(out_dtype, acc[m * R + rr])

    return store


@cached_prim_func
def build_skinny_gemm(k: int, rb: int, gated: bool = False, grouped: bool = False, a_dtype: str = "bfloat16",
                      w_dtype: str = "bfloat16", out_dtype: str = "bfloat16", rows_per_warp: int = ROWS_PER_WARP,
                      unroll: int = UNROLL, threads: int = THREADS, col_iters: int = 1):
    """PrimFunc for K = ``k`` (compile-time) and row block ``rb``; M, N (and E) are dynamic. ``col_iters``: column
    groups a CTA handles in turn (tuning; 1 in the engine). Dense:
    (A [M, K], W [N, K], Out [M, NO]); grouped: (A, W [E, N, K], Scan [2E + 1] i32, Out). NO = N, or N / 2 gated
    (the host checks N == 2 * NO)."""
    assert tilelang is not None, "tilelang is not installed"
    # dense: the weights do not depend on earlier kernels, so each lane issues its first U weight vectors before
    # it waits for the previous kernel (PDL): those loads overlap that kernel's tail. Grouped: the expert comes
    # from the scan, a previous kernel's output, so it waits at the start.
    EARLY_WEIGHTS = not grouped
    VEC = vec_for(w_dtype)
    assert k % VEC == 0 and 1 <= rb <= MAX_ROWS and threads % 32 == 0
    assert not gated or out_dtype == "bfloat16"
    K, RB, R, G = k, rb, rows_per_warp, 2 if gated else 1
    KV = K // VEC  # 16-byte weight vectors a row
    ITER = (KV + 31) // 32  # vectors a lane
    U = min(unroll, ITER)
    OUTER = (ITER + U - 1) // U
    NW = threads // 32
    RC = NW * R  # output columns a CTA (per column group)
    C = col_iters
    NACC = RB * R * G
    f32, i32 = T.float32, T.int32
    M = T.dynamic("num_rows")
    N = T.dynamic("weight_rows")
    NO = T.dynamic("out_cols")
    E = T.dynamic("num_experts")
    S = T.dynamic("scan_len")
    store = reduce_and_store(RB, R, G, out_dtype)

    @T.macro
    def tile(A, W, Out, e, row0, cnt, mb, n0, lane, acc, w, x):
        # one row block ``mb`` of ``cnt`` rows against this warp's R columns from ``n0``
        for i in T.unroll(NACC, explicit=True):
            acc[i] = T.float32(0)
        for o in T.serial(OUTER):
            for u in T.unroll(U, explicit=True):  # loads first: U * R * G vectors in flight a lane
                if (o * U + u) * 32 + lane < KV:  # provably true (dropped) when KV % (32 U) == 0
                    for r in T.unroll(R, explicit=True):
                        for g in T.unroll(G, explicit=True):
                            if n0 + r < NO:
                                for v in T.vectorized(VEC):
                                    if grouped:
                                        w[((u * R + r) * G + g) * VEC + v] = W[
                                            e, g * NO + n0 + r, ((o * U + u) * 32 + lane) * VEC + v]
                                    else:
                                        w[((u * R + r) * G + g) * VEC + v] = W[
                                            g * NO + n0 + r, ((o * U + u) * 32 + lane) * VEC + v]
            if EARLY_WEIGHTS:  # the wait before the first read of A (cheap once it has returned)
                T.pdl_sync()
                T.pdl_trigger()
            for u in T.unroll(U, explicit=True):
                if (o * U + u) * 32 + lane < KV:  # provably true (dropped) when KV % (32 U) == 0
                    for m in T.unroll(RB, explicit=True):
                        if mb * RB + m < cnt:
                            for v in T.vectorized(VEC):
                                x[v] = A[row0 + mb * RB + m, ((o * U + u) * 32 + lane) * VEC + v]
                            for r in T.unroll(R, explicit=True):
                                for g in T.unroll(G, explicit=True):
                                    for v in T.unroll(VEC, explicit=True):
                                        acc[(m * R + r) * G + g] = acc[(m * R + r) * G + g] + T.Cast(
                                            f32, x[v]) * T.Cast(f32, w[((u * R + r) * G + g) * VEC + v])
        store(Out, acc, row0, cnt, mb, n0, lane, NO)

    @T.macro
    def body(A, W, Out, e, row0, cnt, bx):
        tid = T.get_thread_binding()
        lane = tid % 32
        acc = T.alloc_local([NACC], f32)
        w = T.alloc_local([U * R * G * VEC], w_dtype)
        x = T.alloc_local([VEC], a_dtype)
        if C == 1:
            for mb in T.serial(T.ceildiv(cnt, RB)):
                tile(A, W, Out, e, row0, cnt, mb, bx * RC + (tid // 32) * R, lane, acc, w, x)
        else:  # C column groups a CTA in turn: the scan / row reads before the first load are paid once
            for cm in T.serial(C * T.ceildiv(cnt, RB)):
                tile(A, W, Out, e, row0, cnt, cm % T.ceildiv(cnt, RB),
                     (bx * C + cm // T.ceildiv(cnt, RB)) * RC + (tid // 32) * R, lane, acc, w, x)

    if grouped:

        @T.prim_func
        def skinny_gemm_grouped(
            A: T.Tensor([M, K], a_dtype),
            W: T.Tensor([E, N, K], w_dtype),
            Scan: T.Tensor([S], i32),  # moe_gemm.expert_starts: row starts [E + 1], then the hit experts
            Out: T.Tensor([M, NO], out_dtype),
        ):
            with T.Kernel(T.ceildiv(NO, RC * C), T.min(E, M), threads=threads) as (bx, slot):
                T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
                T.pdl_trigger()
                hit = Scan[E + 1 + slot]
                e = T.max(hit, 0)  # a slot past the hit experts does no row
                body(A, W, Out, e, Scan[e], T.if_then_else(hit >= 0, Scan[e + 1] - Scan[e], 0), bx)

        return skinny_gemm_grouped

    @T.prim_func
    def skinny_gemm(
        A: T.Tensor([M, K], a_dtype),
        W: T.Tensor([N, K], w_dtype),
        Out: T.Tensor([M, NO], out_dtype),
    ):
        with T.Kernel(T.ceildiv(NO, RC * C), T.ceildiv(M, RB * 8), threads=threads) as (bx, by):
            # a CTA takes up to 8 row blocks (64 rows) in turn; the weight tile stays in L1/L2 between them
            body(A, W, Out, 0, by * RB * 8, T.min(M - by * RB * 8, RB * 8), bx)

    return skinny_gemm


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


def _builder(k, rb, gated, grouped, a_dtype, w_dtype, out_dtype, rows_per_warp=ROWS_PER_WARP, unroll=UNROLL,
             col_iters=1):
    return build_skinny_gemm(k, rb, gated, grouped, a_dtype, w_dtype, out_dtype, rows_per_warp, unroll,
                             col_iters=col_iters)


_CACHE = KernelCache({"skinny": _builder}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels


def config_for(k: int, m: int, gated: bool, grouped: bool, a_dtype, w_dtype, out_dtype) -> tuple:
    """The cache key of the kernel :func:`skinny_gemm` launches (dtypes as torch dtypes or names)."""
    name = lambda d: d if isinstance(d, str) else str(d).removeprefix("torch.")  # noqa: E731
    return (int(k), rows_block(m), bool(gated), bool(grouped), name(a_dtype), name(w_dtype), name(out_dtype),
            *default_variant())


def launch_config(k: int, m: int, gated: bool, grouped: bool, a_dtype, w_dtype, out_dtype) -> tuple:
    """The cache key :func:`skinny_gemm` launches for ``m`` rows: grouped, the row block serves one expert's rows
    and takes min(M, 2) rows (W_UV's one row a head: 2); dense, all M rows (the warm-up lists these keys)."""
    return config_for(k, min(m, 2) if grouped else m, gated, grouped, a_dtype, w_dtype, out_dtype)


def get_kernel(*cfg):
    return _CACHE.get("skinny", tuple(cfg))


def precompile(configs):
    """Compile ``config_for`` tuples in parallel threads (nvcc subprocesses)."""
    _CACHE.precompile(("skinny", tuple(c)) for c in configs)


CI_CONFIGS = [
    ("skinny", (2048, 1, False, False, "bfloat16", "bfloat16", "bfloat16")),  # V2-Lite q/kv_a/o_proj, batch 1
    ("skinny", (2816, 8, True, False, "bfloat16", "bfloat16", "bfloat16")),  # shared experts' gate_up, gated
    ("skinny", (2048, 2, True, True, "bfloat16", "bfloat16", "bfloat16")),  # expert w13, grouped + gated
    ("skinny", (2048, 4, False, False, "float32", "float32", "float32")),  # router logits (fp32)
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)


_SUPPORTED = {("bfloat16", "bfloat16"), ("float32", "float32"), ("bfloat16", "float32")}  # (a, w); fp32 w: fp32 out


def reason(a: torch.Tensor, w: torch.Tensor, gated: bool = False, grouped: bool = False) -> str | None:
    """None when :func:`skinny_gemm` takes these operands, else why not (for the backend's op report)."""
    names = tuple(str(t.dtype).removeprefix("torch.") for t in (a, w))
    if not (a.is_cuda and w.is_cuda):
        return "tensor not on a CUDA device"
    if a.dim() != 2 or w.dim() != (3 if grouped else 2):
        return f"a {list(a.shape)}, w {list(w.shape)}: 2-D rows x {'[E, N, K]' if grouped else '[N, K]'} weights"
    if names not in _SUPPORTED or (gated and names[1] != "bfloat16"):
        return f"a {a.dtype}, w {w.dtype}: skinny_gemm takes bf16 x bf16, fp32 x fp32 (gated: bf16)"
    k = w.shape[-1]
    if a.shape[1] != k:
        return f"a has K={a.shape[1]}, w has K={k}"
    if k % vec_for(names[1]) or not w.is_contiguous():
        return f"K={k}, contiguous={w.is_contiguous()}: 16-byte weight rows needed"
    if w.data_ptr() % 16 or (a.is_contiguous() and a.data_ptr() % 16):  # a non-contiguous a is copied (aligned)
        return "operand not 16-byte aligned (vector loads)"
    if gated and w.shape[-2] % 2:
        return f"gated: weight rows {w.shape[-2]} are not [gate | up]"
    if not grouped and a.shape[0] > MAX_ROWS * 8:
        return f"{a.shape[0]} rows > {MAX_ROWS * 8} (8 row blocks a CTA)"
    return None


def engine_reason(a: torch.Tensor, w: torch.Tensor, gated: bool = False) -> str | None:
    """:func:`reason` plus where the kernel is faster than the library GEMM (the backend's routing, dense only):
    one row, K <= DENSE_MAX_K."""
    if a.is_cuda and a.dim() == 2 and a.shape[0] > DENSE_MAX_ROWS:  # first: a prefill step asks for every linear
        return f"{a.shape[0]} rows > {DENSE_MAX_ROWS}: the library GEMM is faster there"
    why = reason(a, w, gated)
    if why is None and w.shape[-1] > DENSE_MAX_K:
        why = f"K={w.shape[-1]} > {DENSE_MAX_K}: the library's split-K GEMM is faster there"
    return why


def skinny_gemm(a: torch.Tensor, w: torch.Tensor, gated: bool = False, scan: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``a`` [M, K] x ``w`` [N, K] (or [E, N, K] with ``scan``) -> [M, N] (gated: [M, N / 2]); no host sync."""
    grouped = scan is not None
    why = reason(a, w, gated, grouped)
    if why is not None:
        raise ValueError(f"skinny_gemm: {why}")
    m, k = a.shape
    n_out = w.shape[-2] // 2 if gated else w.shape[-2]
    out_dtype = torch.bfloat16 if gated else (torch.float32 if w.dtype == torch.float32 else a.dtype)
    if grouped:
        e = w.shape[0]
        if scan.dtype != torch.int32 or scan.shape[0] != 2 * e + 1:
            raise ValueError(f"skinny_gemm: scan must be expert_starts' int32 [2E+1] = [{2 * e + 1}], got "
                             f"{scan.dtype} {list(scan.shape)}")
    if out is None:
        out = torch.empty(m, n_out, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    kern = get_kernel(*launch_config(k, m, gated, grouped, a.dtype, w.dtype, out_dtype))
    if grouped:
        kern(a.contiguous(), w, scan, out)
    else:
        kern(a.contiguous(), w, out)
    return out
