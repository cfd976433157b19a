"""FP8 block-scaled GEMM (DeepGEMM's numerics), in TileLang (Hopper, fp8 wgmma): the "tile" form, the compile cache,
the configurations and the launchers here; the decode forms' kernels in ``_fp8_gemm_swap.py``.

Op: the GEMM of ``fp8_linear`` (backends/cpu/quant.py): ``y [M, N] = dequant(a) @ dequant(w)^T`` in bf16, with
``a`` [M, K] float8_e4m3fn and ``a_scale`` [M, ceil(K / 128)] fp32 (per-token 1 x 128 groups, ``fp8_quant``), ``w``
[N, K] float8_e4m3fn and ``w_scale`` [ceil(N / 128), ceil(K / 128)] fp32 (128 x 128 blocks, the checkpoint's
``weight_scale_inv``). K must be a multiple of 16 (a partial last K block reads zeros past K from both operands),
N of 64.

Accumulation: the tensor cores' fp8 products are accumulated over one 128-wide K block only, then that block's
partial sum is multiplied by ``a_scale[m, kb] * w_scale[n / 128, kb]`` and added into an fp32 accumulator
(DeepGEMM's promotion: the wgmma accumulator's limited precision never spans more than 128 products, and every
scale is applied in fp32). The result matches the fp32 reference of the dequantised operands up to fp32
summation order.

Two forms, picked on the host from M (no device value):
  - "tile" (M > ``SWAP_MAX_ROWS``, prefill): a CTA owns a [BM, BN] output tile (BM = 128, BN = 128, or 64 where
    N is not a multiple of 128; TileLang warp-specialises it: a TMA producer warpgroup and two consumer warpgroups
    over a 4-stage pipeline of [128, 128] fp8 tiles; rows past M read as zeros from the TMA unit and are not
    stored; L2-friendly rasterisation).
  - "swap" (M <= ``SWAP_MAX_ROWS``, decode): weights are the wgmma's M side and tokens its N side,
    ``C^T [BN, RT] = W_tile [BN, 128] @ A [RT, 128]^T`` with RT = 16 or 64 rows (wgmma's N goes down to 8), so
    the pipeline carries weight tiles and no 64-row A tile is padded for a single token. BN = 64 weight rows a CTA,
    for N / 64 CTAs streaming the weights (the step is a read of the weights); where N / 64 is short of the
    multiprocessors, K is sliced over more CTAs (fp32 partial sums, then a one-launch reduction to bf16).

A form that quantised its own bf16 rows inside the swapped GEMM (no ``fp8_quant`` launch) was built and measured on
an H200: bit-identical to the two launches but 0.14-0.74x their speed at 1-16 rows (every CTA quantised the same
tile again, in series before its wgmma); docs/kernels/fp8.md records it.
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._fp8_gemm_swap import BLOCK_K, MULT_K, SCALE_BLOCK, build_fp8_gemm_swap, build_split_reduce
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
SWAP_MAX_ROWS = 64  # rows up to this: the swapped form
NUM_SMS = 132  # H100 / H200 SXM: the swapped form slices K until its CTAs would exceed one wave
MIN_SLICE_BLOCKS = 4
MULT_N = 64


def rows_tile(m: int) -> int:
    """RT of the swapped form: 16 rows up to 16, else 64 (above 64: it loops). Decode streams the weights: the
    wgmma's N side is nearly free, so two variants (fewer compiles) instead of one per power of two."""
    return 16 if m <= 16 else 64


