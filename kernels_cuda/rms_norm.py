"""Fused residual add + RMSNorm (and plain RMSNorm) for Hopper, in TileLang.

Op contract: docs/interfaces.md §2 ``rms_norm(x, weight, eps) -> y`` and
``add_rms_norm(x, residual, weight, eps) -> (y, x + residual)``; shapes [T, N], bf16.
Semantics follow the CPU reference (backends/cpu/norm.py): s = bf16(x + residual); the mean square of s in
fp32; y = bf16(weight * bf16(s * rsqrt(mean(s^2) + eps))).

Kernel: BLOCK_M rows per CTA, the whole row in registers (N up to 7168 bf16 at 256 threads: 28 values a
thread), one pass over memory: read x (+ residual), write y (+ the new residual).
Memory-bound: bytes = T*N*2*(2 or 4).

``quant=True`` (FP8 models, ``DEEPINFER_FP8_NORM_QUANT=1``) also writes y quantised as ``fp8_quant`` does (1 x 128
groups, ``max(amax, 1e-10) / 448``, IEEE division, clamp, round to nearest even) from the same bf16 values: the codes
[T, N] e4m3 and the scales [T, N / 128] fp32 the next projection reads, so it needs no quantisation launch. The row
goes through shared memory as N / 128 rows of 128 for the group maxima. N a multiple of 128.
"""

import functools

import torch

from ._ast_guard import compile_pool
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func
from .fp8_quant import AMAX_EPS, FP8_MAX, GROUP

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}


