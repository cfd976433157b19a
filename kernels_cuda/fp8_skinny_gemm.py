"""FP8 skinny GEMM for one-row decode steps, in TileLang: bf16 rows x block-scaled e4m3 weights, the rows'
1 x 128 quantisation done inside the kernel, so a projection is one launch.

Op: ``fp8_linear`` / ``fp8_dense_mlp`` (backends/cpu/quant.py) for the row of a batch-1 decode step (the
backend's routing: ``ops/quant.py``). ``a`` [M, K] bf16, ``w`` [N, K] float8_e4m3fn with ``w_scale``
[ceil(N / 128), ceil(K / 128)] fp32 (the checkpoint's ``weight_scale_inv``). ``gated=True`` fuses the SwiGLU
(``w`` = [gate | up], output [M, N / 2]) with ``silu_and_mul``'s roundings.

Numerics: the reference's W8A8. Each row's 128-value groups are quantised exactly as ``fp8_quant`` /
``quantize_per_token_group`` do (fp32 amax, ``scale = max(amax, 1e-10) / 448``, IEEE division, clamp, round to
nearest even); the products of the e4m3 codes are summed in fp32 (exact products; only the summation order differs
from the reference's fp32 matmul of the dequantised operands), each 16-value slice's sum scaled by the row's and
the weight block's scales; the output is rounded once to bf16.

Why: at one row the two-kernel path (``fp8_quant``, then ``fp8_gemm``'s swapped form with its split-K reduction:
three launches a projection, two more for an MLP's second quantisation) spent more time between kernels than
streaming weights: FP8 decode at batch 1 ran at 0.97x the bf16 engine on an H200 (docs/kernels/fp8.md). Like
``skinny_gemm``: each warp owns R output columns, each lane streams 16-byte vectors (16 e4m3 weights) of those
rows along K, U vectors in flight before any FMA, the first ones issued before the wait for the previous kernel
(PDL); a warp shuffle sums the lanes. The CTA's 128 threads first quantise its rows into shared memory (one
16-value slice a thread per pass; a group's 8 slices sit in 8 neighbouring lanes, whose amax is one
shuffle-xor tree), so the quantisation is done once a CTA, not once a warp. That repeated quantisation (each CTA
reads and quantises the whole row for its 4 R columns) is what bounds the kernel on large weights: on an H200 it
beat the two-kernel path up to 11 M weights (M = 2**20; 1.1-2.2x at V2-Lite's projections) and lost from 14 M on,
at every column count (docs/kernels/fp8.md), so the backend routes only small weights to it. An expert form (one
token's experts over the scan) ran at 0.24x the grouped two-kernel path and was dropped.
"""

import torch

from ._kernel_cache import KernelCache
from ._prim_func_cache import cached_prim_func
from ._tilelang import T, tilelang
from .skinny_gemm import reduce_and_store

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
GROUP = 128  # values per activation scale and per weight block side
VEC = 16  # e4m3 weights a 16-byte vector
FP8_MAX = 448.0
AMAX_EPS = 1e-10  # fp8_quant.AMAX_EPS
MAX_ROWS = 2  # row block RB (shared memory holds RB rows of codes)
MAX_K = 12288  # RB * K bf16 codes + scales: 49.9 KB at RB = 2 (TileLang raises the 48 KB default)
THREADS = 128
ROWS_PER_WARP = (1, 2, 4)  # output columns a warp: the CTA quantises its rows once for 4 * R columns
UNROLL = 4
VECTORS_IN_FLIGHT = 8  # a lane's weight vectors loaded before their FMAs: U = min(UNROLL, 8 // (R * G))


def rows_block(m: int) -> int:
    return 1 if m <= 1 else MAX_ROWS


