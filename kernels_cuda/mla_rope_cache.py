"""Fused MLA prolog tail for Hopper, in TileLang: kv_a_layernorm + RoPE of q and k + paged latent-cache write.

Op contract: the tail of docs/interfaces.md §2 ``mla_prolog`` (backends/cuda/kernels.py ``mla_prolog``), after
the q and kv_a projections:
  kv           [T, 512 + 64] bf16   output of kv_a_proj: c_kv ‖ k_pe
  weight       [512] bf16           kv_a_layernorm
  q            [T, H, QD] bf16      the projected q, contiguous; its rope part is q[:, :, q_off : q_off + 64]
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
def build_mla_rope_cache(heads: int, q_dim: int, q_off: int, interleaved: bool, eps: float, threads: int = THREADS):
    """PrimFunc for H = ``heads`` query heads of ``q_dim`` values with the rope part at ``q_off`` (compile-time);
    tokens, cos/sin rows and cache slots are dynamic."""
    assert tilelang is not None, "tilelang is not installed"
    assert supported_heads(heads), f"heads={heads}: need a multiple of 16 or 1/2/4/8"
    assert 0 <= q_off and q_off + ROPE <= q_dim
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
        KV: T.Tensor([Tn, L + R], dtype),
        W: T.Tensor([L], dtype),
        Q: T.Tensor([Tn, H, q_dim], dtype),
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
                T.copy(Q[t, hb * HB : (hb + 1) * HB, q_off : q_off + R], qs)
                for i, j in T.Parallel(HB, R):
                    QR[t, hb * HB + i, j] = rotate(qs[i, j], qs[i, partner(j)], cs, j)
            else:  # the token's latent: rms_norm(c_kv) ‖ rope(k_pe) into its cache slot
                slot = Slots[t]
                if slot >= 0:
                    T.copy(CS[pos, :], cs)
                    T.copy(KV[t, L : L + R], ks)
                    T.copy(KV[t : t + 1, 0:L], x)
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
def get_kernel(heads: int, q_dim: int, q_off: int, interleaved: bool, eps: float):
    assert tilelang is not None, "tilelang is not installed"
    return _compile(build_mla_rope_cache(heads, q_dim, q_off, bool(interleaved), float(eps)))


# (heads, q_dim, q_off, interleaved, eps): V2-Lite (H=16), V3 (H=128) with the non-interleaved variant
CI_CONFIGS = [(16, 192, 128, True, 1e-6), (128, 192, 128, False, 1e-6)]


def ci_compile(configs=None, target=None):
    """Compile representative configurations (sm_90a unless ``target``; no GPU, no cache); see
    tests/kernels_cuda."""

    cfgs = configs or CI_CONFIGS
    funcs = [build_mla_rope_cache(*c) for c in cfgs]  # AST parsing on this thread (ast.parse is not thread-safe)
    with compile_pool(len(funcs)) as ex:
        return list(ex.map(lambda f: _compile(f, target), funcs))


def precompile(configs, num_workers=None):
    """Compile several (heads, q_dim, q_off, interleaved, eps) in parallel (nvcc in threads), then fill get_kernel's
    cache from TileLang's (no recompile), so that the first launch finds its kernel."""

    configs = list(dict.fromkeys(configs))
    if not configs:
        return
    funcs = [build_mla_rope_cache(*c) for c in configs]
    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(_compile, funcs))
    for heads, q_dim, q_off, interleaved, eps in configs:  # the launcher's key types
        get_kernel(heads, q_dim, int(q_off), bool(interleaved), float(eps))


# ----------------------------------------------------------------------------------------------------
# launch wrapper (the backend's op)
# ----------------------------------------------------------------------------------------------------
def mla_rope_cache(kv, weight, eps, q, q_off, positions, cos_sin_cache, interleaved, kv_cache, slot_mapping,
                   out=None):
    """q_rope [T, H, 64] bf16; writes cat(rms_norm(c_kv), rope(k_pe)) into ``kv_cache`` at each slot >= 0.

    ``q`` [T, H, QD] is the whole projected q (its rope part at ``q_off``), ``kv`` [T, 576] the kv_a output.
    Launches exactly one kernel when the inputs are already contiguous int64 / fp32 / bf16 (the backend's case).
    """
    num_tokens, heads, q_dim = q.shape
    assert kv.shape == (num_tokens, HEAD_DIM) and kv_cache.shape[1:] == (PAGE, HEAD_DIM)
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[-1] == ROPE
    assert kv_cache.is_contiguous(), "the cache is written through a flat [slots, 576] view"
    if out is None:
        out = torch.empty(num_tokens, heads, ROPE, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    kern = get_kernel(heads, q_dim, int(q_off), bool(interleaved), float(eps))
    kern(
        kv.contiguous(),
        weight.contiguous(),
        q.contiguous(),
        positions.to(torch.int64).contiguous(),
        cos_sin_cache.contiguous(),
        slot_mapping.to(torch.int64).contiguous(),
        kv_cache.view(-1, HEAD_DIM),
        out,
    )
    return out