@cached_prim_func
def build_rms_norm(hidden: int, with_residual: bool, eps: float, quant: bool = False, block_m: int = 1,
                   threads: int = 256):
    """PrimFunc for rows of width `hidden` (compile-time); the number of rows is dynamic. ``quant``: also the FP8
    codes and group scales of the output (module docstring)."""
    assert tilelang is not None, "tilelang is not installed"
    assert not quant or hidden % GROUP == 0, f"N={hidden}: the quantised form needs a multiple of {GROUP}"
    N, BM = hidden, block_m
    G = N // GROUP
    dtype, acc, fp8 = T.bfloat16, T.float32, T.float8_e4m3fn
    M = T.dynamic("num_rows")
    inv_n = 1.0 / N

    @T.macro
    def quantise(y, Q, S, bx):
        """y [BM, N] bf16 (fragment) -> Q [M, N] e4m3 and S [M, G] fp32 rows bx * BM ..: fp8_quant's arithmetic."""
        ys = T.alloc_shared([BM * G, GROUP], dtype)
        v = T.alloc_fragment([BM * G, GROUP], acc)
        scale = T.alloc_fragment([BM * G], acc)
        q = T.alloc_fragment([BM * G, GROUP], fp8)
        for i, j in T.Parallel(BM, N):
            ys[i * G + j // GROUP, j % GROUP] = y[i, j]
        for r, c in T.Parallel(BM * G, GROUP):
            v[r, c] = T.cast(ys[r, c], acc)
        T.reduce_absmax(v, scale, dim=1)
        for r in T.Parallel(BM * G):
            scale[r] = T.max(scale[r], T.float32(AMAX_EPS)) / T.float32(FP8_MAX)
        for r, c in T.Parallel(BM * G, GROUP):
            q[r, c] = T.cast(T.clamp(v[r, c] / scale[r], T.float32(-FP8_MAX), T.float32(FP8_MAX)), fp8)
        for r, c in T.Parallel(BM * G, GROUP):
            if bx * BM + r // G < M:
                Q[bx * BM + r // G, (r % G) * GROUP + c] = q[r, c]
        for r in T.Parallel(BM * G):
            if bx * BM + r // G < M:
                S[bx * BM + r // G, r % G] = scale[r]

    @T.macro
    def normalise(X, R, W, Y, R_out, Q, S, bx):
        """One CTA's rows: (x + residual, written to R_out when R is given) normalised into Y (and Q, S)."""
        T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
        T.pdl_trigger()
        x = T.alloc_fragment([BM, N], dtype)
        if with_residual:
            r = T.alloc_fragment([BM, N], dtype)
            s = T.alloc_fragment([BM, N], dtype)
        sq = T.alloc_fragment([BM, N], acc)
        y = T.alloc_fragment([BM, N], dtype)
        ss = T.alloc_fragment([BM], acc)
        T.copy(X[bx * BM : (bx + 1) * BM, :], x)
        if with_residual:
            T.copy(R[bx * BM : (bx + 1) * BM, :], r)
            for i, j in T.Parallel(BM, N):
                s[i, j] = T.cast(T.cast(x[i, j], acc) + T.cast(r[i, j], acc), dtype)
            T.copy(s, R_out[bx * BM : (bx + 1) * BM, :])
        else:
            s = x
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
        if quant:
            quantise(y, Q, S, bx)

    if with_residual and quant:

        @T.prim_func
        def add_rms_norm_quant(
            X: T.Tensor([M, N], dtype),
            R: T.Tensor([M, N], dtype),
            W: T.Tensor([N], dtype),
            Y: T.Tensor([M, N], dtype),
            R_out: T.Tensor([M, N], dtype),
            Q: T.Tensor([M, N], fp8),
            S: T.Tensor([M, G], acc),
        ):
            with T.Kernel(T.ceildiv(M, BM), threads=threads) as bx:
                normalise(X, R, W, Y, R_out, Q, S, bx)

        return add_rms_norm_quant

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
                normalise(X, R, W, Y, R_out, None, None, bx)

        return add_rms_norm

    if quant:

        @T.prim_func
        def rms_norm_quant(
            X: T.Tensor([M, N], dtype),
            W: T.Tensor([N], dtype),
            Y: T.Tensor([M, N], dtype),
            Q: T.Tensor([M, N], fp8),
            S: T.Tensor([M, G], acc),
        ):
            with T.Kernel(T.ceildiv(M, BM), threads=threads) as bx:
                normalise(X, None, W, Y, None, Q, S, bx)

        return rms_norm_quant

    @T.prim_func
    def rms_norm(
        X: T.Tensor([M, N], dtype),
        W: T.Tensor([N], dtype),
        Y: T.Tensor([M, N], dtype),
    ):
        with T.Kernel(T.ceildiv(M, BM), threads=threads) as bx:
            normalise(X, None, W, Y, None, None, None, bx)

    return rms_norm


@functools.cache
def get_kernel(hidden: int, with_residual: bool, eps: float, quant: bool = False):
    """The compiled kernel, cached by all four arguments: callers pass ``quant`` explicitly, so a configuration
    ``precompile`` built (keys of four) is the one a launch finds."""
    assert tilelang is not None, "tilelang is not installed"
    return tilelang.compile(
        build_rms_norm(hidden, with_residual, float(eps), bool(quant)), out_idx=None, target=dict(SM90_TARGET)
    )


CI_CONFIGS = [(7168, True, 1e-6), (2048, False, 1e-6), (2048, True, 1e-6, True), (1536, False, 1e-6, True)]


def _config(c) -> tuple[int, bool, float, bool]:
    """``(hidden, with_residual, eps[, quant])`` -> the 4-tuple ``get_kernel`` is cached by."""
    n, r, eps, *q = c
    return int(n), bool(r), float(eps), bool(q[0]) if q else False


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""

    cfgs = [_config(c) for c in configs or CI_CONFIGS]

    funcs = [build_rms_norm(*c) for c in cfgs]  # AST parsing on this thread (ast.parse is not thread-safe)

    def one(func):
        return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))

    with compile_pool(len(funcs)) as ex:
        return list(ex.map(one, funcs))


def precompile(configs, num_workers=None):
    """Compile several (hidden, with_residual, eps[, quant]) in parallel (nvcc in threads), then fill get_kernel's
    cache from TileLang's (no recompile), so that the first launch finds its kernel."""

    configs = list(dict.fromkeys(_config(c) for c in configs))
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
    get_kernel(x.shape[-1], True, float(eps), False)(x2, r2, weight, y, ro)
    return y.view(x.shape), ro.view(x.shape)


def rms_norm(x, weight, eps, out=None):
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2) if out is None else out.view(x2.shape)
    get_kernel(x.shape[-1], False, float(eps), False)(x2, weight, y)
    return y.view(x.shape)


def _codes(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x2.shape
    return (torch.empty(m, n, dtype=torch.float8_e4m3fn, device=x2.device),
            torch.empty(m, n // GROUP, dtype=torch.float32, device=x2.device))


def add_rms_norm_quant(x, residual, weight, eps):
    """(y, x + residual, codes, scales): ``add_rms_norm``'s outputs and y as ``fp8_quant.quantize`` gives it (codes
    [T, N] e4m3, scales [T, N / 128] fp32), in one launch; N a multiple of 128."""
    x2 = x.reshape(-1, x.shape[-1])
    r2 = residual.reshape(-1, x.shape[-1])
    y, ro = torch.empty_like(x2), torch.empty_like(x2)
    codes, scales = _codes(x2)
    get_kernel(x.shape[-1], True, float(eps), True)(x2, r2, weight, y, ro, codes, scales)
    return y.view(x.shape), ro.view(x.shape), codes, scales


def rms_norm_quant(x, weight, eps):
    """(y, codes, scales): ``rms_norm``'s output and its FP8 quantisation, in one launch; N a multiple of 128."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2)
    codes, scales = _codes(x2)
    get_kernel(x.shape[-1], False, float(eps), True)(x2, weight, y, codes, scales)
    return y.view(x.shape), codes, scales
