"""Paged MLA decode (absorbed) for Hopper, in TileLang.

Op contract: docs/interfaces.md §2 ``mla_attention`` (decode path).

Layout (FlashMLA-compatible):
  q_latent     [T, H, 512] bf16      absorbed query (W_UK folded in)
  q_rope       [T, H, 64]  bf16
  kv_cache     [num_blocks, 64, 576] bf16   per token: 512 latent (c_kv) ‖ 64 rope (k_pe); values = first 512
  block_tables [B, nb] int32
  seqlens_q    [B] int32 (1..16 query tokens per request: speculative verification)
  seqlens_k    [B] int32 (tokens in the cache for the request, the new ones included)
  cu_seqlens_q [B+1] int32
  -> out_latent [T, H, 512] bf16, lse [T, H] fp32 (natural log)

Causal: query j of request b sits at position seqlens_k[b] - seqlens_q[b] + j and sees keys at positions
<= its own.

Kernel design: the q tokens of a request times its heads are folded into the M dimension of the tile (row r
of request b = token r // H, head r % H; 64 rows per CTA, so H=128 takes 2 CTAs per token and H=16 packs 4
tokens in one CTA); rows past seqlens_q[b] are computed on zeros and never stored. One KV tile = one 64-token
page, fetched through the block table inside a 2-stage software pipeline (TileLang lowers it to TMA and a
producer warpgroup on sm_90a). The causal mask is applied only on the tiles that reach past the first query's
position. Split-KV: grid z splits the pages of each request evenly; each split writes fp32 partial outputs and
a base-2 LSE, and a second kernel combines them (skipped when num_splits == 1, which writes the bf16 output
directly).

On a Hopper the engine runs the 64-row tile on ``mla_decode_ws.py``'s hand warp-specialized kernel instead
(``mla_decode(..., warp_specialized=True)``; the same contract; its default seesaw schedule 1.24-1.31x faster at 128
heads on an H200, session 9 call 5).

Precondition: cache slots past seqlens_k inside the last page must hold finite values (allocate the cache with
zeros); they are masked out of the softmax, but 0 * NaN in P@V would still be NaN.

Run alone:  python kernels_cuda/mla_decode.py --check --bench
"""

import argparse
import functools
import sys
import time

import torch

try:  # tilelang is optional at import time so that the reference is usable without it
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover - exercised where tilelang is absent
    tilelang = None
    T = None

try:
    from ._ast_guard import compile_pool
except ImportError:  # run as a script from kernels_cuda/
    from _ast_guard import compile_pool

try:
    from . import _bench
    from ._pdl import pdl_enabled
except ImportError:  # run as a script: python kernels_cuda/mla_decode.py
    import _bench
    from _pdl import pdl_enabled

KV_LORA = 512
ROPE = 64
HEAD_DIM = KV_LORA + ROPE  # 576
PAGE = 64  # block_size of the paged latent cache
BLOCK_M = 64  # folded (q token x head) rows per CTA
# One token of a few heads (V2-Lite's 16, batch-1 decode): the 16 rows in an mma.sync tile of 16 at 128 threads
# instead of a 64-row wgmma tile (48 padding rows). Batch-1 sweep on an H200 (session 5, --sweep-batch1, 16 heads,
# 512-token context): 8.2 us at 32 splits against 16.0-16.5 us for the 64-row tile.
SMALL_BLOCK_M = 16
SMALL_THREADS = 128
BLOCK_N = 64  # keys per pipeline stage (= one page)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def _pass_configs():
    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def compile_sm90(func):
    """Compile a PrimFunc of this file or of ``mla_decode_ws`` for ``SM90_TARGET`` (read at call time: the CI's
    sm_100a compile points it elsewhere)."""
    return tilelang.compile(func, out_idx=None, target=dict(SM90_TARGET), pass_configs=_pass_configs())


@functools.cache
def _ws_module():
    """``mla_decode_ws``, also when this file runs as a script (then both are top-level modules)."""
    try:
        from . import mla_decode_ws as ws
    except ImportError:  # run as a script from kernels_cuda/
        import mla_decode_ws as ws
    return ws


# ----------------------------------------------------------------------------------------------------
# factory
# ----------------------------------------------------------------------------------------------------
def combine_splits(heads: int, num_splits: int, skip_empty_splits: bool = False, pdl: bool = False):
    """The split-KV combine as a TileLang macro (one CTA per (head, token), 128 threads x 4 values), shared by the
    pipelined and the warp-specialized decode kernels: fp32 partial outputs and base-2 LSEs in, the bf16 output and
    the natural-log LSE out. Call it inside a prim_func after the split kernel."""
    H, S, DV, PDL = heads, num_splits, KV_LORA, pdl
    acc, dtype = T.float32, T.bfloat16

    @T.macro
    def combine(Out, Lse, O_part, Lse_part, num_tokens):
        with T.Kernel(H, num_tokens, threads=128) as (h, t):
            if PDL:  # _pdl.py: wait for the previous kernel, then let the next one launch
                T.pdl_sync()
                T.pdl_trigger()
            o_acc = T.alloc_fragment([DV], acc)
            po = T.alloc_fragment([DV], acc)
            lmax = T.alloc_var(acc)
            lsum = T.alloc_var(acc)
            w = T.alloc_var(acc)
            inv = T.alloc_var(acc)
            T.clear(o_acc)
            lmax = -T.infinity(acc)
            for s in T.serial(S):
                lmax = T.max(lmax, Lse_part[s, t, h])
            lmax = T.if_then_else(lmax == -T.infinity(acc), 0.0, lmax)
            lsum = 0.0
            for s in T.serial(S):
                lsum += T.exp2(Lse_part[s, t, h] - lmax)
            inv = T.if_then_else(lsum > 0, 1.0 / lsum, 0.0)
            for s in T.serial(S):
                if skip_empty_splits:
                    if Lse_part[s, t, h] > -T.infinity(acc):  # an empty split's partial was never written
                        for d in T.Parallel(DV):
                            po[d] = O_part[s, t, h, d]
                        w = T.exp2(Lse_part[s, t, h] - lmax) * inv
                        for d in T.Parallel(DV):
                            o_acc[d] += po[d] * w
                else:
                    for d in T.Parallel(DV):
                        po[d] = O_part[s, t, h, d]
                    w = T.exp2(Lse_part[s, t, h] - lmax) * inv
                    for d in T.Parallel(DV):
                        o_acc[d] += po[d] * w
            for d in T.Parallel(DV):
                Out[t, h, d] = T.cast(o_acc[d], dtype)
            Lse[t, h] = T.if_then_else(lsum > 0, (T.log2(lsum) + lmax) * LN2, -T.infinity(acc))

    return combine


