"""The decode form of ``fp8_gemm``: "swap" (weights on the wgmma's M side, tokens on its N side, K sliced over more
CTAs where N / 64 is short of the multiprocessors) and the one-launch reduction of the K slices' fp32 partial sums.
The forms, their numerics and the host API: ``fp8_gemm``'s module docstring."""

from ._prim_func_cache import cached_prim_func
from ._tilelang import T, tilelang

BLOCK_K = 128  # one scale block of K per pipeline stage: the promotion happens after every stage
SCALE_BLOCK = 128
MULT_K = 16  # 16-byte rows for the TMA copies; a partial last K block is zero-filled by the TMA unit
# Staged scales (below) from this many K steps a slice, or with row tiles past 16: a 16-row tile over 4 K steps
# ran 0.3-0.4 us faster reading its scales from global memory (the staging's one load up front is not paid back)
STAGE_MIN_STEPS = 5


@cached_prim_func
def build_fp8_gemm_swap(n: int, k: int, rt: int, split: int = 1, block_n: int = 64, num_stages: int = 4,
                        threads: int = 128, staged_scales: bool | None = None):
    """PrimFunc of the "swap" form for w [n, k]: ``rt`` token rows a tile (wgmma N), ``block_n`` weight rows a
    CTA (wgmma M), K in ``split`` equal slices (one CTA each); rows M are dynamic (more than ``rt``: row tiles in
    a loop). ``split`` 1 writes ``Out`` [1, M, N] bf16; more write fp32 partial sums [split, M, N] for
    :func:`build_split_reduce`.

    ``staged_scales``: the row tile's activation scales and the CTA's weight-scale row for its K slice are copied
    to shared memory before the K loop, so the promotion after each K step reads shared memory. Read from global
    memory there instead (``False``), every K step waits one load latency after its wgmma: one CTA a
    multiprocessor has nothing else to run meanwhile (the same arithmetic either way). ``None``: staged with row
    tiles past 16 or K slices of ``STAGE_MIN_STEPS`` blocks or more (measured on an H200: docs/kernels/fp8.md)."""
    assert tilelang is not None, "tilelang is not installed"
    KB, NB = -(-k // BLOCK_K), -(-n // SCALE_BLOCK)
    assert k % MULT_K == 0 and n % block_n == 0 and rt in (8, 16, 32, 64) and KB % split == 0, (n, k, rt, split)
    if staged_scales is None:
        staged_scales = (rt > 16 or KB // split >= STAGE_MIN_STEPS) and SCALE_BLOCK % block_n == 0
    assert not staged_scales or SCALE_BLOCK % block_n == 0, (block_n, "one weight-scale row a CTA")
    N, K, BN, BK, RT, S, KBS = n, k, block_n, BLOCK_K, rt, split, KB // split
    num_stages = max(1, min(num_stages, KBS))  # no deeper than the K loop
    fp8, bf16, f32 = T.float8_e4m3fn, T.bfloat16, T.float32
    out_dtype = bf16 if split == 1 else f32
    M = T.dynamic("num_rows")

    @T.prim_func
    def fp8_gemm_swap(
        A: T.Tensor([M, K], fp8),
        SA: T.Tensor([M, KB], f32),
        W: T.Tensor([N, K], fp8),
        SW: T.Tensor([NB, KB], f32),
        Out: T.Tensor([S, M, N], out_dtype),
    ):
        with T.Kernel(N // BN, S, threads=threads) as (bn, ks):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            A_s = T.alloc_shared([RT, BK], fp8)
            W_s = T.alloc_shared([BN, BK], fp8)
            C = T.alloc_fragment([BN, RT], f32)  # C^T: weight rows x token rows
            Acc = T.alloc_fragment([BN, RT], f32)
            if staged_scales:
                SA_s = T.alloc_shared([RT, KBS], f32)
                SW_s = T.alloc_shared([KBS], f32)
            for mb in T.serial(T.ceildiv(M, RT)):
                T.clear(Acc)
                if staged_scales:
                    for i, kk in T.Parallel(RT, KBS):
                        SA_s[i, kk] = T.if_then_else(mb * RT + i < M, SA[mb * RT + i, ks * KBS + kk], T.float32(0))
                    for kk in T.Parallel(KBS):
                        SW_s[kk] = SW[bn * BN // SCALE_BLOCK, ks * KBS + kk]
                for kk in T.Pipelined(KBS, num_stages=num_stages):
                    kb = ks * KBS + kk
                    T.copy(A[mb * RT, kb * BK], A_s)  # rows past M read as zero (bounds-checked copy)
                    T.copy(W[bn * BN, kb * BK], W_s)
                    T.gemm(W_s, A_s, C, transpose_B=True, clear_accum=True)
                    if staged_scales:
                        for j, i in T.Parallel(BN, RT):
                            Acc[j, i] += C[j, i] * (SA_s[i, kk] * SW_s[kk])
                    else:
                        for j, i in T.Parallel(BN, RT):
                            Acc[j, i] += C[j, i] * (
                                T.if_then_else(mb * RT + i < M, SA[mb * RT + i, kb], T.float32(0))
                                * SW[(bn * BN + j) // SCALE_BLOCK, kb])
                for j, i in T.Parallel(BN, RT):
                    if mb * RT + i < M:
                        Out[ks, mb * RT + i, bn * BN + j] = T.cast(Acc[j, i], out_dtype)

    return fp8_gemm_swap


@cached_prim_func
def build_split_reduce(n: int, split: int, block: int = 256):
    """PrimFunc summing the swapped form's fp32 K-slice partials [split, M, n] into [M, n] bf16 (one row's
    ``block`` columns a CTA, two a thread; where ``block`` does not divide n the last CTA of a row stops at n:
    n = 3648, q + kv_a, in 64-column CTAs of 32 threads took 3 us at 64 rows)."""
    assert tilelang is not None, "tilelang is not installed"
    assert block % 64 == 0 and n % 64 == 0, (n, block)
    N, S, BC = n, split, block
    bf16, f32 = T.bfloat16, T.float32
    M = T.dynamic("num_rows")
    tail = N % BC != 0

    @T.prim_func
    def fp8_gemm_split_reduce(P: T.Tensor([S, M, N], f32), Out: T.Tensor([M, N], bf16)):
        with T.Kernel(M, T.ceildiv(N, BC), threads=BC // 2) as (m, bc):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            acc = T.alloc_fragment([BC], f32)
            T.clear(acc)
            for s in T.serial(S):
                for j in T.Parallel(BC):
                    if tail:
                        if bc * BC + j < N:
                            acc[j] += P[s, m, bc * BC + j]
                    else:
                        acc[j] += P[s, m, bc * BC + j]
            for j in T.Parallel(BC):
                if tail:
                    if bc * BC + j < N:
                        Out[m, bc * BC + j] = T.cast(acc[j], bf16)
                else:
                    Out[m, bc * BC + j] = T.cast(acc[j], bf16)

    return fp8_gemm_split_reduce
