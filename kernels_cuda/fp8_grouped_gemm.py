"""Grouped FP8 block-scaled GEMM for the MoE experts (contiguous layout), in TileLang (Hopper, fp8 wgmma).

Op: the two GEMMs of ``fp8_grouped_mlp`` (backends/cpu/quant.py): ``out[rows of e] = dequant(a[rows of e]) @
dequant(w[e])^T`` in bf16, with ``a`` [M, K] e4m3 rows sorted by expert (``moe_dispatch``) and ``a_scale`` [M,
ceil(K / 128)] fp32 (``fp8_quant``), ``w`` [E, N, K] e4m3 with ``w_scale`` [E, ceil(N / 128), ceil(K / 128)] fp32, and
``starts`` = ``moe_gemm.expert_starts(tokens_per_expert)`` (exclusive row scan, then the experts that got rows;
device values, no host sync, CUDA-graph capturable). Promotion per 128-wide K block as ``fp8_gemm``.

Grid as ``moe_gemm``: (N / BN, min(E, M) hit-expert slots); a slot past the hit experts does nothing. A CTA
streams its expert's [BN, 128] weight tiles through a TMA pipeline. The A tile is loaded at the expert's row
offset without masking (rows past the expert's count belong to the next expert, or past M are zero-filled by the
TMA unit): an output row depends on its own A row only, and only the expert's rows are stored. Two forms, picked
on the host from the dispatched rows M:
  - "swap" (a few rows an expert, decode: 1 at batch 1, ~6 at batch 64 for V2-Lite's 64 experts / top-6):
    ``C^T [BN, RT] = W_tile [BN, 128] @ A [RT, 128]^T``, RT = 8 or 16 of the expert's rows a tile (an expert with
    more rows loops over row tiles, streaming its weights again).
  - "tile" (prefill): [BM, BN] = [64 or 128, 128] tiles, the expert's rows in row blocks.
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from .fp8_gemm import BLOCK_K, MULT_K, SCALE_BLOCK
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
SWAP_MAX_ROWS = 32  # mean rows an expert up to this: the swapped form
SWAP_8_ROWS = 4  # mean rows an expert up to this: 8-row tiles (a few experts may get more than 8: a second pass)
DEEP_K = 4096  # K from this: the swapped form's pipeline 6 tiles deep
MULT_N = 64


@cached_prim_func
def build_grouped(n: int, k: int, swap: bool, rows: int, block_n: int = 64, num_stages: int = 4,
                  staged_scales: bool = False):
    """PrimFunc for weights [E, n, k]; rows M and experts E are dynamic. ``swap``: ``rows`` (8 or 16) token rows
    as the wgmma's N side; else ``rows`` (64 or 128) as its M side. ``staged_scales`` (swapped form): the row tile's
    activation scales and the CTA's weight-scale row in shared memory before the K loop, as ``fp8_gemm``'s swapped
    form stages them (there 1.2-1.6x at 64 rows); here several CTAs share a multiprocessor and hide the loads'
    latency in part, so it stays a tuning variant (``bench.py fp8_grouped_gemm --fp8-sweep``) until measured."""
    assert tilelang is not None, "tilelang is not installed"
    assert k % MULT_K == 0 and n % block_n == 0 and SCALE_BLOCK % block_n == 0, (n, k, block_n)
    assert swap or not staged_scales, "staged scales: the swapped form only"
    N, K, BN, BK, R = n, k, block_n, BLOCK_K, rows
    KB, NB = -(-k // BLOCK_K), -(-n // SCALE_BLOCK)
    num_stages = max(1, min(num_stages, KB))  # no deeper than the K loop
    threads = 128 if swap or rows == 64 else 256
    fp8, bf16, f32 = T.float8_e4m3fn, T.bfloat16, T.float32
    M = T.dynamic("num_rows")
    E = T.dynamic("num_experts")
    S = T.dynamic("scan_len")
    acc_shape = [BN, R] if swap else [R, BN]

    @T.prim_func
    def fp8_grouped_gemm(
        A: T.Tensor([M, K], fp8),
        SA: T.Tensor([M, KB], f32),
        W: T.Tensor([E, N, K], fp8),
        SW: T.Tensor([E, NB, KB], f32),
        scan: T.Tensor([S], T.int32),  # moe_gemm.expert_starts: row starts [E + 1], then the hit experts
        Out: T.Tensor([M, N], bf16),
    ):
        with T.Kernel(N // BN, T.min(E, M), threads=threads) as (bn, slot):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            A_s = T.alloc_shared([R, BK], fp8)
            W_s = T.alloc_shared([BN, BK], fp8)
            C = T.alloc_fragment(acc_shape, f32)
            Acc = T.alloc_fragment(acc_shape, f32)
            if staged_scales:
                SA_s = T.alloc_shared([R, KB], f32)
                SW_s = T.alloc_shared([KB], f32)
            hit = scan[E + 1 + slot]
            e = T.max(hit, 0)  # a slot past the hit experts reads expert 0's range and does no row
            row0 = scan[e]
            cnt = T.if_then_else(hit >= 0, scan[e + 1] - row0, 0)
            for mb in T.serial(T.ceildiv(cnt, R)):
                T.clear(Acc)
                if staged_scales:
                    for i, kk in T.Parallel(R, KB):
                        SA_s[i, kk] = T.if_then_else(mb * R + i < cnt, SA[row0 + mb * R + i, kk], T.float32(0))
                    for kk in T.Parallel(KB):
                        SW_s[kk] = SW[e, bn * BN // SCALE_BLOCK, kk]
                for kb in T.Pipelined(KB, num_stages=num_stages):
                    T.copy(A[row0 + mb * R, kb * BK], A_s)
                    T.copy(W[e, bn * BN, kb * BK], W_s)
                    if swap:
                        T.gemm(W_s, A_s, C, transpose_B=True, clear_accum=True)
                        if staged_scales:
                            for j, i in T.Parallel(BN, R):
                                Acc[j, i] += C[j, i] * (SA_s[i, kb] * SW_s[kb])
                        else:
                            for j, i in T.Parallel(BN, R):
                                Acc[j, i] += C[j, i] * (
                                    T.if_then_else(mb * R + i < cnt, SA[row0 + mb * R + i, kb], T.float32(0))
                                    * SW[e, (bn * BN + j) // SCALE_BLOCK, kb])
                    else:
                        T.gemm(A_s, W_s, C, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(R, BN):
                            Acc[i, j] += C[i, j] * (
                                T.if_then_else(mb * R + i < cnt, SA[row0 + mb * R + i, kb], T.float32(0))
                                * SW[e, (bn * BN + j) // SCALE_BLOCK, kb])
                if swap:
                    for j, i in T.Parallel(BN, R):
                        if mb * R + i < cnt:
                            Out[row0 + mb * R + i, bn * BN + j] = T.cast(Acc[j, i], bf16)
                else:
                    for i, j in T.Parallel(R, BN):
                        if mb * R + i < cnt:
                            Out[row0 + mb * R + i, bn * BN + j] = T.cast(Acc[i, j], bf16)

    return fp8_grouped_gemm


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


_CACHE = KernelCache({"grouped": build_grouped}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels  # the warm-up links and loads what it finds here (backends/cuda/warmup.py)


def reason(n: int, k: int) -> str | None:
    if k <= 0 or k % MULT_K:
        return f"K={k}: fp8_grouped_gemm needs a multiple of {MULT_K} (16-byte rows for the TMA copies)"
    if n <= 0 or n % MULT_N:
        return f"N={n}: fp8_grouped_gemm needs a multiple of {MULT_N}"
    return None


def supported(n: int, k: int) -> bool:
    return reason(n, k) is None


def config_for(n: int, k: int, m: int, experts: int) -> tuple:
    """The ``build_grouped`` arguments :func:`fp8_grouped_gemm` launches for ``m`` rows over ``experts``, by the
    mean rows an expert (a host fact): swapped up to ``SWAP_MAX_ROWS``, with 8-row tiles up to ``SWAP_8_ROWS`` and
    16-row tiles above, and a pipeline 6 deep for long rows (K >= ``DEEP_K``); above, 64-row tiles, 128-row tiles
    past 256 rows an expert. Measured on an H200 (``bench.py fp8_grouped_gemm --fp8-sweep``, V2-Lite and V3 w13 at
    1 / 16 / 64 tokens): at V2-Lite's batch 64 (~6 rows an expert, up to 13) 16-row tiles took 93 us against 108
    (an expert past 8 rows streamed its weights twice); at V3's batch 1 a 6-deep pipeline took 60 us against 74;
    the other shapes moved less than 3 %."""
    mean = -(-m // max(1, experts))
    if mean <= SWAP_MAX_ROWS:
        return (int(n), int(k), True, 8 if mean <= SWAP_8_ROWS else 16, 64, 6 if k >= DEEP_K else 4)
    return (int(n), int(k), False, 64 if mean <= 256 else 128, 128 if n % 128 == 0 else 64)


def precompile(configs) -> None:
    _CACHE.precompile(("grouped", tuple(c)) for c in configs)


def fp8_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     starts: torch.Tensor, out: torch.Tensor | None = None, config: tuple | None = None
                     ) -> torch.Tensor:
    """[M, K] e4m3 rows sorted by expert (``a_scale`` [M, ceil(K / 128)]) x [E, N, K] e4m3 (``w_scale`` [E,
    ceil(N / 128), ceil(K / 128)]) -> [M, N] bf16, with ``starts`` = ``moe_gemm.expert_starts(tokens_per_expert)``.
    ``config``: the ``build_grouped`` arguments to launch instead of the heuristic's (tuning runs). No host read of
    device values."""
    m, k = a.shape
    e, n, k2 = w.shape
    if k2 != k:
        raise ValueError(f"fp8_grouped_gemm: a has K={k} but w is [E={e}, N={n}, K={k2}]")
    if (why := reason(n, k)) is not None:
        raise ValueError(why)
    kb, nb = -(-k // BLOCK_K), -(-n // SCALE_BLOCK)
    if tuple(a_scale.shape) != (m, kb) or tuple(w_scale.shape) != (e, nb, kb):
        raise ValueError(f"fp8_grouped_gemm: scales must be a_scale [{m}, {kb}] and w_scale [{e}, {nb}, {kb}], "
                         f"got {list(a_scale.shape)} and {list(w_scale.shape)}")
    if starts.shape[0] != 2 * e + 1 or starts.dtype != torch.int32:
        raise ValueError(f"fp8_grouped_gemm: starts must be expert_starts' int32 [2E+1] = [{2 * e + 1}] scan, got "
                         f"{starts.dtype} {list(starts.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    cfg = tuple(config) if config is not None else config_for(n, k, m, e)
    _CACHE.get("grouped", cfg)(a.contiguous(), a_scale.float().contiguous(), w.contiguous(),
                               w_scale.float().contiguous(), starts, out)
    return out


CI_CONFIGS = [
    ("grouped", (2816, 2048, True, 8, 64)),  # V2-Lite w13 at decode
    ("grouped", (4096, 7168, True, 8, 64, 6)),  # V3 w13 at batch 1: the 6-deep pipeline
    ("grouped", (2816, 2048, True, 16, 64, 4, True)),  # V2-Lite w13 at batch 64, scales staged (a tuning variant)
    ("grouped", (2048, 1408, False, 64, 128)),  # V2-Lite w2 at prefill
    ("grouped", (4096, 7168, False, 128, 128)),  # V3 w13 at a large prefill
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations (sm_90a unless ``target``; no GPU, nothing cached); see
    tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)