def build_mla_decode(
    heads: int, m_tiles: int, num_splits: int, softmax_scale: float, num_stages: int = 2, threads: int = 256,
    causal_tile_bound: bool = False, block_m: int = BLOCK_M, skip_empty_splits: bool = False,
):
    """Return the TileLang PrimFunc (not compiled).

    heads: query heads H (compile-time); m_tiles: CTAs per request along the folded rows, ceil(max_q*H/64);
    num_splits: KV splits (grid z); softmax_scale: applied to q.k before the softmax.
    causal_tile_bound: a CTA stops at the last key tile its last row can see (prefill: rows early in a long
    chunk skip the tiles past their position). Off for decode / verification, where it changes nothing.
    skip_empty_splits (tuning sweeps; off in the engine): a split with no key tile writes only its -inf LSE, not
    its zero partial output, and the combine does not read such partials (a batch-1 graph on a wide table runs
    32 splits for a 9-page context).
    Dynamic (run-time) sizes: total tokens T, requests B, cache blocks, block-table width.
    """
    assert tilelang is not None, "tilelang is not installed"
    PDL = pdl_enabled()
    H = heads
    DV, DPE = KV_LORA, ROPE
    BM, BN = block_m, BLOCK_N  # block_m < 64 (tuning sweeps only): mma.sync instead of wgmma on sm_90a
    S = num_splits
    scale = float(softmax_scale * LOG2E)
    dtype = T.bfloat16
    acc = T.float32
    neg_big = -(2.0**30)  # finite "minus infinity" for the running max (avoids inf - inf)

    Tq = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    NB = T.dynamic("num_blocks")
    NBT = T.dynamic("max_blocks_per_seq")
    combine = combine_splits(H, S, skip_empty_splits, PDL)

    @T.prim_func
    def mla_decode_split(
        Q: T.Tensor([Tq, H, DV], dtype),
        Q_pe: T.Tensor([Tq, H, DPE], dtype),
        KV: T.Tensor([NB, PAGE, HEAD_DIM], dtype),
        block_table: T.Tensor([B, NBT], T.int32),
        q_start: T.Tensor([B], T.int32),
        seqlens_q: T.Tensor([B], T.int32),
        seqlens_k: T.Tensor([B], T.int32),
        Out: T.Tensor([Tq, H, DV], dtype),
        Lse: T.Tensor([Tq, H], acc),
        O_part: T.Tensor([S, Tq, H, DV], acc),
        Lse_part: T.Tensor([S, Tq, H], acc),
    ):
        with T.Kernel(m_tiles, B, S, threads=threads) as (mt, b, z):
            if PDL:  # _pdl.py: wait for the previous kernel, then let the next one launch
                T.pdl_sync()
                T.pdl_trigger()
            Q_shared = T.alloc_shared([BM, DV], dtype)
            Q_pe_shared = T.alloc_shared([BM, DPE], dtype)
            KV_shared = T.alloc_shared([BN, DV], dtype)
            K_pe_shared = T.alloc_shared([BN, DPE], dtype)
            S_shared = T.alloc_shared([BM, BN], dtype)
            acc_s = T.alloc_fragment([BM, BN], acc)
            acc_o = T.alloc_fragment([BM, DV], acc)
            m_i = T.alloc_fragment([BM], acc)
            m_prev = T.alloc_fragment([BM], acc)
            alpha = T.alloc_fragment([BM], acc)
            row_sum = T.alloc_fragment([BM], acc)
            l_i = T.alloc_fragment([BM], acc)
            lim = T.alloc_fragment([BM], T.int32)

            sq = seqlens_q[b]
            sk = seqlens_k[b]
            qs = q_start[b]
            row0 = mt * BM
            n_valid_rows = sq * H

            # folded rows of this request are contiguous in Q viewed as [T*H, DV]
            for i, d in T.Parallel(BM, DV):
                Q_shared[i, d] = T.if_then_else(
                    row0 + i < n_valid_rows, Q[qs + (row0 + i) // H, (row0 + i) % H, d], T.cast(0, dtype)
                )
            for i, d in T.Parallel(BM, DPE):
                Q_pe_shared[i, d] = T.if_then_else(
                    row0 + i < n_valid_rows, Q_pe[qs + (row0 + i) // H, (row0 + i) % H, d], T.cast(0, dtype)
                )
            # last visible key position per row (inclusive); rows past sq clamp to sk - 1
            for i in T.Parallel(BM):
                lim[i] = T.min(sk - sq + (row0 + i) // H, sk - 1)

            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, neg_big)

            if causal_tile_bound:
                # keys visible to this CTA's last valid row: positions <= sk - sq + its token index
                last_tok = T.min(row0 + BM - 1, n_valid_rows - 1) // H
                n_tiles = T.ceildiv(T.max(T.min(sk, sk - sq + last_tok + 1), 1), BN)
            else:
                n_tiles = T.ceildiv(sk, BN)
            per = n_tiles // S
            rem = n_tiles % S
            my_tiles = T.if_then_else(row0 < n_valid_rows, per + T.if_then_else(z < rem, 1, 0), 0)
            t0 = per * z + T.min(z, rem)
            first_masked = sk - sq  # keys at positions > this are invisible to the first query row

            for k in T.Pipelined(my_tiles, num_stages=num_stages):
                page = block_table[b, t0 + k]
                T.copy(KV[page, :, 0:DV], KV_shared)
                T.copy(KV[page, :, DV:HEAD_DIM], K_pe_shared)
                T.clear(acc_s)
                T.gemm(Q_shared, KV_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(Q_pe_shared, K_pe_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                if (t0 + k + 1) * BN - 1 > first_masked:
                    for i, j in T.Parallel(BM, BN):
                        acc_s[i, j] = T.if_then_else(
                            (t0 + k) * BN + j > lim[i], -T.infinity(acc), acc_s[i, j]
                        )
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_i, dim=1, clear=False)
                for i in T.Parallel(BM):
                    alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale)
                for i, j in T.Parallel(BM, BN):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale - m_i[i] * scale)
                T.reduce_sum(acc_s, row_sum, dim=1)
                T.copy(acc_s, S_shared)
                for i in T.Parallel(BM):
                    l_i[i] = l_i[i] * alpha[i] + row_sum[i]
                for i, d in T.Parallel(BM, DV):
                    acc_o[i, d] *= alpha[i]
                T.gemm(S_shared, KV_shared, acc_o, policy=T.GemmWarpPolicy.FullCol)

            # finalize: empty rows (no visible key in this split) give o = 0, lse = -inf
            for i, d in T.Parallel(BM, DV):
                acc_o[i, d] = T.if_then_else(l_i[i] > 0, acc_o[i, d] / l_i[i], 0.0)
            for i in T.Parallel(BM):
                m_prev[i] = T.if_then_else(l_i[i] > 0, T.log2(l_i[i]) + m_i[i] * scale, -T.infinity(acc))
            if S == 1:
                for i, d in T.Parallel(BM, DV):
                    if row0 + i < n_valid_rows:
                        Out[qs + (row0 + i) // H, (row0 + i) % H, d] = T.cast(acc_o[i, d], dtype)
                for i in T.Parallel(BM):
                    if row0 + i < n_valid_rows:
                        Lse[qs + (row0 + i) // H, (row0 + i) % H] = m_prev[i] * LN2
            elif skip_empty_splits:
                if my_tiles > 0:
                    for i, d in T.Parallel(BM, DV):
                        if row0 + i < n_valid_rows:
                            O_part[z, qs + (row0 + i) // H, (row0 + i) % H, d] = acc_o[i, d]
                for i in T.Parallel(BM):
                    if row0 + i < n_valid_rows:
                        Lse_part[z, qs + (row0 + i) // H, (row0 + i) % H] = m_prev[i]
            else:
                for i, d in T.Parallel(BM, DV):
                    if row0 + i < n_valid_rows:
                        O_part[z, qs + (row0 + i) // H, (row0 + i) % H, d] = acc_o[i, d]
                for i in T.Parallel(BM):
                    if row0 + i < n_valid_rows:
                        Lse_part[z, qs + (row0 + i) // H, (row0 + i) % H] = m_prev[i]

        if S > 1:
            combine(Out, Lse, O_part, Lse_part, Tq)

    return mla_decode_split


@functools.cache
def get_kernel(heads: int, m_tiles: int, num_splits: int, softmax_scale: float, num_stages: int = 2,
               causal_tile_bound: bool = False, threads: int = 256, block_m: int = BLOCK_M,
               skip_empty_splits: bool = False):
    """Compile for sm_90a (cached per configuration, in memory and in TileLang's disk cache)."""
    assert tilelang is not None, "tilelang is not installed"
    func = build_mla_decode(heads, m_tiles, num_splits, softmax_scale, num_stages, threads=threads,
                            causal_tile_bound=causal_tile_bound, block_m=block_m,
                            skip_empty_splits=skip_empty_splits)
    return compile_sm90(func)


def _engine_kernel(heads: int, m_tiles: int, num_splits: int, softmax_scale: float, causal: bool = False,
                   block_m: int = BLOCK_M):
    """The engine's kernels, always through this one call form: ``get_kernel``'s functools cache keys on how a call
    is spelled, so precompile and the launches must spell it the same way."""
    if causal:
        return get_kernel(heads, m_tiles, num_splits, softmax_scale, causal_tile_bound=True)
    if block_m == BLOCK_M:
        return get_kernel(heads, m_tiles, num_splits, softmax_scale)
    return get_kernel(heads, m_tiles, num_splits, softmax_scale, 2, threads=SMALL_THREADS, block_m=block_m)


def _normalize(config) -> tuple:
    """(heads, m_tiles, num_splits[, causal[, block_m[, warp_specialized]]]) -> the 6-tuple."""
    c = tuple(config)
    return (c[0], c[1], c[2], bool(c[3]) if len(c) > 3 else False, int(c[4]) if len(c) > 4 else BLOCK_M,
            bool(c[5]) if len(c) > 5 else False)


def precompile(configs, softmax_scale: float = HEAD_DIM**-0.5, num_workers=None):
    """Compile several configurations ahead of use: decode ``(heads, m_tiles, num_splits)`` (``decode_config``:
    plus ``False, block_m`` for the small-tile variant, ``False, 64, True`` for ``mla_decode_ws``'s kernel) or,
    with a fourth item ``True``, ``mla_prefill``'s causal variant ``(heads, m_tiles, num_splits, True)``."""

    configs = list(dict.fromkeys(_normalize(c) for c in configs))
    ws_configs = [c[:3] for c in configs if c[5]]
    configs = [c[:5] for c in configs if not c[5]]
    if ws_configs:
        ws = _ws_module()
        try:
            ws.precompile(ws_configs, softmax_scale, num_workers)
        except Exception as e:  # noqa: BLE001 - the pipelined kernel still serves these steps (mla_decode)
            ws.disable(f"compile failed: {type(e).__name__}: {e}")
            configs += [c[:3] + (False, BLOCK_M) for c in ws_configs]
    if not configs:
        return
    # Parse on this thread (CPython 3.11's ast.parse is not thread-safe), run nvcc in parallel: TileLang's disk
    # cache then serves get_kernel, which re-parses serially but does not recompile.
    funcs = [build_mla_decode(h, mt, s, float(softmax_scale), causal_tile_bound=ctb, block_m=bm,
                              threads=SMALL_THREADS if bm != BLOCK_M else 256) for h, mt, s, ctb, bm in configs]

    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(compile_sm90, funcs))
    for h, mt, s, ctb, bm in configs:  # the launchers' own calls, so that their functools cache keys match
        _engine_kernel(h, mt, s, float(softmax_scale), ctb, bm)


CI_CONFIGS = [
    (128, 2, 1),
    (16, 4, 3),
    (16, 1, 32, False, SMALL_BLOCK_M),
]  # V3 decode without splits; V2-Lite verification (q<=16) with split + combine; V2-Lite batch-1 decode


def ci_compile(configs=None):
    """Compile representative configurations for sm_90a without a GPU and without TileLang's caches (used by
    tests/kernels_cuda/test_compile.py so that a kernel that stops compiling fails CI); plus one prefill variant
    (causal tile bound, 512-token bucket at 16 heads)."""

    cfgs = configs or CI_CONFIGS

    # Build the prim funcs (Python AST parsing) on this thread: CPython 3.11's ast.parse is not thread-safe
    # ("AST constructor recursion depth mismatch" seen here); only nvcc runs in parallel.
    funcs = [build_mla_decode(h, mt, s, HEAD_DIM**-0.5, causal_tile_bound=ctb, block_m=bm,
                              threads=SMALL_THREADS if bm != BLOCK_M else 256)
             for h, mt, s, ctb, bm, _ws in map(_normalize, cfgs)]
    assert not any(_normalize(c)[5] for c in cfgs), "warp-specialized configurations: mla_decode_ws.ci_compile"
    if configs is None:
        funcs.append(build_mla_decode(16, m_tiles_for(16, 512), 1, HEAD_DIM**-0.5, causal_tile_bound=True))

    with compile_pool(len(funcs)) as ex:
        return list(ex.map(compile_sm90, funcs))


def takes_warp_specialized(heads: int, q_bucket: int, warp_specialized: bool) -> bool:
    """Whether ``mla_decode(..., warp_specialized=...)`` launches ``mla_decode_ws``'s kernel: asked for, a 64-row
    tile, and that module not disabled (a failed compile)."""
    return bool(warp_specialized) and decode_block_m(heads, q_bucket) == BLOCK_M and \
        _ws_module().disabled_reason is None


def m_tiles_for(heads: int, max_seqlen_q: int) -> int:
    return -(-max_seqlen_q * heads // BLOCK_M)


def decode_block_m(heads: int, q_bucket: int) -> int:
    """Rows a CTA tile of the engine's decode kernel: 16 when one tile of 16 holds all the (token x head) rows."""
    return SMALL_BLOCK_M if heads * q_bucket <= SMALL_BLOCK_M else BLOCK_M


def decode_config(heads: int, q_bucket: int, num_splits: int, warp_specialized: bool = False) -> tuple:
    """The precompile configuration the engine's decode launch uses for ``q_bucket`` (``bucket_q``) query tokens:
    ``(heads, m_tiles, num_splits)``, ``(heads, 1, num_splits, False, SMALL_BLOCK_M)`` for the small tile, or with
    ``warp_specialized`` (``mla_decode``'s argument) and a 64-row tile ``(heads, m_tiles, num_splits, False, 64,
    True)``."""
    bm = decode_block_m(heads, q_bucket)
    if bm == BLOCK_M:
        mt = m_tiles_for(heads, q_bucket)
        return (heads, mt, num_splits, False, BLOCK_M, True) if warp_specialized else (heads, mt, num_splits)
    return (heads, -(-q_bucket * heads // bm), num_splits, False, bm)


def default_num_splits(
    batch: int, heads: int, max_seqlen_q: int, max_blocks_per_seq: int, num_sms: int = 132
) -> int:
    """Host-side split heuristic (no device sync): about one wave of CTAs, at least 1 page per split (at batch 1
    a 9-page context took 23 us in 2 splits: each page costs a few us of latency, so spread them out)."""
    ctas = batch * m_tiles_for(heads, max_seqlen_q)
    if ctas >= num_sms * 0.75:
        return 1
    s = max(1, round(num_sms / ctas))
    return int(min(s, max(1, max_blocks_per_seq), 32))


def bucket_q(max_seqlen_q: int) -> int:
    """Round the host-side max query length up to 1, 2, 4, 8 or 16 (fewer compiled variants / graph keys)."""
    assert 1 <= max_seqlen_q <= 16, "1..16 query tokens per request"
    return 1 << (max_seqlen_q - 1).bit_length()


MAX_PREFILL_Q = 8192  # query tokens per request of one prefill chunk (the engine's max_num_batched_tokens bound)


def bucket_prefill_q(max_seqlen_q: int) -> int:
    """Prefill query lengths rounded up to a power of two >= 32 (one compiled variant per bucket and head count)."""
    if not 1 <= max_seqlen_q <= MAX_PREFILL_Q:
        raise ValueError(f"mla_prefill: max query length {max_seqlen_q} outside 1..{MAX_PREFILL_Q}")
    return max(32, 1 << (max_seqlen_q - 1).bit_length())


# ----------------------------------------------------------------------------------------------------
# launch wrapper (the backend's op)
# ----------------------------------------------------------------------------------------------------
_DUMMIES = {}


def _dummy_partials(Tq, H, device):
    key = (Tq, H, str(device))
    if key not in _DUMMIES:
        _DUMMIES[key] = (
            torch.empty(1, Tq, H, KV_LORA, dtype=torch.float32, device=device),
            torch.empty(1, Tq, H, dtype=torch.float32, device=device),
        )
    return _DUMMIES[key]


def mla_decode(
    q_latent,
    q_rope,
    kv_cache,
    block_tables,
    seqlens_q,
    seqlens_k,
    cu_seqlens_q,
    softmax_scale,
    max_seqlen_q: int | None = None,
    num_splits: int | None = None,
    out=None,
    lse=None,
    num_sms: int | None = None,
    num_stages: int | None = None,
    threads: int | None = None,
    block_m: int | None = None,
    skip_empty_splits: bool = False,
    warp_specialized: bool = False,
    ws_variant: dict | None = None,
):
    """out_latent [T, H, 512] bf16 and lse [T, H] fp32. Pass max_seqlen_q (host int): no device sync.
    ``num_stages`` / ``threads`` / ``block_m`` / ``skip_empty_splits``: the split kernel's pipeline depth, CTA
    size, folded rows a CTA, and empty-split handling (tuning sweeps; None: the engine's choice,
    ``decode_block_m``). ``warp_specialized``: ``mla_decode_ws``'s kernel where the engine's tile has 64 rows
    (``mla_decode_ws.applies``; the tuning arguments then do not apply) unless that module was disabled (a failed
    compile: ``mla_decode_ws.disabled_reason``), ``ws_variant`` its ``get_kernel`` keyword arguments (benchmarks)."""
    Tq, H, _ = q_latent.shape
    B = block_tables.shape[0]
    if max_seqlen_q is None:
        max_seqlen_q = int(seqlens_q.max().item())  # sync: pass it explicitly under graph capture
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(q_latent.device).multi_processor_count
    if num_splits is None:
        num_splits = default_num_splits(B, H, bucket_q(max_seqlen_q), block_tables.shape[1], num_sms)
    engine_bm = decode_block_m(H, bucket_q(max_seqlen_q))
    use_ws = takes_warp_specialized(H, bucket_q(max_seqlen_q), warp_specialized)
    if use_ws:
        mt = m_tiles_for(H, bucket_q(max_seqlen_q))
        kern = _ws_module().get_kernel(H, mt, num_splits, float(softmax_scale), **(ws_variant or {}))
    elif num_stages is None and threads is None and block_m in (None, engine_bm) and not skip_empty_splits:
        mt = -(-bucket_q(max_seqlen_q) * H // engine_bm)
        kern = _engine_kernel(H, mt, num_splits, float(softmax_scale), block_m=engine_bm)  # precompile's call form
    else:
        bm = block_m or engine_bm
        mt = -(-bucket_q(max_seqlen_q) * H // bm)
        th = threads or (SMALL_THREADS if bm < BLOCK_M else 256)
        kern = get_kernel(H, mt, num_splits, float(softmax_scale), num_stages or 2, threads=th,
                          block_m=bm, skip_empty_splits=skip_empty_splits)
    if out is None:
        out = torch.empty_like(q_latent)
    if lse is None:
        lse = torch.empty(Tq, H, dtype=torch.float32, device=q_latent.device)
    S = num_splits
    if S > 1:
        o_part = torch.empty(S, Tq, H, KV_LORA, dtype=torch.float32, device=q_latent.device)
        l_part = torch.empty(S, Tq, H, dtype=torch.float32, device=q_latent.device)
    else:  # unused by the kernel, but the shapes must bind: a cached dummy (kept alive for graph replays)
        o_part, l_part = _dummy_partials(Tq, H, q_latent.device)
    q_start = cu_seqlens_q[:B]
    if use_ws:  # its Q inputs are the [T * H, D] row views
        q_latent, q_rope = q_latent.reshape(Tq * H, KV_LORA), q_rope.reshape(Tq * H, ROPE)
    kern(q_latent, q_rope, kv_cache, block_tables, q_start, seqlens_q, seqlens_k, out, lse, o_part, l_part)
    return out, lse


def mla_prefill(q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale,
                max_seqlen_q: int, out=None, lse=None):
    """Prefill chunks (varlen, causal, any context before the chunk) through the same kernel: query tokens x heads
    folded into 64-row tiles, ``ceil(bucket(max_q) * H / 64)`` CTAs per request (tiles past a request's rows exit
    at once), each stopping at the last key tile its rows can see; no KV split. ``max_seqlen_q`` is the host max
    query length (no device sync)."""
    Tq, H, _ = q_latent.shape
    B = block_tables.shape[0]
    mt = m_tiles_for(H, bucket_prefill_q(int(max_seqlen_q)))
    kern = _engine_kernel(H, mt, 1, float(softmax_scale), causal=True)
    if out is None:
        out = torch.empty_like(q_latent)
    if lse is None:
        lse = torch.empty(Tq, H, dtype=torch.float32, device=q_latent.device)
    o_part, l_part = _dummy_partials(Tq, H, q_latent.device)
    kern(q_latent, q_rope, kv_cache, block_tables, cu_seqlens_q[:B], seqlens_q, seqlens_k, out, lse, o_part, l_part)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# fp32 reference over gathered pages
# ----------------------------------------------------------------------------------------------------
def mla_decode_ref(
    q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale
):
    Tq, H, _ = q_latent.shape
    out = torch.empty(Tq, H, KV_LORA, dtype=torch.float32, device=q_latent.device)
    lse = torch.empty(Tq, H, dtype=torch.float32, device=q_latent.device)
    sq_l, sk_l, cu_l = seqlens_q.tolist(), seqlens_k.tolist(), cu_seqlens_q.tolist()
    for b in range(block_tables.shape[0]):
        sq, sk, q0 = sq_l[b], sk_l[b], cu_l[b]
        if sq == 0:
            continue
        pages = block_tables[b, : -(-sk // PAGE)].long()
        kv = kv_cache[pages].reshape(-1, HEAD_DIM)[:sk].float()  # [sk, 576]
        q = torch.cat([q_latent[q0 : q0 + sq], q_rope[q0 : q0 + sq]], dim=-1).float()  # [sq, H, 576]
        s = torch.einsum("qhd,kd->qhk", q, kv) * softmax_scale
        pos_q = sk - sq + torch.arange(sq, device=q.device)
        mask = torch.arange(sk, device=q.device)[None, :] > pos_q[:, None]  # [sq, sk]
        s = s.masked_fill(mask[:, None, :], float("-inf"))
        lse[q0 : q0 + sq] = torch.logsumexp(s, dim=-1)
        out[q0 : q0 + sq] = torch.einsum("qhk,kd->qhd", torch.softmax(s, dim=-1), kv[:, :KV_LORA])
    return out, lse


# ----------------------------------------------------------------------------------------------------
# inputs, checks, benchmark
# ----------------------------------------------------------------------------------------------------
def make_inputs(batch, heads, seqlens_k, seqlens_q, device="cuda", seed=0, spare_blocks=2):
    """Random paged problem, shuffled pages. seqlens_k / seqlens_q: int or list per request. Cache slots past
    seqlens_k and an unreferenced 'poison' page (where unused block-table entries point) hold large finite
    values,
    so a missing mask or an out-of-range page read shows in the output."""
    g = torch.Generator(device=device).manual_seed(seed)
    sk = [seqlens_k] * batch if isinstance(seqlens_k, int) else list(seqlens_k)
    sq = [seqlens_q] * batch if isinstance(seqlens_q, int) else list(seqlens_q)
    assert all(1 <= q <= k for q, k in zip(sq, sk))
    nbs = [-(-k // PAGE) for k in sk]
    nb_max = max(nbs) + spare_blocks
    used = sum(nbs)
    poison_page = used
    perm = torch.randperm(used, generator=torch.Generator().manual_seed(seed))
    bt = torch.full((batch, nb_max), poison_page, dtype=torch.int32)
    o = 0
    for b in range(batch):
        bt[b, : nbs[b]] = perm[o : o + nbs[b]].int()
        o += nbs[b]
    kv = torch.randn(used + 1, PAGE, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16)
    for b in range(
        batch
    ):  # poison the tail of each request's last page (finite: see the module precondition)
        tail = sk[b] % PAGE
        if tail:
            kv[int(bt[b, nbs[b] - 1]), tail:] = 3.0e4
    kv[poison_page] = 3.0e4
    Tq = sum(sq)
    ql = torch.randn(Tq, heads, KV_LORA, generator=g, device=device, dtype=torch.bfloat16)
    qr = torch.randn(Tq, heads, ROPE, generator=g, device=device, dtype=torch.bfloat16)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(sq, dtype=torch.int32), 0)
    return dict(
        q_latent=ql,
        q_rope=qr,
        kv_cache=kv,
        block_tables=bt.to(device),
        seqlens_q=torch.tensor(sq, dtype=torch.int32, device=device),
        seqlens_k=torch.tensor(sk, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
    )


PREFILL_OUT_ULPS = 3.0  # see check_prefill_case


def compare(out, ref, name, ulps=2.0):
    """FlashMLA-style: NaN/inf positions equal, cosine deficit 1 - 2<x,y>/(|x|^2+|y|^2) < 1e-5, and each
    element within `ulps` bf16 ulps (2^-7 relative) of the reference, measured against |ref| + rms(ref)."""
    out = out.float()
    ref = ref.float()
    if not torch.equal(torch.isnan(out), torch.isnan(ref)):
        return False, dict(name=name, error="NaN positions differ", n_nan=int(torch.isnan(out).sum()))
    if not torch.equal(torch.isinf(out), torch.isinf(ref)):
        return False, dict(name=name, error="inf positions differ")
    fin = torch.isfinite(ref)
    o, r = out[fin].double(), ref[fin].double()
    if r.numel() == 0:
        return True, dict(name=name, cos_diff=0.0, max_abs=0.0, worst_ulps=0.0)
    cos_diff = (1 - 2 * (o * r).sum() / ((o * o).sum() + (r * r).sum()).clamp_min(1e-30)).item()
    eps = 2.0**-7
    rms = r.pow(2).mean().sqrt().item()
    err = (o - r).abs()
    worst = (err / (eps * (r.abs() + rms))).max().item()
    ok = worst <= ulps and cos_diff < 1e-5
    return ok, dict(name=name, cos_diff=cos_diff, max_abs=err.max().item(), worst_ulps=worst)


def check_case(batch, heads, seqlens_k, seqlens_q, num_splits=None, seed=0, verbose=True, warp_specialized=False,
               ws_variant=None):
    """Fresh random inputs, NaN-poisoned outputs, fp32 reference; returns (ok, stats). ``warp_specialized``: the
    kernel of ``mla_decode_ws`` (where it applies), ``ws_variant`` its ``get_kernel`` switches (e.g. a schedule)."""
    inp = make_inputs(batch, heads, seqlens_k, seqlens_q, seed=seed)
    scale = HEAD_DIM**-0.5
    Tq, H = inp["q_latent"].shape[:2]
    out = torch.full((Tq, H, KV_LORA), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((Tq, H), float("nan"), dtype=torch.float32, device="cuda")
    max_q = max(seqlens_q) if isinstance(seqlens_q, list) else seqlens_q
    mla_decode(**inp, softmax_scale=scale, max_seqlen_q=max_q, num_splits=num_splits, out=out, lse=lse,
               warp_specialized=warp_specialized, ws_variant=ws_variant)
    torch.cuda.synchronize()
    ref_o, ref_l = mla_decode_ref(**inp, softmax_scale=scale)
    ok_o, so = compare(out, ref_o, "out")
    ok_l, sl = compare(lse, ref_l, "lse", ulps=0.25)
    ok = ok_o and ok_l
    if verbose:
        print(
            f"check{' ws' if warp_specialized else ''} B={batch} H={heads} "
            f"sk={seqlens_k if isinstance(seqlens_k, int) else 'var'} "
            f"sq={seqlens_q if isinstance(seqlens_q, int) else f'var<={max_q}'} splits={num_splits}: "
            f"{'OK' if ok else 'FAIL'} out={so} lse={sl}",
            flush=True,
        )
    return ok, dict(out=so, lse=sl)


def check_cases(seed=0):
    """(batch, heads, seqlens_k, seqlens_q, num_splits): decode, verification (1..16 q tokens), short contexts
    (empty splits), odd lengths (partial last page), varlen batches. Splits 1 or 3 to bound compiles."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for H in (16, 128):
        cases += [
            (4, H, 1000, 1, 1),
            (3, H, 64, 1, 3),
            (5, H, 777, 4, 3 if H == 128 else 1),
            (6, H, 2049, 16, 3),
            (2, H, 5000, 16, 1),
        ]
        rb = 9
        sq = torch.randint(1, 17, (rb,), generator=g).tolist()
        sk = [max(k, q) for k, q in zip(torch.randint(16, 3000, (rb,), generator=g).tolist(), sq)]
        sq4 = [min(q, 4) for q in sq]
        cases += [(rb, H, sk, sq, 1), (rb, H, sk, sq, 3), (rb, H, sk, [1] * rb, 3), (rb, H, sk, sq4, 1)]
    return cases


def prefill_check_cases(seed=0):
    """(batch, heads, seqlens_k, seqlens_q): whole prompts (sk == sq), chunked prefill (context before the chunk),
    varlen batches with tiny and long chunks, partial last pages."""
    g = torch.Generator().manual_seed(seed + 1)
    cases = []
    for H in (16, 128):
        cases += [(2, H, 300, 300), (3, H, 1000, 257), (1, H, 64, 64), (1, H, 33, 17)]
        sq = torch.randint(1, 700, (5,), generator=g).tolist()
        sk = [q + c for q, c in zip(sq, torch.randint(0, 1500, (5,), generator=g).tolist())]
        cases.append((5, H, sk, sq))
    return cases


def check_prefill_case(batch, heads, seqlens_k, seqlens_q, seed=0, verbose=True):
    """mla_prefill vs the fp32 reference on fresh inputs with NaN-poisoned outputs; returns (ok, stats)."""
    inp = make_inputs(batch, heads, seqlens_k, seqlens_q, seed=seed)
    scale = HEAD_DIM**-0.5
    Tq, H = inp["q_latent"].shape[:2]
    out = torch.full((Tq, H, KV_LORA), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((Tq, H), float("nan"), dtype=torch.float32, device="cuda")
    max_q = max(seqlens_q) if isinstance(seqlens_q, list) else seqlens_q
    mla_prefill(**inp, softmax_scale=scale, max_seqlen_q=max_q, out=out, lse=lse)
    torch.cuda.synchronize()
    ref_o, ref_l = mla_decode_ref(**inp, softmax_scale=scale)
    # 3 ulps, not decode's 2: causal rows with few keys average 1-3 values whose probabilities the kernel rounds to
    # bf16 (as FlashMLA does); where those values cancel, |ref| is small and that rounding reaches 2.1 ulps of
    # |ref| + rms(ref) (seen on an H200 at sk = sq = 300, cosine deficit 1.9e-6 as in the passing cases).
    ok_o, so = compare(out, ref_o, "out", ulps=PREFILL_OUT_ULPS)
    ok_l, sl = compare(lse, ref_l, "lse", ulps=0.25)
    ok = ok_o and ok_l
    if verbose:
        print(f"check prefill B={batch} H={heads} sk={seqlens_k if isinstance(seqlens_k, int) else 'var'} "
              f"sq={seqlens_q if isinstance(seqlens_q, int) else f'var<={max_q}'}: {'OK' if ok else 'FAIL'} "
              f"out={so} lse={sl}", flush=True)
    return ok, dict(out=so, lse=sl)


def run_prefill_checks(seed=0):
    ok = True
    for i, (b, h, sk, sq) in enumerate(prefill_check_cases(seed)):
        ok &= check_prefill_case(b, h, sk, sq, seed=seed + 100 + i)[0]
    return ok


def configs_for_cases(cases):
    return [decode_config(H, bucket_q(max(sq) if isinstance(sq, list) else sq), S) for (_, H, _, sq, S) in cases]


BENCH_SHAPES = [(B, H, S) for H in (16, 128) for B in (64, 128) for S in (4096, 8192)]


def bench_configs(num_sms=132):
    return [decode_config(H, 1, default_num_splits(B, H, 1, S // PAGE, num_sms)) for B, H, S in BENCH_SHAPES]


def run_checks(seed=0):
    ok = True
    for i, (b, h, sk, sq, s) in enumerate(check_cases(seed)):
        ok &= check_case(b, h, sk, sq, s, seed=seed + i)[0]
    return ok


copy_bandwidth = _bench.copy_gbps  # device-to-device copy GB/s, bytes read + written


def bench_case(batch, heads, seqlen_k, q_len=1, num_splits=None, copy_gbps=None, seed=100, num_stages=None,
               threads=None, block_m=None, check=False, skip_empty_splits=False, warp_specialized=False,
               ws_variant=None):
    """Median kernel time, from CUDA-graph replays (falls back to plain event timing if capture fails).
    Bytes = KV cache read once (FlashMLA's count) + q + out + lse + block table. ``check``: also compare the
    output with the fp32 reference (``compare``, 2 ulps) and report it in the row."""
    from triton.testing import do_bench

    scale = HEAD_DIM**-0.5
    inp = make_inputs(batch, heads, seqlen_k, q_len, seed=seed, spare_blocks=0)
    Tq = batch * q_len
    out = torch.empty(Tq, heads, KV_LORA, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(Tq, heads, dtype=torch.float32, device="cuda")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    S = (
        num_splits
        if num_splits is not None
        else default_num_splits(batch, heads, bucket_q(q_len), -(-seqlen_k // PAGE), num_sms)
    )

    def fn():
        mla_decode(
            **inp, softmax_scale=scale, max_seqlen_q=q_len, num_splits=S, out=out, lse=lse, num_sms=num_sms,
            num_stages=num_stages, threads=threads, block_m=block_m, skip_empty_splits=skip_empty_splits,
            warp_specialized=warp_specialized, ws_variant=ws_variant,
        )

    fn()
    torch.cuda.synchronize()
    timing = "graph"
    try:
        reps = 10
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(reps):
                fn()
        gr.replay()
        torch.cuda.synchronize()
        t = do_bench(gr.replay, warmup=25, rep=300, return_mode="median") / reps
    except Exception as e:  # noqa: BLE001
        print(f"graph capture failed ({type(e).__name__}: {e}); timing plain launches", flush=True)
        timing = "events"
        t = do_bench(fn, warmup=25, rep=300, return_mode="median")
    kv_bytes = batch * seqlen_k * HEAD_DIM * 2
    ws_row = takes_warp_specialized(heads, bucket_q(q_len), warp_specialized)
    nbytes = (
        kv_bytes
        + Tq * heads * HEAD_DIM * 2
        + Tq * heads * KV_LORA * 2
        + Tq * heads * 4
        + batch * (-(-seqlen_k // PAGE)) * 4
    )
    flops = 2 * Tq * heads * seqlen_k * (HEAD_DIM + KV_LORA)
    gbps = nbytes / (t * 1e-3) / 1e9
    row = {
        "bench": "mla_decode",
        "hardware": torch.cuda.get_device_name(),
        "batch": batch,
        "seqlen_k": seqlen_k,
        "heads": heads,
        "q_len": q_len,
        "num_splits": S,
        "num_stages": num_stages or 2,
        "threads": (_ws_module().threads((ws_variant or {}).get("schedule")) if ws_row else threads
                    or (SMALL_THREADS if (block_m or decode_block_m(heads, bucket_q(q_len))) < BLOCK_M else 256)),
        "block_m": block_m or decode_block_m(heads, bucket_q(q_len)),
        "skip_empty_splits": skip_empty_splits,
        "kernel": "warp_specialized" if ws_row else "pipelined",
        "schedule": ((ws_variant or {}).get("schedule") or _ws_module().SCHEDULE) if ws_row else None,
        "us": round(t * 1e3, 2),
        "bytes": nbytes,
        "GBps": round(gbps, 1),
        "TFLOPs": round(flops / (t * 1e-3) / 1e12, 1),
        "timing": timing,
    }
    if copy_gbps:
        row.update(copy_GBps=round(copy_gbps, 1), frac_of_copy=round(gbps / copy_gbps, 3))
    if check:
        ref, _ = mla_decode_ref(**inp, softmax_scale=scale)
        fn()
        ok, info = compare(out, ref, "sweep")
        row.update(check="PASS" if ok else "FAIL", check_info={k: v for k, v in info.items() if k != "name"})
    return row


def main(argv=None):
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="numerics vs the fp32 reference (needs a GPU)")
    ap.add_argument("--bench", action="store_true", help="time the issue's shapes (needs a GPU)")
    ap.add_argument(
        "--compile-only", action="store_true", help="compile the check/bench configurations for sm_90a"
    )
    ap.add_argument("--check-prefill", action="store_true", help="mla_prefill vs the fp32 reference (needs a GPU)")
    ap.add_argument("--sweep-batch1", action="store_true",
                    help="batch-1 latency sweep (16 heads, contexts 512, 4096): splits x stages x threads (GPU)")
    args = ap.parse_args(argv)
    _bench.exit_without_cuda(args)
    if args.compile_only or args.check or args.bench:
        cfgs = []
        if args.compile_only or args.check:
            cfgs += configs_for_cases(check_cases())
        if args.compile_only or args.bench:
            cfgs += bench_configs()
        t = time.time()
        precompile(cfgs)
        print(f"compiled {len(set(cfgs))} configurations in {time.time() - t:.1f}s", flush=True)
    ok = True
    if args.check:
        ok = run_checks()
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.check_prefill:
        ok_p = run_prefill_checks()
        print("CHECK PREFILL", "PASS" if ok_p else "FAIL", flush=True)
        ok = ok and ok_p
    if args.bench:
        cb = copy_bandwidth()
        print(json.dumps({"bench": "copy", "GBps": round(cb, 1)}), flush=True)
        for B, H, S in BENCH_SHAPES:
            print(json.dumps(bench_case(B, H, S, 1, copy_gbps=cb)), flush=True)
    if args.sweep_batch1:
        sweep_batch1()
    return 0 if ok else 1


def sweep_batch1(heads=16, contexts=(512, 4096)):
    """Batch-1 decode is latency, not bytes (a 512-token context is 590 KB: 13.4 us a layer in the engine's
    profile). Time every (num_splits, num_stages, threads) on graph replays; JSON lines."""
    import json

    scale = HEAD_DIM**-0.5
    # block_m 16: the 16 heads of one token in an mma.sync tile instead of a 64-row wgmma tile (4x fewer rows)
    # 32 splits: what a batch-1 decode graph gets from a wide table (default_num_splits caps by the table width,
    # not the context), so most of its CTAs hold no page at a 512-token context
    grid = [(s, st, th, bm, False) for s in (1, 3, 9, 32) for st in (1, 2) for th in (128, 256) for bm in (64, 16)]
    grid += [(s, 2, 256, bm, True) for s in (9, 32) for bm in (64, 16)]  # empty splits write / read nothing
    funcs = [build_mla_decode(heads, -(-heads // bm), s, scale, st, threads=th, block_m=bm, skip_empty_splits=sk)
             for s, st, th, bm, sk in grid]
    with compile_pool(16) as ex:  # compile in parallel; get_kernel then hits TileLang's cache
        list(ex.map(lambda f: tilelang.compile(f, out_idx=None, target=dict(SM90_TARGET),
                                               pass_configs=_pass_configs()), funcs))
    cb = copy_bandwidth()
    for ctx in contexts:
        for s, st, th, bm, sk in grid:
            row = bench_case(1, heads, ctx, 1, num_splits=s, copy_gbps=cb, num_stages=st, threads=th, block_m=bm,
                             check=True, skip_empty_splits=sk)
            print(json.dumps(dict(row, sweep="batch1")), flush=True)


if __name__ == "__main__":
    sys.exit(main())