@cached_prim_func
def build_fp8_skinny_gemm(k: int, rb: int, gated: bool = False, rows_per_warp: int = 1, threads: int = THREADS):
    """PrimFunc for K = ``k``, row block ``rb`` and ``rows_per_warp`` output columns a warp; M, N dynamic:
    (A [M, K] bf16, W [N, K] e4m3, SW [NB, KB] fp32, Out [M, NO] bf16), a CTA row per row block, NO = N, or N / 2
    gated."""
    assert tilelang is not None, "tilelang is not installed"
    assert k % VEC == 0 and k <= MAX_K and 1 <= rb <= MAX_ROWS and threads % 32 == 0, (k, rb, threads)
    assert rows_per_warp in ROWS_PER_WARP, rows_per_warp
    K, RB, R, G = k, rb, rows_per_warp, 2 if gated else 1
    KV = K // VEC  # weight vectors a row
    KB = -(-K // GROUP)
    QV = RB * KB * (GROUP // VEC)  # quantisation slices a row block (rows padded to whole groups)
    QIT = -(-QV // threads)
    ITER = -(-KV // 32)
    U = min(UNROLL, max(1, VECTORS_IN_FLIGHT // (R * G)), ITER)
    OUTER = -(-ITER // U)
    RC = (threads // 32) * R
    NACC = RB * R * G
    f32, bf16, fp8 = T.float32, T.bfloat16, T.float8_e4m3fn
    M = T.dynamic("num_rows")
    N = T.dynamic("weight_rows")
    NO = T.dynamic("out_cols")
    NB = T.dynamic("weight_row_blocks")
    store = reduce_and_store(RB, R, G, "bfloat16")

    @T.macro
    def quantise(A, Aq, Sa, first, cnt, tid, xb, xf, am):
        # rows [first, first + cnt) of A (cnt <= RB) -> Aq [RB, K] (e4m3 values held as bf16, exact), Sa [RB, KB]
        for it in T.serial(QIT):
            j = it * threads + tid
            m = j // (KB * 8)
            kv = j % (KB * 8)
            for v in T.unroll(VEC, explicit=True):
                xf[v] = T.float32(0)
            if (j < QV) & (kv < KV):
                if m < cnt:
                    for h in T.unroll(2, explicit=True):
                        for v in T.vectorized(8):
                            xb[h * 8 + v] = A[first + m, kv * VEC + h * 8 + v]
                    for v in T.unroll(VEC, explicit=True):
                        xf[v] = T.Cast(f32, xb[v])
            am[0] = T.float32(0)
            for v in T.unroll(VEC, explicit=True):
                am[0] = T.max(am[0], T.abs(xf[v]))
            for d in T.unroll(3, explicit=True):  # the group's 8 slices are lanes 8i .. 8i + 7 (all lanes shuffle)
                am[0] = T.max(am[0], T.shfl_xor(am[0], 1 << d))
            am[0] = T.max(am[0], T.float32(AMAX_EPS)) / T.float32(FP8_MAX)
            if (j < QV) & (kv < KV):
                for v in T.unroll(VEC, explicit=True):
                    Aq[m, kv * VEC + v] = T.Cast(bf16, T.Cast(fp8, T.clamp(
                        xf[v] / am[0], T.float32(-FP8_MAX), T.float32(FP8_MAX))))
                if kv % 8 == 0:
                    Sa[m, kv // 8] = am[0]

    @T.macro
    def tile(A, W, SW, Out, Aq, Sa, row0, cnt, mb, n0, tid, lane, acc, w, ws, xq, xb, xf, am):
        # row block ``mb`` (rows row0 + mb * RB ..) against this warp's R columns from n0
        for i in T.unroll(NACC, explicit=True):
            acc[i] = T.float32(0)
        for o in T.serial(OUTER):
            for u in T.unroll(U, explicit=True):  # weight vectors and their block scales first
                if (o * U + u) * 32 + lane < KV:
                    for r in T.unroll(R, explicit=True):
                        for g in T.unroll(G, explicit=True):
                            if n0 + r < NO:
                                for v in T.vectorized(VEC):
                                    w[((u * R + r) * G + g) * VEC + v] = W[
                                        g * NO + n0 + r, ((o * U + u) * 32 + lane) * VEC + v]
                                ws[(u * R + r) * G + g] = SW[(g * NO + n0 + r) // GROUP,
                                                             ((o * U + u) * 32 + lane) // 8]
            if o == 0:  # the rows' codes, once the first weights are in flight
                T.pdl_sync()
                T.pdl_trigger()
                T.sync_threads()  # the previous row block's reads of Aq are done
                quantise(A, Aq, Sa, row0 + mb * RB, T.min(cnt - mb * RB, RB), tid, xb, xf, am)
                T.sync_threads()
            for u in T.unroll(U, explicit=True):
                if (o * U + u) * 32 + lane < KV:
                    for m in T.unroll(RB, explicit=True):
                        if mb * RB + m < cnt:
                            for h in T.unroll(2, explicit=True):
                                for v in T.vectorized(8):
                                    xq[h * 8 + v] = Aq[m, ((o * U + u) * 32 + lane) * VEC + h * 8 + v]
                            for r in T.unroll(R, explicit=True):
                                for g in T.unroll(G, explicit=True):
                                    am[1] = T.float32(0)
                                    for v in T.unroll(VEC, explicit=True):
                                        am[1] = am[1] + T.Cast(f32, xq[v]) * T.Cast(
                                            f32, w[((u * R + r) * G + g) * VEC + v])
                                    acc[(m * R + r) * G + g] = acc[(m * R + r) * G + g] + am[1] * (
                                        Sa[m, ((o * U + u) * 32 + lane) // 8] * ws[(u * R + r) * G + g])
        store(Out, acc, row0, cnt, mb, n0, lane, NO)  # silu_and_mul's roundings when gated

    @T.macro
    def body(A, W, SW, Out, row0, cnt, bx, row_blocks):
        tid = T.get_thread_binding()
        lane = tid % 32
        Aq = T.alloc_shared([RB, K], bf16)
        Sa = T.alloc_shared([RB, KB], f32)
        acc = T.alloc_local([NACC], f32)
        w = T.alloc_local([U * R * G * VEC], fp8)
        ws = T.alloc_local([U * R * G], f32)
        xq = T.alloc_local([VEC], bf16)
        xb = T.alloc_local([VEC], bf16)
        xf = T.alloc_local([VEC], f32)
        am = T.alloc_local([2], f32)
        for mb in T.serial(row_blocks):
            tile(A, W, SW, Out, Aq, Sa, row0, cnt, mb, bx * RC + (tid // 32) * R, tid, lane, acc, w, ws, xq, xb,
                 xf, am)

    @T.prim_func
    def fp8_skinny_gemm(
        A: T.Tensor([M, K], bf16),
        W: T.Tensor([N, K], fp8),
        SW: T.Tensor([NB, KB], f32),
        Out: T.Tensor([M, NO], bf16),
    ):
        with T.Kernel(T.ceildiv(NO, RC), T.ceildiv(M, RB), threads=threads) as (bx, by):
            body(A, W, SW, Out, by * RB, T.min(M - by * RB, RB), bx, 1)

    return fp8_skinny_gemm


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


_CACHE = KernelCache({"fp8_skinny": build_fp8_skinny_gemm}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels  # the warm-up links and loads what it finds here (backends/cuda/warmup.py)


def rows_per_warp_for(n_out: int, gated: bool = False) -> int:
    """Output columns a warp for ``n_out`` columns: the most (each CTA quantises its rows once for 4 R columns)
    that still leaves 256 CTAs, about two a streaming multiprocessor, to keep the weight stream full; gated, half
    that (a warp streams two weight rows a column: at 2816 columns one a warp ran 6.5 us, two 7.5 us on an H200)."""
    r = next((r for r in sorted(ROWS_PER_WARP, reverse=True) if n_out >= 256 * (THREADS // 32) * r), 1)
    return max(1, r // 2) if gated else r


def config_for(k: int, m: int, gated: bool = False, n_out: int = 0, rows_per_warp: int | None = None) -> tuple:
    """The cache key :func:`fp8_skinny_gemm` launches for ``m`` rows of K = ``k`` and ``n_out`` output columns
    (``rows_per_warp``: this one, not the rule's)."""
    return (int(k), rows_block(m), bool(gated), int(rows_per_warp or rows_per_warp_for(n_out, gated)))


def get_kernel(*cfg):
    return _CACHE.get("fp8_skinny", tuple(cfg))


def precompile(configs) -> None:
    """Compile ``config_for`` tuples in parallel threads (nvcc subprocesses)."""
    _CACHE.precompile(("fp8_skinny", tuple(c)) for c in configs)


CI_CONFIGS = [
    ("fp8_skinny", (2048, 1, False, 2)),  # V2-Lite q / o_proj at one row
    ("fp8_skinny", (2048, 1, True, 1)),  # shared experts' gate/up, SwiGLU fused
    ("fp8_skinny", (2816, 1, False, 2)),  # their down projection: K not a multiple of 512
    ("fp8_skinny", (10944, 2, False, 4)),  # a partial last K group, two rows, four columns a warp
    ("fp8_skinny", (7168, 1, True, 4)),  # gated, one vector in flight
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)


def supported(k: int) -> bool:
    return 0 < k <= MAX_K and k % VEC == 0


def weight_reason(w: torch.Tensor, w_scale: torch.Tensor, gated: bool = False) -> str | None:
    """None when :func:`fp8_skinny_gemm` takes this weight (rows aside), else why not."""
    if not (w.is_cuda and w_scale.is_cuda):
        return "tensor not on a CUDA device"
    if w.dim() != 2 or w_scale.dim() != 2:
        return f"w {list(w.shape)}, w_scale {list(w_scale.shape)}: [N, K] weights and 2-D scales"
    if w.dtype != torch.float8_e4m3fn or w_scale.dtype != torch.float32:
        return f"w {w.dtype}, w_scale {w_scale.dtype}: takes e4m3 weights, fp32 scales"
    n, k = w.shape
    if not supported(k):
        return f"K={k}: must be a multiple of {VEC} and at most {MAX_K}"
    want = (-(-n // GROUP), -(-k // GROUP))
    if tuple(w_scale.shape) != want:
        return f"w_scale {list(w_scale.shape)}: expected {list(want)} (128 x 128 blocks of w {list(w.shape)})"
    if not (w.is_contiguous() and w_scale.is_contiguous()) or w.data_ptr() % 16:
        return "weights and scales must be contiguous, the weight 16-byte aligned (vector loads)"
    if gated and n % 2:
        return f"gated: weight rows {n} are not [gate | up]"
    return None


def reason(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, gated: bool = False) -> str | None:
    """None when :func:`fp8_skinny_gemm` takes these operands, else why not (for the backend's op report)."""
    if not a.is_cuda:
        return "tensor not on a CUDA device"
    if a.dim() != 2 or a.dtype != torch.bfloat16:
        return f"a {a.dtype} {list(a.shape)}: takes 2-D bf16 rows"
    why = weight_reason(w, w_scale, gated)
    if why is None and a.shape[1] != w.shape[-1]:
        why = f"a has K={a.shape[1]}, w has K={w.shape[-1]}"
    if why is None and a.is_contiguous() and a.data_ptr() % 16:  # a non-contiguous a is copied (aligned)
        why = "rows not 16-byte aligned (vector loads)"
    return why


def fp8_skinny_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, gated: bool = False,
                    out: torch.Tensor | None = None, rows_per_warp: int | None = None) -> torch.Tensor:
    """``a`` [M, K] x ``w`` [N, K] -> [M, N] bf16 (gated: [M, N / 2]); no host sync. ``rows_per_warp``: a
    variant for benchmarks (default: :func:`rows_per_warp_for`)."""
    why = reason(a, w, w_scale, gated)
    if why is not None:
        raise ValueError(f"fp8_skinny_gemm: {why}")
    m, k = a.shape
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    if out is None:
        out = torch.empty(m, n_out, dtype=torch.bfloat16, device=a.device)
    elif tuple(out.shape) != (m, n_out) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"fp8_skinny_gemm: out {out.dtype} {list(out.shape)}: expected a contiguous bf16 "
                         f"[{m}, {n_out}]")
    if m == 0:
        return out
    get_kernel(*config_for(k, m, gated, n_out, rows_per_warp))(a.contiguous(), w, w_scale, out)
    return out
