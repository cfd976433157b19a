"""Grouped expert GEMM for MoE decode (bf16, Hopper), in TileLang: ``out[rows of e] = a[rows of e] @ w[e]^T``.

Op: the two GEMMs of ``grouped_mlp`` (docs/interfaces.md §2): ``a`` [M, K] bf16 holds the dispatched rows sorted by
expert (``moe_dispatch``), ``tokens_per_expert`` [E] the row count of each expert, ``w`` [E, N, K] bf16 the
experts' weights (the checkpoint's ``[out, in]`` layout). Result [M, N] bf16, fp32 accumulation.

Why a kernel of our own: on decode each expert holds a handful of rows (1 token at batch 1, ~6 at batch 64 for
64 experts / top-6), so the step is a stream over the weights of the experts that were hit. CUTLASS's grouped GEMM
(``torch._grouped_mm``) ran at ~45 % of the copy bandwidth at batch 1 (37 + 26 us per V2-Lite layer for 104 MB) on
an H200. Here one CTA owns one (N tile, hit expert): a one-CTA scan kernel (``expert_scan``, shared by both
GEMMs of an MLP) writes the exclusive scan of the counts and the list of experts that got rows (device values, no
host sync, CUDA-graph capturable); the GEMM's grid has min(E, M) expert slots, since M rows hit at most M
experts, so at batch 1 (6 rows) it launches 6 x N/BLOCK_N CTAs instead of one per (expert, N tile) with most
exiting at once (the first version: 31.5 us for w13 at 1 token, of which the empty CTAs' scheduling and the
uneven spread of the busy ones over the SMs). Each CTA streams its [BLOCK_N, K] weight tile through a multi-stage
pipeline into wgmma with the rows padded to BLOCK_M = 64 (the wgmma minimum; compute is free here, bytes are
not). Experts with more than 64 rows loop over row blocks (prefill-sized batches should use the library GEMM: the
backend routes by the host row count).

``gated=True`` fuses the SwiGLU as ``moe_gemm_swap`` does: ``w`` is [gate | up] = [E, 2I, K], a CTA streams the
matching gate and up tiles into one [2 BLOCK_N, 64] stage (one wgmma) and writes ``silu(bf16(a @ gate^T)) *
bf16(a @ up^T)`` [M, I] with the CPU reference's roundings: no [M, 2I] intermediate, no ``silu_mul`` launch, for
the batches past ``moe_gemm_swap``'s (about 20 rows an expert and more).
"""

import torch

from ._ast_guard import compile_pool
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
BLOCK_M, BLOCK_K = 64, 64


MAX_EXPERTS = 256  # expert_scan: one thread per expert


@cached_prim_func
def build_expert_scan():
    """PrimFunc (counts [E] i64, scan [2E+1] i32 out): scan[0:E+1] = exclusive prefix sum of the counts (scan[E] =
    rows); scan[E+1 : E+1+h] = the h experts with rows, ascending; scan[E+1+h : 2E+1] = -1. One CTA, Hillis-Steele
    in shared memory (8 steps for 256 experts)."""
    assert tilelang is not None, "tilelang is not installed"
    NT = MAX_EXPERTS
    LOG = (NT - 1).bit_length()
    i32 = T.int32
    E = T.dynamic("num_experts")
    S = T.dynamic("scan_len")

    @T.prim_func
    def expert_scan(counts: T.Tensor([E], T.int64), scan: T.Tensor([S], i32)):
        with T.Kernel(1, threads=NT) as _bx:
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            tid = T.get_thread_binding()
            rows = T.alloc_shared([2, NT], i32)
            hits = T.alloc_shared([2, NT], i32)
            c = T.alloc_var(i32)
            c = 0
            if tid < E:
                c = T.Cast(i32, counts[tid])
            rows[0, tid] = c
            hits[0, tid] = T.if_then_else(c > 0, 1, 0)
            T.sync_threads()
            for step in T.unroll(LOG, explicit=True):
                if tid >= (1 << step):
                    rows[(step + 1) % 2, tid] = rows[step % 2, tid] + rows[step % 2, tid - (1 << step)]
                    hits[(step + 1) % 2, tid] = hits[step % 2, tid] + hits[step % 2, tid - (1 << step)]
                else:
                    rows[(step + 1) % 2, tid] = rows[step % 2, tid]
                    hits[(step + 1) % 2, tid] = hits[step % 2, tid]
                T.sync_threads()
            if tid < E:
                scan[tid] = rows[LOG % 2, tid] - c
                if c > 0:
                    scan[E + hits[LOG % 2, tid]] = tid  # E + 1 + (inclusive hit count - 1)
                if tid >= hits[LOG % 2, NT - 1]:
                    scan[E + 1 + tid] = -1
            if tid == 0:
                scan[E] = rows[LOG % 2, NT - 1]

    return expert_scan


