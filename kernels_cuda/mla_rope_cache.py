"""Fused MLA prolog tail for Hopper, in TileLang: kv_a_layernorm + RoPE of q and k + paged latent-cache write.

Op contract: the tail of docs/interfaces.md §2 ``mla_prolog`` (backends/cuda/kernels.py ``mla_prolog``), after
the q and kv_a projections:
  kv           [T, 512 + 64] bf16   output of kv_a_proj: c_kv ‖ k_pe
  weight       [512] bf16           kv_a_layernorm
  q            [T, H, QD] bf16      the projected q; its rope part is q[:, :, q_off : q_off + 64]
  positions    [T] int64
  cos_sin_cache[max_pos, 64] fp32   [cos | sin] rows (YaRN factor folded in), see backends/cpu/rope.py
  kv_cache     [num_blocks, 64, 576] bf16 (contiguous), slot_mapping [T] int64 (negative: padding, no write)
  -> q_rope [T, H, 64] bf16, and kv_cache[slot] = cat(rms_norm(c_kv), rope(k_pe)) for each slot >= 0.

Semantics follow the CPU reference ops exactly (backends/cpu/norm.py, backends/cpu/rope.py):
  rms_norm: ms = mean(float(x)^2); y = bf16(float(weight) * float(bf16(float(x) * rsqrt(ms + eps))))
  rope (fp32): r1 = fl(fl(x1 * cos) - fl(x2 * sin)), r2 = fl(fl(x2 * cos) + fl(x1 * sin)), then bf16; pairs
  (x[2i], x[2i+1]) when ``interleaved`` (DeepSeek), else (x[i], x[i + 32]). The products and the sum use
  IEEE round-to-nearest intrinsics (__fmul_rn / __fadd_rn), so nvcc cannot contract them into an FMA: the
  rope outputs are bit-exact to torch's eager arithmetic; the norm can differ by one bf16 rounding at most
  (summation order of the mean square).

Kernel: one launch, grid (T, H / HB + 1), 128 threads. CTAs y < H / HB rotate HB = min(H, 16) heads of one
token (q tile [HB, 64] and the token's cos/sin row staged in shared memory, 8 outputs a thread); the last CTA
of a token normalises c_kv (one 512-wide row in registers, 4 values a thread, a block all-reduce for the mean
square), rotates k_pe and stores both into the token's cache slot, or does nothing when the slot is negative.
No host reads: CUDA-graph capturable. Latency-bound at decode sizes (it replaces ~20 small kernels).

Row layouts: q and kv are each contiguous (compact rows), or both are column slices of one [T, W] buffer, q at
column 0 and kv at column ``kv_off`` (the output of the query's projection and kv_a as one GEMM,
``MLAWeights.fused_a_proj``): the kernel then reads that buffer's rows in place (``q_row = kv_row = W``), and the
launch copies nothing.
"""

import functools

import torch

from ._ast_guard import compile_pool
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}

KV_LORA = 512
ROPE = 64
HALF = ROPE // 2
PAGE = 64
HEAD_DIM = KV_LORA + ROPE  # 576
THREADS = 128


def heads_per_cta(heads: int) -> int:
    """Heads rotated by one CTA (16, or all of them when fewer)."""
    return min(heads, 16)


def supported_heads(heads: int) -> bool:
    """H a multiple of 16, or 1, 2, 4, 8 (q tile [HB, 64] spread evenly over 128 threads)."""
    return heads > 0 and (heads % 16 == 0 or heads in (1, 2, 4, 8))


