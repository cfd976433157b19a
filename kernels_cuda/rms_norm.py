"""Fused residual add + RMSNorm (and plain RMSNorm) for Hopper, in TileLang.

Op contract: docs/interfaces.md §2 ``rms_norm(x, weight, eps) -> y`` and
``add_rms_norm(x, residual, weight, eps) -> (y, x + residual)``; shapes [T, N], bf16.
Semantics follow the CPU reference (backends/cpu/norm.py): s = bf16(x + residual); the mean square of s in
fp32; y = bf16(weight * bf16(s * rsqrt(mean(s^2) + eps))).

Kernel: BLOCK_M rows per CTA, the whole row in registers (N up to 7168 bf16 at 256 threads: 28 values a
thread), one pass over memory: read x (+ residual), write y (+ the new residual).
Memory-bound: bytes = T*N*2*(2 or 4).
"""

import functools

import torch

from ._ast_guard import compile_pool
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}


@cached_prim_func
def build_rms_norm(hidden: int, with_residual: bool, eps: float, block_m: int = 1, threads: int = 256):
    """PrimFunc for rows of width `hidden` (compile-time); the number of rows is dynamic."""
    assert tilelang is not None, "tilelang is not installed"
    N, BM = hidden, block_m
    dtype, acc = T.bfloat16, T.float32
    M = T.dynamic("num_rows")
    inv_n = 1.0 / N

    @T.macro
    def normalise(s, W, Y, bx):
        """Rows ``s`` [BM, N] (bf16 fragment) -> Y rows bx * BM ..: the reference's roundings (module docstring)."""
        sq = T.alloc_fragment([BM, N], acc)
        y = T.alloc_fragment([BM, N], dtype)
        ss = T.alloc_fragment([BM], acc)
        for i, j in T.Parallel(BM, N):
            sq[i, j] = T.cast(s[i, j], acc) * T.cast(s[i, j], acc)
        T.reduce_sum(sq, ss, dim=1)
        for i in T.Parallel(BM):
            ss[i] = T.rsqrt(ss[i] * inv_n + eps)
        for i, j in T.Parallel(BM, N):
            y[i, j] = T.cast(
                T.cast(T.cast(T.cast(s[i, j], acc) * ss[i], dtype), acc) * T.cast(W[j], acc), dtype
            )
        T.copy(y, Y[bx * BM : (bx + 1) * BM, :])

    if with_residual:

        @T.prim_func
        def add_rms_norm(
            X: T.Tensor([M, N], dtype),
            R: T.Tensor([M, N], dtype),
            W: T.Tensor([N], dtype),
            Y: T.Tensor([M, N], dtype),
            R_out: T.Tensor([M, N], dtype),
        ):
            with T.Kernel(T.ceildiv(M, BM), threads=threads) as bx:
                T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
                T.pdl_trigger()
                x = T.alloc_fragment([BM, N], dtype)
                r = T.alloc_fragment([BM, N], dtype)
                s = T.alloc_fragment([BM, N], dtype)
                T.copy(X[bx * BM : (bx + 1) * BM, :], x)
                T.copy(R[bx * BM : (bx + 1) * BM, :], r)
                for i, j in T.Parallel(BM, N):
                    s[i, j] = T.cast(T.cast(x[i, j], acc) + T.cast(r[i, j], acc), dtype)
                T.copy(s, R_out[bx * BM : (bx + 1) * BM, :])
                normalise(s, W, Y, bx)

        return add_rms_norm

    @T.prim_func
    def rms_norm(
        X: T.Tensor([M, N], dtype),
        W: T.Tensor([N], dtype),
        Y: T.Tensor([M, N], dtype),
    ):
        with T.Kernel(T.ceildiv(M, BM), threads=threads) as bx:
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            x = T.alloc_fragment([BM, N], dtype)
            T.copy(X[bx * BM : (bx + 1) * BM, :], x)
            normalise(x, W, Y, bx)

    return rms_norm


@functools.cache
def get_kernel(hidden: int, with_residual: bool, eps: float):
    assert tilelang is not None, "tilelang is not installed"
    return tilelang.compile(
        build_rms_norm(hidden, with_residual, float(eps)), out_idx=None, target=dict(SM90_TARGET)
    )


CI_CONFIGS = [(7168, True, 1e-6), (2048, False, 1e-6)]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""

    cfgs = configs or CI_CONFIGS

    funcs = [build_rms_norm(*c) for c in cfgs]  # AST parsing on this thread (ast.parse is not thread-safe)

    def one(func):
        return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))

    with compile_pool(len(funcs)) as ex:
        return list(ex.map(one, funcs))


def precompile(configs, num_workers=None):
    """Compile several (hidden, with_residual, eps) in parallel (nvcc in threads), then fill get_kernel's cache from
    TileLang's (no recompile), so that the first launch finds its kernel."""

    configs = [(int(n), bool(r), float(eps)) for n, r, eps in dict.fromkeys(configs)]
    if not configs:
        return
    funcs = [build_rms_norm(*c) for c in configs]  # AST parsing on this thread (ast.parse is not thread-safe)

    def one(func):
        return tilelang.compile(func, out_idx=None, target=dict(SM90_TARGET))

    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(one, funcs))
    for c in configs:
        get_kernel(*c)


def add_rms_norm(x, residual, weight, eps, out=None, residual_out=None):
    """(y, x + residual) for x, residual [T, N] bf16 and weight [N] bf16 (not in place)."""
    x2 = x.reshape(-1, x.shape[-1])
    r2 = residual.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2) if out is None else out.view(x2.shape)
    ro = torch.empty_like(x2) if residual_out is None else residual_out.view(x2.shape)
    get_kernel(x.shape[-1], True, float(eps))(x2, r2, weight, y, ro)
    return y.view(x.shape), ro.view(x.shape)


def rms_norm(x, weight, eps, out=None):
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2) if out is None else out.view(x2.shape)
    get_kernel(x.shape[-1], False, float(eps))(x2, weight, y)
    return y.view(x.shape)