@cached_prim_func
def build_moe_gemm(n: int, k: int, block_n: int = 128, num_stages: int = 3, threads: int = 128, gated: bool = False):
    """PrimFunc for weights [E, n, k]; rows M and experts E are dynamic. n % block_n == 0, k % BLOCK_K == 0.
    ``gated``: n = 2I, the output is [M, I] (SwiGLU), ``block_n`` output columns a CTA (its weight tile: the
    matching ``block_n`` gate rows and ``block_n`` up rows)."""
    assert tilelang is not None, "tilelang is not installed"
    NO = n // 2 if gated else n
    assert NO % block_n == 0 and k % BLOCK_K == 0 and (not gated or n % 2 == 0), (n, k, block_n, gated)
    K, BM, BN, BK = k, BLOCK_M, block_n, BLOCK_K
    WR = 2 * BN if gated else BN  # weight rows a K step: [gate | up] tiles when gated
    dtype, acc, f32 = T.bfloat16, T.float32, T.float32
    M = T.dynamic("num_rows")
    E = T.dynamic("num_experts")
    S = T.dynamic("scan_len")

    @T.prim_func
    def moe_gemm(
        A: T.Tensor([M, K], dtype),
        W: T.Tensor([E, n, K], dtype),
        scan: T.Tensor([S], T.int32),  # expert_scan: row starts [E + 1], then the hit experts (-1 padded)
        Out: T.Tensor([M, NO], dtype),
    ):
        with T.Kernel(NO // BN, T.min(E, M), threads=threads) as (bn, slot):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            A_s = T.alloc_shared([BM, BK], dtype)
            # gated: the gate tile's rows, then the up tile's, in one buffer read by one GEMM (two GEMMs on one A
            # stage raced in TileLang 0.1.15's pipeline: moe_gemm_swap's docstring)
            B_s = T.alloc_shared([WR, BK], dtype)
            C = T.alloc_fragment([BM, WR], acc)
            hit = scan[E + 1 + slot]
            e = T.max(hit, 0)  # a slot past the hit experts reads expert 0's range and does no row
            row0 = scan[e]
            cnt = T.if_then_else(hit >= 0, scan[e + 1] - row0, 0)
            if gated:
                C_s = T.alloc_shared([BM, WR], acc)  # the epilogue pairs gate column j with up column BN + j here
            for mb in T.serial(T.ceildiv(cnt, BM)):
                T.clear(C)
                for kk in T.Pipelined(K // BK, num_stages=num_stages):
                    for i, j in T.Parallel(BM, BK):  # rows past this expert's range read as zero
                        A_s[i, j] = T.if_then_else(
                            mb * BM + i < cnt, A[row0 + mb * BM + i, kk * BK + j], T.cast(0, dtype)
                        )
                    if gated:
                        T.copy(W[e, bn * BN : (bn + 1) * BN, kk * BK : (kk + 1) * BK], B_s[0:BN, :])
                        T.copy(W[e, NO + bn * BN : NO + (bn + 1) * BN, kk * BK : (kk + 1) * BK], B_s[BN : 2 * BN, :])
                    else:
                        T.copy(W[e, bn * BN : (bn + 1) * BN, kk * BK : (kk + 1) * BK], B_s)
                    T.gemm(A_s, B_s, C, transpose_B=True)
                if gated:  # the reference's roundings: bf16 GEMM outputs, silu, product
                    T.copy(C, C_s)
                    for i, j in T.Parallel(BM, BN):
                        if mb * BM + i < cnt:
                            gv = T.cast(T.cast(C_s[i, j], dtype), f32)
                            sv = T.cast(gv / (T.float32(1) + T.exp(-gv)), dtype)
                            Out[row0 + mb * BM + i, bn * BN + j] = T.cast(
                                T.cast(sv, f32) * T.cast(T.cast(C_s[i, BN + j], dtype), f32), dtype)
                else:
                    for i, j in T.Parallel(BM, BN):
                        if mb * BM + i < cnt:
                            Out[row0 + mb * BM + i, bn * BN + j] = T.cast(C[i, j], dtype)

    return moe_gemm


_KERNELS: dict = {}


def pick_block_n(n: int, rows: int, gated: bool = False) -> int:
    """Host heuristic. Measured on an H200 (V2-Lite experts, 1 / 16 / 64 tokens x top-6): BLOCK_N 128 with 3
    stages was within 5 % of the best variant everywhere; 64 only where N is not a multiple of 128. Gated: 64
    output columns, i.e. the same 128 weight rows a K step."""
    if gated:
        return 64
    return 128 if n % 128 == 0 else 64


def supported(n: int, k: int, gated: bool = False) -> bool:
    no = n // 2 if gated else n
    return (not gated or n % 2 == 0) and no % 64 == 0 and k % BLOCK_K == 0


def get_kernel(n: int, k: int, block_n: int, num_stages: int = 3, gated: bool = False):
    key = (n, k, block_n, num_stages, bool(gated))
    if key not in _KERNELS:
        func = _build(n, k, block_n, num_stages, gated)
        _KERNELS[key] = tilelang.compile(func, out_idx=None, target=dict(SM90_TARGET))
    return _KERNELS[key]


_SCAN: list = []


def expert_starts(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``expert_scan`` of the per-expert row counts (int64 [E], E <= 256), int32 [2E + 1]: the exclusive scan of the
    counts, then the experts that got rows, -1 padded. One launch, shared by the two GEMMs of one MLP."""
    e = tokens_per_expert.shape[0]
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"moe_gemm: {e} experts; expert_scan handles 1..{MAX_EXPERTS}")
    if not _SCAN:
        _SCAN.append(tilelang.compile(build_expert_scan(), out_idx=None, target=dict(SM90_TARGET)))
    scan = torch.empty(2 * e + 1, dtype=torch.int32, device=tokens_per_expert.device)
    _SCAN[0](tokens_per_expert.to(torch.int64).contiguous(), scan)
    return scan


def moe_gemm(a: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, out: torch.Tensor | None = None,
             block_n: int | None = None, num_stages: int = 3, starts: torch.Tensor | None = None,
             gated: bool = False) -> torch.Tensor:
    """[M, K] rows sorted by expert x [E, N, K] -> [M, N] bf16 (gated: [M, N / 2], the SwiGLU of the [gate | up]
    halves; no host read of device values). ``starts``: the :func:`expert_starts` scan of ``tokens_per_expert`` when
    the caller already has it ([2E + 1] int32)."""
    m, k = a.shape
    e, n, k2 = w.shape
    if k2 != k:
        raise ValueError(f"moe_gemm: a has K={k} but w is [E={e}, N={n}, K={k2}]")
    if tokens_per_expert.shape[0] != e:
        raise ValueError(f"moe_gemm: tokens_per_expert has {tokens_per_expert.shape[0]} entries for {e} experts")
    if gated and not supported(n, k, True):
        raise ValueError(f"moe_gemm: gated N={n}, K={k}: needs an even N with N / 2 % 64 == 0 and K % {BLOCK_K} == 0")
    if starts is None:
        starts = expert_starts(tokens_per_expert)
    elif starts.shape[0] != 2 * e + 1 or starts.dtype != torch.int32:
        raise ValueError(f"moe_gemm: starts must be expert_starts' int32 [2E+1] = [{2 * e + 1}] scan, got "
                         f"{starts.dtype} {list(starts.shape)}")
    if out is None:
        out = torch.empty(m, n // 2 if gated else n, dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    kern = get_kernel(n, k, block_n or pick_block_n(n, m, gated), num_stages, gated)
    kern(a.contiguous(), w, starts, out)
    return out


# (kind, get_kernel's arguments): the gated and the plain GEMM are different code, so a compile check that keeps one
# configuration a kind (tests/kernel_compiles.py) builds both; V2-Lite w13 gated, w13, w2
CI_CONFIGS = [("gated", (2816, 2048, 64, 3, True)), ("gemm", (2816, 2048, 128)), ("gemm", (2048, 1408, 64))]


def _build(n: int, k: int, block_n: int, num_stages: int = 3, gated: bool = False):
    """``build_moe_gemm`` by :func:`get_kernel`'s arguments (the warm-up's and the CI configurations' layout)."""
    return build_moe_gemm(n, k, block_n, num_stages, gated=bool(gated))


def ci_compile(configs=None, target=None):
    """Compile representative configurations and the expert scan for sm_90a (or ``target``; no GPU, no cache); see
    tests/kernels_cuda."""

    # parse on this thread (ast is not thread-safe)
    funcs = [_build(*cfg) for _kind, cfg in (configs or CI_CONFIGS)] + [build_expert_scan()]

    def one(func):
        return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))

    with compile_pool(len(funcs)) as ex:
        return list(ex.map(one, funcs))