@cached_prim_func
def build_mla_rope_cache(heads: int, q_dim: int, q_off: int, interleaved: bool, eps: float, threads: int = THREADS,
                         q_row: int = 0, kv_row: int = 0, kv_off: int = 0):
    """PrimFunc for H = ``heads`` query heads of ``q_dim`` values with the rope part at ``q_off`` (compile-time);
    tokens, cos/sin rows and cache slots are dynamic. ``q_row`` / ``kv_row``: the row widths (elements) of the
    buffers q and kv are read from (0: compact, H x q_dim and 576); kv starts at column ``kv_off`` of its rows."""
    assert tilelang is not None, "tilelang is not installed"
    assert supported_heads(heads), f"heads={heads}: need a multiple of 16 or 1/2/4/8"
    assert 0 <= q_off and q_off + ROPE <= q_dim
    QW, KW = q_row or heads * q_dim, kv_row or HEAD_DIM
    assert QW >= heads * q_dim and 0 <= kv_off and kv_off + HEAD_DIM <= KW, (q_row, kv_row, kv_off)
    H, HB = heads, heads_per_cta(heads)
    NHB = H // HB
    L, R = KV_LORA, ROPE
    dtype, acc = T.bfloat16, T.float32
    Tn = T.dynamic("num_tokens")
    P = T.dynamic("max_positions")
    S = T.dynamic("num_slots")
    inv_n = 1.0 / L

    def rotate(x, xp, cs, j):
        """One rope output: x = this element, xp = its pair partner, j = its index in the 64 rope values."""
        if interleaved:  # pair (2k, 2k+1): even j is the first of its pair
            k = j // 2
            sgn = T.if_then_else(j % 2 == 0, -1.0, 1.0)
        else:  # pair (k, k + 32)
            k = j % HALF
            sgn = T.if_then_else(j < HALF, -1.0, 1.0)
        # first: x*cos - xp*sin; second: x*cos + xp*sin (sgn * sin is exact); no FMA contraction
        return T.cast(
            T.ieee_add(T.ieee_mul(T.cast(x, acc), cs[k]), T.ieee_mul(T.cast(xp, acc), cs[HALF + k] * sgn)), dtype
        )

    def partner(j):
        return j + 1 - 2 * (j % 2) if interleaved else (j + HALF) % R

    @T.prim_func
    def mla_rope_cache(
        KV: T.Tensor([Tn, KW], dtype),
        W: T.Tensor([L], dtype),
        Q: T.Tensor([Tn, QW], dtype),  # head h's values at columns h * q_dim ..
        Pos: T.Tensor([Tn], T.int64),
        CS: T.Tensor([P, R], acc),
        Slots: T.Tensor([Tn], T.int64),
        Cache: T.Tensor([S, L + R], dtype),
        QR: T.Tensor([Tn, H, R], dtype),
    ):
        with T.Kernel(Tn, NHB + 1, threads=threads) as (t, hb):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            cs = T.alloc_shared([R], acc)
            qs = T.alloc_shared([HB, R], dtype)
            ks = T.alloc_shared([R], dtype)
            x = T.alloc_fragment([1, L], dtype)
            sq = T.alloc_fragment([1, L], acc)
            y = T.alloc_fragment([1, L], dtype)
            ss = T.alloc_fragment([1], acc)
            pos = Pos[t]
            if hb < NHB:  # q rope: heads hb*HB .. hb*HB + HB - 1 of token t
                T.copy(CS[pos, :], cs)
                for i, j in T.Parallel(HB, R):
                    qs[i, j] = Q[t, (hb * HB + i) * q_dim + q_off + j]
                for i, j in T.Parallel(HB, R):
                    QR[t, hb * HB + i, j] = rotate(qs[i, j], qs[i, partner(j)], cs, j)
            else:  # the token's latent: rms_norm(c_kv) ‖ rope(k_pe) into its cache slot
                slot = Slots[t]
                if slot >= 0:
                    T.copy(CS[pos, :], cs)
                    T.copy(KV[t, kv_off + L : kv_off + L + R], ks)
                    T.copy(KV[t : t + 1, kv_off : kv_off + L], x)
                    for i, j in T.Parallel(1, L):
                        sq[i, j] = T.cast(x[i, j], acc) * T.cast(x[i, j], acc)
                    T.reduce_sum(sq, ss, dim=1)
                    for i in T.Parallel(1):
                        ss[i] = T.rsqrt(ss[i] * inv_n + eps)
                    for i, j in T.Parallel(1, L):
                        y[i, j] = T.cast(
                            T.cast(T.cast(T.cast(x[i, j], acc) * ss[i], dtype), acc) * T.cast(W[j], acc), dtype
                        )
                    T.copy(y, Cache[slot : slot + 1, 0:L])
                    for j in T.Parallel(R):
                        Cache[slot, L + j] = rotate(ks[j], ks[partner(j)], cs, j)

    return mla_rope_cache


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


@functools.cache
def get_kernel(heads: int, q_dim: int, q_off: int, interleaved: bool, eps: float, q_row: int = 0, kv_row: int = 0,
               kv_off: int = 0):
    assert tilelang is not None, "tilelang is not installed"
    return _compile(build_mla_rope_cache(heads, q_dim, q_off, bool(interleaved), float(eps), q_row=q_row,
                                         kv_row=kv_row, kv_off=kv_off))


def config_key(heads: int, q_dim: int, q_off: int, interleaved: bool, eps: float, q_row: int = 0, kv_row: int = 0,
               kv_off: int = 0) -> tuple:
    """The warm-up's key: (heads, q_dim, q_off, interleaved, eps), and for one [T, W] buffer holding q then kv
    (``fused_row(heads, q_dim)``) the three row fields."""
    base = (heads, q_dim, int(q_off), bool(interleaved), float(eps))
    return base + (int(q_row), int(kv_row), int(kv_off)) if (q_row or kv_row or kv_off) else base


def fused_row(heads: int, q_dim: int) -> tuple[int, int, int]:
    """(q_row, kv_row, kv_off) of the buffer [T, H x q_dim + 576] that holds q, then kv, in each row."""
    w = heads * q_dim + HEAD_DIM
    return w, w, heads * q_dim


