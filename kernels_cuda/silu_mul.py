"""Fused SwiGLU activation ``silu(x[:, :I]) * x[:, I:]`` for Hopper, in TileLang.

Op contract: docs/interfaces.md §2 ``silu_and_mul(x) -> y``; x [T, 2I] = [gate | up] bf16 -> y [T, I] bf16.
Semantics follow the CPU reference (backends/cpu/linear.py ``F.silu(gate) * up``) as torch runs it on bf16
CUDA tensors: silu in fp32 and rounded to bf16 (torch's kernel: ``x / (1 + expf(-x))``, precise expf and IEEE
division), then the product in fp32 and rounded to bf16:
  y = bf16(float(bf16(g / (1 + exp(-g)))) * float(u))
Compiled without fast math, so expf and the division are the same precise CUDA math-library functions torch
uses: bit-exact to the composed path is expected.

Kernel: grid (ceil(T / BM), I / BN), 128 threads; a CTA moves one [BM, BN] tile of gate and of up, BN the
largest of 256 .. 8 dividing I. Two variants, picked on the host from T (no device value):
  - "tile" (T > SMALL_ROWS): BM * BN = 2048 values, 16 a thread, 16-byte vector loads and stores; rows past T
    are masked by TileLang's bounds checks. Memory-bound: bytes = T * I * 2 * 3 (0.90-0.99 of copy from 4K rows).
  - "row" (T <= SMALL_ROWS, decode): BM = 1, one row per CTA, no masked rows, T * I / BN CTAs. On an H200 the
    masked 2048-value tile took 3.6 us at 1-6 rows (2.1 us at 16) and the row variant 1.2-1.8 us up to 64 rows,
    but 3.9 us at 384 rows (vs 2.6), hence the switch.
"""

import functools

import torch

from ._ast_guard import compile_pool
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}

TILE = 2048  # values of gate (and of up) per CTA ("tile" variant)
SMALL_ROWS = 128  # at most this many rows: the "row" variant (BM = 1)
THREADS = 128
MULT = 8  # I must be a multiple of this (16-byte vectors never straddle gate/up or rows)


def supported(inter: int) -> bool:
    return inter > 0 and inter % MULT == 0


def tile_for(inter: int, row_variant: bool = False) -> tuple[int, int]:
    """(BM, BN): BN the largest power of two in 8..256 dividing I; BM = 1 for the row variant, else TILE // BN."""
    assert supported(inter), f"I={inter}: need a multiple of {MULT}"
    bn = next(b for b in (256, 128, 64, 32, 16, 8) if inter % b == 0)
    return (1 if row_variant else TILE // bn), bn


@cached_prim_func
def build_silu_mul(inter: int, row_variant: bool = False, threads: int = THREADS):
    """PrimFunc for I = ``inter`` (compile-time); the number of rows is dynamic."""
    assert tilelang is not None, "tilelang is not installed"
    I = inter  # noqa: E741
    BM, BN = tile_for(I, row_variant)
    dtype, acc = T.bfloat16, T.float32
    M = T.dynamic("num_rows")

    @T.prim_func
    def silu_mul(X: T.Tensor([M, 2 * I], dtype), Y: T.Tensor([M, I], dtype)):
        with T.Kernel(T.ceildiv(M, BM), I // BN, threads=threads) as (bm, bn):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            g = T.alloc_fragment([BM, BN], dtype)
            u = T.alloc_fragment([BM, BN], dtype)
            y = T.alloc_fragment([BM, BN], dtype)
            T.copy(X[bm * BM : (bm + 1) * BM, bn * BN : (bn + 1) * BN], g)
            T.copy(X[bm * BM : (bm + 1) * BM, I + bn * BN : I + (bn + 1) * BN], u)
            for i, j in T.Parallel(BM, BN):
                gf = T.cast(g[i, j], acc)
                s = T.cast(gf / (1.0 + T.exp(-gf)), dtype)  # torch's silu: fp32, rounded to bf16
                y[i, j] = T.cast(T.cast(s, acc) * T.cast(u[i, j], acc), dtype)
            T.copy(y, Y[bm * BM : (bm + 1) * BM, bn * BN : (bn + 1) * BN])

    return silu_mul


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


@functools.cache
def get_kernel(inter: int, row_variant: bool = False):
    assert tilelang is not None, "tilelang is not installed"
    return _compile(build_silu_mul(inter, bool(row_variant)))


CI_CONFIGS = [(1408, True), (2048, False)]  # V2-Lite MoE experts, row variant (BN 128); V3, tile variant (BN 256)


def ci_compile(configs=None, target=None):
    """Compile representative configurations (sm_90a unless ``target``; no GPU, no cache); see
    tests/kernels_cuda."""

    cfgs = configs or CI_CONFIGS
    funcs = [build_silu_mul(*c) for c in cfgs]  # AST parsing on this thread (ast.parse is not thread-safe)
    with compile_pool(len(funcs)) as ex:
        return list(ex.map(lambda f: _compile(f, target), funcs))


def precompile(configs, num_workers=None):
    """Compile several (I, row_variant) in parallel (nvcc in threads), then fill get_kernel's cache from TileLang's
    (no recompile), so that the first launch finds its kernel."""

    configs = list(dict.fromkeys(configs))
    if not configs:
        return
    funcs = [build_silu_mul(*c) for c in configs]
    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(_compile, funcs))
    for inter, row_variant in configs:
        get_kernel(inter, bool(row_variant))


def silu_and_mul(x, out=None):
    """x [..., 2I] bf16 -> y [..., I] bf16 (one kernel for contiguous x)."""
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i).contiguous()
    y = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device) if out is None else out.view(-1, inter)
    if x2.shape[0]:
        get_kernel(inter, x2.shape[0] <= SMALL_ROWS)(x2, y)
    return y.view(*x.shape[:-1], inter)
