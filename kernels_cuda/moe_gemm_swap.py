"""Grouped expert GEMM for a few rows an expert (decode), operands swapped, in TileLang (bf16, Hopper).

Op: the two GEMMs of ``grouped_mlp`` (docs/interfaces.md §2), as in ``moe_gemm``: ``a`` [M, K] bf16 rows sorted by
expert, ``w`` [E, N, K] bf16, ``expert_starts``' scan; result [M, N] bf16 with fp32 accumulation. ``gated=True``
fuses the SwiGLU: ``w`` is [gate | up] = [E, 2I, K] and the result [M, I] is ``silu(bf16(a @ gate^T)) *
bf16(a @ up^T)`` with the CPU reference's roundings (as ``silu_mul``: silu in fp32 rounded to bf16, the product in
fp32 rounded to bf16; precise expf).

Why: at batch 1 each hit expert holds one row, but ``moe_gemm`` pads the rows to the 64-row wgmma minimum and
fills that A tile with a synchronous masked loop at every K step (64 x 64 values, one of them real). On an H200
(profile_decode.py, batch 1) its two GEMMs took ~21.7 + ~14 us a V2-Lite layer against ~16 + ~8 us of weight
bytes at the copy bandwidth, 0.93 ms of a 2.8 ms step. Here the weight tile is the wgmma M side and the rows are
its N side: ``C^T [BLOCK_N, RT] = W_tile [BLOCK_N, K] @ A_rows [RT, K]^T`` with RT = 8 or 16 (wgmma's N goes down
to 8), so a K step fills an 8-row A tile and the pipeline carries weights only. Gated, a CTA streams the matching
gate and up tiles into one [2 BLOCK_N, 64] stage (one wgmma, the up rows below the gate rows) and writes the
activation: no [M, 2I] intermediate, no ``silu_mul`` launch. (Two wgmmas on one cp.async row tile raced: TileLang
0.1.15 freed the rows' stage after the first, and the producer refilled it under the second; 24 outputs of a V3-shape
case were off by up to 0.2 on an H200. tests/kernels_cuda/test_compile.py checks the generated code for this.) Grid: (output columns / BLOCK_N, min(E, M) hit-expert slots), as ``moe_gemm``; an expert with
more than RT rows loops over row tiles (correct for any count, fast for few).

Checked on an H200 against the fp32 reference in 13 cases (tests/kernels_cuda/test_moe_gemm_swap.py: bf16 within
2 ulp + 1e-2, gated 4 ulp; NaN positions equal; cosine > 0.99999); ``bench.py moe_gemm_swap`` times it against
``moe_gemm`` + ``silu_mul`` on the V2-Lite expert shapes.
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
BLOCK_K = 64
BLOCK_N = 64  # weight rows a CTA in the engine's launches (supported() asks output columns % 64 == 0)
ROWS_TILES = (8, 16, 32, 64)  # RT, wgmma's N side: an expert with more rows than RT streams its weights again
MAX_ROWS_TILE = ROWS_TILES[-1]


def rows_tile(m: int, experts: int | None = None) -> int:
    """The engine's RT for ``m`` dispatched rows over ``experts`` experts: every expert holds at most ``m``, so up to
    16 rows the tile covers each expert at once; up to 64 rows 16; above, 16 while 1.5 times an expert's mean rows
    fit it, else 32 (a busier expert loops: its weights are read once a tile). 64-row tiles were slower than
    32-row ones at every size measured (docs/kernels/moe_gemm_swap.md); they remain for tuning runs."""
    if m <= 8:
        return 8
    if m <= 64 or not experts or 1.5 * m / experts <= 16:
        return 16
    return 32


@cached_prim_func
def build_moe_gemm_swap(n: int, k: int, rt: int, gated: bool = False, block_n: int = BLOCK_N, num_stages: int = 4,
                        threads: int = 128):
    """PrimFunc for weights [E, n, k] (gated: n = 2I, output I columns); rows M and experts E are dynamic.
    ``rt``: rows a tile (the wgmma N side, one of ROWS_TILES); ``block_n``: weight rows a CTA (the wgmma M side, 64
    or 128)."""
    assert tilelang is not None, "tilelang is not installed"
    NO = n // 2 if gated else n
    assert NO % block_n == 0 and k % BLOCK_K == 0 and rt in ROWS_TILES, (n, k, block_n, rt)
    K, BN, BK, RT = k, block_n, BLOCK_K, rt
    WR = 2 * BN if gated else BN  # weight rows a K step: [gate | up] tiles when gated
    dtype, acc, f32 = T.bfloat16, T.float32, T.float32
    M = T.dynamic("num_rows")
    E = T.dynamic("num_experts")
    S = T.dynamic("scan_len")

    @T.prim_func
    def moe_gemm_swap(
        A: T.Tensor([M, K], dtype),
        W: T.Tensor([E, n, K], dtype),
        scan: T.Tensor([S], T.int32),  # moe_gemm.expert_starts: row starts [E + 1], then the hit experts
        Out: T.Tensor([M, NO], dtype),
    ):
        with T.Kernel(NO // BN, T.min(E, M), threads=threads) as (bn, slot):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            A_s = T.alloc_shared([RT, BK], dtype)
            # gated: the gate tile's rows, then the up tile's, in one buffer read by one GEMM. With two GEMMs on one
            # A_s, TileLang's warp-specialised pipeline freed a stage's cp.async rows once the first GEMM was done,
            # so the producer could refill them while the second still read them (wrong sums at V3 shapes).
            W_s = T.alloc_shared([WR, BK], dtype)
            C = T.alloc_fragment([WR, RT], acc)  # C^T: weight rows x token rows
            C_s = T.alloc_shared([WR, RT], acc)  # gated: the epilogue pairs gate row j with up row BN + j here
            hit = scan[E + 1 + slot]
            e = T.max(hit, 0)  # a slot past the hit experts reads expert 0's range and does no row
            row0 = scan[e]
            cnt = T.if_then_else(hit >= 0, scan[e + 1] - row0, 0)
            for mb in T.serial(T.ceildiv(cnt, RT)):
                T.clear(C)
                for kk in T.Pipelined(K // BK, num_stages=num_stages):
                    for i, j in T.Parallel(RT, BK):  # rows past this expert's range read as zero
                        A_s[i, j] = T.if_then_else(
                            mb * RT + i < cnt, A[row0 + mb * RT + i, kk * BK + j], T.cast(0, dtype)
                        )
                    T.copy(W[e, bn * BN : (bn + 1) * BN, kk * BK : (kk + 1) * BK], W_s[0:BN, :])
                    if gated:
                        T.copy(W[e, NO + bn * BN : NO + (bn + 1) * BN, kk * BK : (kk + 1) * BK], W_s[BN : 2 * BN, :])
                    T.gemm(W_s, A_s, C, transpose_B=True)
                if gated:  # the reference's roundings: bf16 GEMM outputs, bf16 silu, bf16 product
                    T.copy(C, C_s)
                    for j, i in T.Parallel(BN, RT):
                        if mb * RT + i < cnt:
                            gv = T.cast(T.cast(C_s[j, i], dtype), f32)
                            s = T.cast(gv / (T.float32(1) + T.exp(-gv)), dtype)
                            Out[row0 + mb * RT + i, bn * BN + j] = T.cast(
                                T.cast(s, f32) * T.cast(T.cast(C_s[BN + j, i], dtype), f32), dtype)
                else:
                    for j, i in T.Parallel(BN, RT):
                        if mb * RT + i < cnt:
                            Out[row0 + mb * RT + i, bn * BN + j] = T.cast(C[j, i], dtype)

    return moe_gemm_swap


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


_CACHE = KernelCache({"swap": build_moe_gemm_swap}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels


def supported(n: int, k: int, gated: bool) -> bool:
    no = n // 2 if gated else n
    return (not gated or n % 2 == 0) and no % BLOCK_N == 0 and k % BLOCK_K == 0


def config_for(n: int, k: int, m: int, gated: bool, experts: int | None = None) -> tuple:
    """The cache key :func:`moe_gemm_swap` launches for ``m`` rows over ``experts`` experts."""
    return (int(n), int(k), rows_tile(m, experts), bool(gated), BLOCK_N)


def precompile(configs):
    _CACHE.precompile(("swap", tuple(c)) for c in configs)


def moe_gemm_swap(a: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, gated: bool = False,
                  out: torch.Tensor | None = None, block_n: int | None = None,
                  num_stages: int | None = None, rows_tile_: int | None = None) -> torch.Tensor:
    """[M, K] rows sorted by expert x [E, N, K] -> [M, N] (gated: [M, N / 2]) bf16, with ``starts`` =
    ``moe_gemm.expert_starts(tokens_per_expert)``. No host read of device values."""
    m, k = a.shape
    e, n, k2 = w.shape
    if k2 != k:
        raise ValueError(f"moe_gemm_swap: a has K={k} but w is [E={e}, N={n}, K={k2}]")
    if starts.shape[0] != 2 * e + 1 or starts.dtype != torch.int32:
        raise ValueError(f"moe_gemm_swap: starts must be expert_starts' int32 [2E+1] = [{2 * e + 1}] scan, got "
                         f"{starts.dtype} {list(starts.shape)}")
    if not supported(n, k, gated):
        raise ValueError(f"moe_gemm_swap: N={n} (gated={gated}), K={k}: needs output columns % 64 == 0, K % 64 == 0")
    no = n // 2 if gated else n
    if out is None:
        out = torch.empty(m, no, dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    cfg = config_for(n, k, m, gated, e)
    if block_n is not None or num_stages is not None or rows_tile_ is not None:  # tuning runs
        if rows_tile_ is not None and rows_tile_ not in ROWS_TILES:
            raise ValueError(f"moe_gemm_swap: rows_tile_={rows_tile_}; one of {ROWS_TILES}")
        cfg = (cfg[0], cfg[1], rows_tile_ or cfg[2], cfg[3], block_n or cfg[4], num_stages or 4)
    _CACHE.get("swap", cfg)(a.contiguous(), w, starts, out)
    return out


CI_CONFIGS = [
    ("swap", (2816, 2048, 8, True, 64)),  # V2-Lite w13 at batch 1, SwiGLU fused
    ("swap", (2048, 1408, 16, False, 64)),  # V2-Lite w2 at a few tokens
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations (no GPU, nothing cached); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)