# (heads, q_dim, q_off, interleaved, eps[, q_row, kv_row, kv_off]): V2-Lite (H=16) compact and reading the fused
# projection's rows, V3 (H=128) with the non-interleaved variant
CI_CONFIGS = [(16, 192, 128, True, 1e-6), (16, 192, 128, True, 1e-6, *fused_row(16, 192)),
              (128, 192, 128, False, 1e-6)]


def ci_compile(configs=None, target=None):
    """Compile representative configurations (sm_90a unless ``target``; no GPU, no cache); see
    tests/kernels_cuda."""

    cfgs = configs or CI_CONFIGS
    funcs = [_build(c) for c in cfgs]  # AST parsing on this thread (ast.parse is not thread-safe)
    with compile_pool(len(funcs)) as ex:
        return list(ex.map(lambda f: _compile(f, target), funcs))


def precompile(configs, num_workers=None):
    """Compile several (heads, q_dim, q_off, interleaved, eps) in parallel (nvcc in threads), then fill get_kernel's
    cache from TileLang's (no recompile), so that the first launch finds its kernel."""

    configs = list(dict.fromkeys(configs))
    if not configs:
        return
    funcs = [_build(c) for c in configs]
    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(_compile, funcs))
    for c in configs:  # the launcher's key types
        get_kernel(*_launch_key(c))


def _launch_key(config) -> tuple:
    heads, q_dim, q_off, interleaved, eps, *rows = config
    return (heads, q_dim, int(q_off), bool(interleaved), float(eps), *map(int, rows))


def _build(config):
    heads, q_dim, q_off, interleaved, eps, *rows = _launch_key(config)
    q_row, kv_row, kv_off = rows or (0, 0, 0)
    return build_mla_rope_cache(heads, q_dim, q_off, interleaved, eps, q_row=q_row, kv_row=kv_row, kv_off=kv_off)


def shared_rows(q: torch.Tensor, kv: torch.Tensor):
    """(buffer [T, W], kv_off) when ``q`` [T, H, QD] and ``kv`` [T, 576] are column slices of one row-major
    buffer's rows, q at column 0 and kv after it (the fused projection's output), else None."""
    num_tokens, heads, q_dim = q.shape
    w = q.stride(0)
    if num_tokens < 2 or q.stride(2) != 1 or q.stride(1) != q_dim or kv.stride(1) != 1 or kv.stride(0) != w:
        return None
    if q.dtype != kv.dtype or q.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr():
        return None
    kv_off = kv.storage_offset() - q.storage_offset()
    if kv_off < heads * q_dim or kv_off + HEAD_DIM > w:
        return None
    return q.as_strided((num_tokens, w), (w, 1)), kv_off


# ----------------------------------------------------------------------------------------------------
# launch wrapper (the backend's op)
# ----------------------------------------------------------------------------------------------------
def mla_rope_cache(kv, weight, eps, q, q_off, positions, cos_sin_cache, interleaved, kv_cache, slot_mapping,
                   out=None):
    """q_rope [T, H, 64] bf16; writes cat(rms_norm(c_kv), rope(k_pe)) into ``kv_cache`` at each slot >= 0.

    ``q`` [T, H, QD] is the whole projected q (its rope part at ``q_off``), ``kv`` [T, 576] the kv_a output.
    Launches exactly one kernel when the inputs are already contiguous int64 / fp32 / bf16 (the backend's case), or
    when q and kv are the two column slices of one buffer's rows (``shared_rows``: read in place).
    """
    num_tokens, heads, q_dim = q.shape
    assert kv.shape == (num_tokens, HEAD_DIM) and kv_cache.shape[1:] == (PAGE, HEAD_DIM)
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[-1] == ROPE
    assert kv_cache.is_contiguous(), "the cache is written through a flat [slots, 576] view"
    if out is None:
        out = torch.empty(num_tokens, heads, ROPE, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    shared = shared_rows(q, kv)
    if shared is not None:
        buf, kv_off = shared
        kern = get_kernel(heads, q_dim, int(q_off), bool(interleaved), float(eps), buf.shape[1], buf.shape[1], kv_off)
        q2d = kv2d = buf
    else:
        kern = get_kernel(heads, q_dim, int(q_off), bool(interleaved), float(eps))
        q2d, kv2d = q.contiguous().view(num_tokens, heads * q_dim), kv.contiguous()
    kern(
        kv2d,
        weight.contiguous(),
        q2d,
        positions.to(torch.int64).contiguous(),
        cos_sin_cache.contiguous(),
        slot_mapping.to(torch.int64).contiguous(),
        kv_cache.view(-1, HEAD_DIM),
        out,
    )
    return out