@cached_prim_func
def build_fp8_gemm_tile(n: int, k: int, block_m: int = 128, block_n: int = 128, num_stages: int = 4,
                        threads: int = 256):
    """PrimFunc of the "tile" form for w [n, k]; rows M are dynamic."""
    assert tilelang is not None, "tilelang is not installed"
    assert k % MULT_K == 0 and n % block_n == 0 and SCALE_BLOCK % block_n == 0, (n, k, block_n)
    N, K, BM, BN, BK = n, k, block_m, block_n, BLOCK_K
    KB, NB = -(-k // BLOCK_K), -(-n // SCALE_BLOCK)
    num_stages = max(1, min(num_stages, KB))  # no deeper than the K loop
    fp8, bf16, f32 = T.float8_e4m3fn, T.bfloat16, T.float32
    M = T.dynamic("num_rows")

    @T.prim_func
    def fp8_gemm_tile(
        A: T.Tensor([M, K], fp8),
        SA: T.Tensor([M, KB], f32),
        W: T.Tensor([N, K], fp8),
        SW: T.Tensor([NB, KB], f32),
        Out: T.Tensor([M, N], bf16),
    ):
        with T.Kernel(N // BN, T.ceildiv(M, BM), threads=threads) as (bn, bm):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            A_s = T.alloc_shared([BM, BK], fp8)
            W_s = T.alloc_shared([BN, BK], fp8)
            C_s = T.alloc_shared([BM, BN], bf16)
            C = T.alloc_fragment([BM, BN], f32)  # one K block's wgmma sum
            Acc = T.alloc_fragment([BM, BN], f32)  # the promoted fp32 sum
            T.use_swizzle(panel_size=10)
            T.clear(Acc)
            for kb in T.Pipelined(KB, num_stages=num_stages):
                T.copy(A[bm * BM, kb * BK], A_s)
                T.copy(W[bn * BN, kb * BK], W_s)
                T.gemm(A_s, W_s, C, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(BM, BN):
                    Acc[i, j] += C[i, j] * (
                        T.if_then_else(bm * BM + i < M, SA[bm * BM + i, kb], T.float32(0))
                        * SW[(bn * BN + j) // SCALE_BLOCK, kb])
            T.copy(Acc, C_s)
            T.copy(C_s, Out[bm * BM, bn * BN])

    return fp8_gemm_tile


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


_CACHE = KernelCache({"tile": build_fp8_gemm_tile, "swap": build_fp8_gemm_swap, "reduce": build_split_reduce},
                     _compile,
                     available=tilelang is not None)
_KERNELS = _CACHE.kernels  # the warm-up links and loads what it finds here (backends/cuda/warmup.py)


def reason(m: int, n: int, k: int) -> str | None:
    """Why the kernel cannot take a [m, k] x [n, k]^T product, or None."""
    if k <= 0 or k % MULT_K:
        return f"K={k}: fp8_gemm needs a multiple of {MULT_K} (16-byte rows for the TMA copies)"
    if n <= 0 or n % MULT_N:
        return f"N={n}: fp8_gemm needs a multiple of {MULT_N}"
    return None


def supported(n: int, k: int) -> bool:
    return reason(1, n, k) is None


def split_for(n: int, k: int) -> int:
    """K slices of the swapped form: with fewer weight tiles (N / 64) than ``NUM_SMS``, the largest divisor of the
    K blocks that keeps one CTA a multiprocessor at most and at least ``MIN_SLICE_BLOCKS`` blocks a slice (the
    pipeline's depth); else 1. Decode reads the weights once, spread over as many multiprocessors as it can: N = 576
    (kv_a_proj) alone would be 9 CTAs."""
    tiles, kb = n // 64, -(-k // BLOCK_K)
    target = NUM_SMS // max(1, tiles)
    return max([d for d in range(1, kb + 1) if kb % d == 0 and d <= target and kb // d >= MIN_SLICE_BLOCKS],
               default=1)


def reduce_block(n: int) -> int:
    """Columns a CTA of the split-K reduce sums: 256 (the last CTA of a row partial where 256 does not divide n),
    or n below 256."""
    return min(256, n)


def configs_for(n: int, k: int, m: int) -> list[tuple[str, tuple]]:
    """The ``(kind, cfg)`` of every kernel :func:`fp8_gemm` launches for ``m`` rows: "swap" up to
    ``SWAP_MAX_ROWS`` rows (and "reduce" when K is sliced), else "tile"."""
    if m <= SWAP_MAX_ROWS:
        split = split_for(n, k)
        swap = ("swap", (int(n), int(k), rows_tile(m), split))
        return [swap] if split == 1 else [swap, ("reduce", (int(n), split, reduce_block(n)))]
    return [("tile", (int(n), int(k), 128, 128 if n % 128 == 0 else 64))]


def precompile(configs) -> None:
    """Compile ``(kind, cfg)`` pairs of :func:`configs_for`, nvcc in parallel threads."""
    _CACHE.precompile((kind, tuple(cfg)) for kind, cfg in configs)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out: torch.Tensor | None = None, config: tuple[str, tuple] | None = None) -> torch.Tensor:
    """``a`` [M, K] e4m3 with ``a_scale`` [M, ceil(K / 128)] fp32 times ``w`` [N, K] e4m3 with ``w_scale``
    [ceil(N / 128), ceil(K / 128)] fp32, transposed -> [M, N] bf16. ``config``: a ``(kind, cfg)`` to launch
    instead of the heuristic's (tuning runs). No host read of device values."""
    m, k = a.shape
    n, k2 = w.shape
    if k2 != k:
        raise ValueError(f"fp8_gemm: a has K={k} but w is [N={n}, K={k2}]")
    if (why := reason(m, n, k)) is not None:
        raise ValueError(why)
    kb, nb = -(-k // BLOCK_K), -(-n // SCALE_BLOCK)
    if tuple(a_scale.shape) != (m, kb) or tuple(w_scale.shape) != (nb, kb):
        raise ValueError(f"fp8_gemm: scales must be a_scale [{m}, {kb}] and w_scale [{nb}, {kb}], got "
                         f"{list(a_scale.shape)} and {list(w_scale.shape)}")
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: a and w must be float8_e4m3fn, got {a.dtype} and {w.dtype}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    kind, cfg = config or configs_for(n, k, m)[0]
    args = (a.contiguous(), a_scale.float().contiguous(), w.contiguous(), w_scale.float().contiguous())
    if kind == "tile":
        _CACHE.get(kind, tuple(cfg))(*args, out)
        return out
    split = cfg[3] if len(cfg) > 3 else 1
    if split == 1:
        _CACHE.get(kind, tuple(cfg))(*args, out.view(1, m, n))
        return out
    partial = torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    _CACHE.get(kind, tuple(cfg))(*args, partial)
    _CACHE.get("reduce", (n, split, reduce_block(n)))(partial, out)
    return out


CI_CONFIGS = [
    ("tile", (2048, 2048, 128, 128)),  # V2-Lite o_proj at prefill
    ("tile", (576, 7168, 128, 64)),  # V3 kv_a_proj (N not a multiple of 128) at prefill
    ("swap", (7168, 18432, 16, 1)),  # V3 dense down projection at batch 1
    ("swap", (3072, 2048, 64, 2)),  # V2-Lite q_proj at 64 rows, K in 2 slices
    ("swap", (3648, 2048, 16, 2)),  # V2-Lite q_proj + kv_a_proj at 1 row (fused_a_proj)
    ("swap", (2048, 10944, 16, 2)),  # V2-Lite dense down projection: a partial last K block
    ("reduce", (576, 4, 256)),  # kv_a_proj's 4 K slices summed (a partial last CTA a row)
    ("swap", (2048, 2048, 16, 4)),  # V2-Lite o_proj at 16 rows: 4 K steps a slice, scales read from global memory
    ("reduce", (2048, 4, 256)),  # its reduce (whole CTAs)
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations (sm_90a unless ``target``; no GPU, nothing cached); see
    tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)
