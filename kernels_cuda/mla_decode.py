"""Paged MLA decode (absorbed) for Hopper, in TileLang; also serves prefill chunks (``mla_prefill``). The kernel's
factory is in ``_mla_decode_kernel.py``; configurations, the compile cache and the launchers are here.

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
directly). One build serves every split count above 1 (``DYNAMIC_SPLITS``: the count is the partial buffers' first
dimension), so the engine's decode graphs, whose counts differ by batch size, share it.

On a Hopper the engine runs the 64-row tile on ``mla_decode_ws``'s hand warp-specialized kernel instead
(``mla_decode(..., warp_specialized=True)``; the same contract; 1.24-1.31x faster at 128 heads on an H200).

Precondition: cache slots past seqlens_k inside the last page must hold finite values (allocate the cache with
zeros); they are masked out of the softmax, but 0 * NaN in P@V would still be NaN.
"""

import functools

import torch

from . import mla_decode_ws as _ws
from ._ast_guard import compile_pool
from ._mla_common import (  # noqa: F401 - PAGE, HEAD_DIM, LOG2E ... are this module's public layout too
    BLOCK_M,
    BLOCK_N,
    DYNAMIC_SPLITS,
    FP8_GROUP,
    FP8_PE_OFFSET,
    FP8_ROW_BYTES,
    FP8_SCALE_OFFSET,
    HEAD_DIM,
    KV_LORA,
    LN2,
    LOG2E,
    PAGE,
    ROPE,
    SM90_TARGET,
    SMALL_BLOCK_M,
    SMALL_THREADS,
    T,
    combine_splits,
    compile_sm90,
    decode_block_m,
    kernel_splits,
    m_tiles_for,
    tilelang,
)
from ._mla_decode_kernel import FP8_CONSUMER_REGS, build_mla_decode  # noqa: F401 - public names


def _ws_module():
    """``mla_decode_ws`` (its ``disabled_reason``: why the warp-specialized kernel is off in this process)."""
    return _ws


@functools.cache
def get_kernel(heads: int, m_tiles: int, num_splits: int, softmax_scale: float, num_stages: int = 2,
               causal_tile_bound: bool = False, threads: int = 256, block_m: int = BLOCK_M,
               skip_empty_splits: bool = False, kv_fp8: bool = False):
    """Compile for sm_90a (cached per configuration, in memory and in TileLang's disk cache)."""
    assert tilelang is not None, "tilelang is not installed"
    func = build_mla_decode(heads, m_tiles, num_splits, softmax_scale, num_stages, threads=threads,
                            causal_tile_bound=causal_tile_bound, block_m=block_m,
                            skip_empty_splits=skip_empty_splits, kv_fp8=kv_fp8)
    return compile_sm90(func)


def _engine_kernel(heads: int, m_tiles: int, num_splits: int, softmax_scale: float, causal: bool = False,
                   block_m: int = BLOCK_M, kv_fp8: bool = False):
    """The engine's kernels, always through this one call form: ``get_kernel``'s functools cache keys on how a call
    is spelled, so precompile and the launches must spell it the same way."""
    if kv_fp8:
        threads = SMALL_THREADS if block_m != BLOCK_M else 256
        return get_kernel(heads, m_tiles, num_splits, softmax_scale, 2, causal, threads, block_m, False, True)
    if causal:
        return get_kernel(heads, m_tiles, num_splits, softmax_scale, causal_tile_bound=True)
    if block_m == BLOCK_M:
        return get_kernel(heads, m_tiles, num_splits, softmax_scale)
    return get_kernel(heads, m_tiles, num_splits, softmax_scale, 2, threads=SMALL_THREADS, block_m=block_m)


def _normalize(config) -> tuple:
    """(heads, m_tiles, num_splits[, causal[, block_m[, warp_specialized[, kv_fp8]]]]) -> the 7-tuple."""
    c = tuple(config)
    return (c[0], c[1], c[2], bool(c[3]) if len(c) > 3 else False, int(c[4]) if len(c) > 4 else BLOCK_M,
            bool(c[5]) if len(c) > 5 else False, bool(c[6]) if len(c) > 6 else False)


def fp8_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed FP8 cache (uint8 [blocks, 64, FP8_ROW_BYTES]) as the kernel's three views of the same bytes:
    e4m3 [.., 656] (the latents), fp32 [.., 164] (the scales) and bf16 [.., 328] (the RoPE values)."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or kv_cache.shape[-1] != FP8_ROW_BYTES \
            or not kv_cache.is_contiguous():
        raise ValueError(f"mla_decode: a packed FP8 cache is contiguous uint8 [blocks, {PAGE}, {FP8_ROW_BYTES}], got "
                         f"{kv_cache.dtype} {list(kv_cache.shape)} (contiguous={kv_cache.is_contiguous()})")
    return kv_cache.view(torch.float8_e4m3fn), kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)


def precompile(configs, softmax_scale: float = HEAD_DIM**-0.5, num_workers=None):
    """Compile several configurations ahead of use: decode ``(heads, m_tiles, num_splits)`` (``decode_config``:
    plus ``False, block_m`` for the small-tile variant, ``False, 64, True`` for ``mla_decode_ws``'s kernel) or,
    with a fourth item ``True``, ``mla_prefill``'s causal variant ``(heads, m_tiles, num_splits, True)``."""

    configs = list(dict.fromkeys(_normalize(c) for c in configs))
    ws_configs = [c[:3] for c in configs if c[5]]
    configs = [c[:5] + c[6:] for c in configs if not c[5]]
    if ws_configs:
        try:
            _ws.precompile(ws_configs, softmax_scale, num_workers)
        except Exception as e:  # noqa: BLE001 - the pipelined kernel still serves these steps (mla_decode)
            _ws.disable(f"compile failed: {type(e).__name__}: {e}")
            configs += [c[:3] + (False, BLOCK_M, False) for c in ws_configs]
    if not configs:
        return
    # Parse on this thread (CPython 3.11's ast.parse is not thread-safe), run nvcc in parallel: TileLang's disk
    # cache then serves get_kernel, which re-parses serially but does not recompile.
    funcs = [build_mla_decode(h, mt, s, float(softmax_scale), causal_tile_bound=ctb, block_m=bm,
                              threads=SMALL_THREADS if bm != BLOCK_M else 256, kv_fp8=fp8)
             for h, mt, s, ctb, bm, fp8 in configs]

    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(compile_sm90, funcs))
    for h, mt, s, ctb, bm, fp8 in configs:  # the launchers' own calls, so that their functools cache keys match
        _engine_kernel(h, mt, s, float(softmax_scale), ctb, bm, fp8)


CI_CONFIGS = [
    (128, 2, 1),
    (16, 4, DYNAMIC_SPLITS),
    (16, 1, DYNAMIC_SPLITS, False, SMALL_BLOCK_M),
    (16, 1, DYNAMIC_SPLITS, False, SMALL_BLOCK_M, False, True),
]  # V3 decode without splits; V2-Lite verification (q<=16) with split + combine; V2-Lite batch-1 decode, bf16 and
# packed FP8 cache


def ci_compile(configs=None, target=None):
    """Compile representative configurations for ``target`` (default sm_90a) without a GPU and without TileLang's
    caches (tests/kernels_cuda/test_compile.py); plus one prefill variant (causal tile bound, 512-token bucket at
    16 heads)."""
    cfgs = configs or CI_CONFIGS

    # Build the prim funcs (Python AST parsing) on this thread: CPython 3.11's ast.parse is not thread-safe
    # ("AST constructor recursion depth mismatch" seen here); only nvcc runs in parallel.
    funcs = [build_mla_decode(h, mt, s, HEAD_DIM**-0.5, causal_tile_bound=ctb, block_m=bm,
                              threads=SMALL_THREADS if bm != BLOCK_M else 256, kv_fp8=fp8)
             for h, mt, s, ctb, bm, _w, fp8 in map(_normalize, cfgs)]
    assert not any(_normalize(c)[5] for c in cfgs), "warp-specialized configurations: mla_decode_ws.ci_compile"
    if configs is None:
        funcs.append(build_mla_decode(16, m_tiles_for(16, 512), 1, HEAD_DIM**-0.5, causal_tile_bound=True))

    with compile_pool(len(funcs)) as ex:
        return list(ex.map(lambda f: compile_sm90(f, target), funcs))


def takes_warp_specialized(heads: int, q_bucket: int, warp_specialized: bool) -> bool:
    """Whether ``mla_decode(..., warp_specialized=...)`` launches ``mla_decode_ws``'s kernel: asked for, a 64-row
    tile, and that module not disabled (a failed compile)."""
    return bool(warp_specialized) and decode_block_m(heads, q_bucket) == BLOCK_M and \
        _ws.disabled_reason is None


def decode_config(heads: int, q_bucket: int, num_splits: int, warp_specialized: bool = False,
                  kv_fp8: bool = False) -> tuple:
    """The precompile configuration the engine's decode launch uses for ``q_bucket`` (``bucket_q``) query tokens and
    ``num_splits`` splits: ``(heads, m_tiles, splits)``, ``(heads, 1, splits, False, SMALL_BLOCK_M)`` for the small
    tile, or with ``warp_specialized`` (``mla_decode``'s argument) and a 64-row tile ``(heads, m_tiles, splits,
    False, 64, True)``. ``kv_fp8`` (a packed FP8 cache; never the warp-specialized kernel): ``(heads, m_tiles,
    splits, False, block_m, False, True)``. ``splits`` is ``kernel_splits(num_splits)``: 1, or ``DYNAMIC_SPLITS``
    for any count above 1 (one build serves them all)."""
    num_splits = kernel_splits(num_splits)
    bm = decode_block_m(heads, q_bucket)
    if kv_fp8:
        return (heads, -(-q_bucket * heads // bm), num_splits, False, bm, False, True)
    if bm == BLOCK_M:
        mt = m_tiles_for(heads, q_bucket)
        return (heads, mt, num_splits, False, BLOCK_M, True) if warp_specialized else (heads, mt, num_splits)
    return (heads, -(-q_bucket * heads // bm), num_splits, False, bm)


def resident_ctas(heads: int, q_bucket: int, kv_fp8: bool) -> int:
    """CTAs of the engine's decode kernel an SM holds at once: 2 for the FP8 cache's 16-row tile, else 1."""
    return 2 if kv_fp8 and decode_block_m(heads, q_bucket) == SMALL_BLOCK_M else 1


def default_num_splits(
    batch: int, heads: int, max_seqlen_q: int, max_blocks_per_seq: int, num_sms: int = 132, kv_fp8: bool = False
) -> int:
    """Host-side split heuristic (no device sync): about one wave of CTAs (``resident_ctas`` an SM), at least 1
    page per split (at batch 1 a 9-page context took 23 us in 2 splits: each page costs a few us of latency, so
    spread them out). ``max_seqlen_q``: the bucketed query length; ``kv_fp8``: a packed FP8 cache."""
    slots = num_sms * resident_ctas(heads, max_seqlen_q, kv_fp8)
    ctas = batch * m_tiles_for(heads, max_seqlen_q)
    if ctas >= slots * 0.75:
        return 1
    s = max(1, round(slots / ctas))
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


def _dummy_partials(device):
    """The one-split kernels' placeholders for the partials they never touch (``split_layout``), one pair a
    device, kept alive for graph replays."""
    key = str(device)
    if key not in _DUMMIES:
        _DUMMIES[key] = (torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device),
                         torch.empty(1, 1, 1, dtype=torch.float32, device=device))
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
):
    """out_latent [T, H, 512] bf16 and lse [T, H] fp32. Pass max_seqlen_q (host int): no device sync.
    ``num_stages`` / ``threads`` / ``block_m`` / ``skip_empty_splits``: the split kernel's pipeline depth, CTA
    size, folded rows a CTA, and empty-split handling (tuning sweeps; None: the engine's choice,
    ``decode_block_m``). ``warp_specialized``: ``mla_decode_ws``'s kernel where the engine's tile has 64 rows
    (``mla_decode_ws.applies``; the tuning arguments then do not apply) unless that module was disabled (a failed
    compile: ``mla_decode_ws.disabled_reason``)."""
    Tq, H, _ = q_latent.shape
    B = block_tables.shape[0]
    if max_seqlen_q is None:
        max_seqlen_q = int(seqlens_q.max().item())  # sync: pass it explicitly under graph capture
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(q_latent.device).multi_processor_count
    kv_fp8 = kv_cache.dtype == torch.uint8
    if num_splits is None:
        num_splits = default_num_splits(B, H, bucket_q(max_seqlen_q), block_tables.shape[1], num_sms, kv_fp8)
    engine_bm = decode_block_m(H, bucket_q(max_seqlen_q))
    use_ws = takes_warp_specialized(H, bucket_q(max_seqlen_q), warp_specialized) and not kv_fp8
    ks = kernel_splits(num_splits)  # the count itself reaches the kernel through the partials' shape
    if kv_fp8:  # the engine's tile only
        mt = -(-bucket_q(max_seqlen_q) * H // engine_bm)
        kern = _engine_kernel(H, mt, ks, float(softmax_scale), block_m=engine_bm, kv_fp8=True)
    elif use_ws:
        mt = m_tiles_for(H, bucket_q(max_seqlen_q))
        kern = _ws.get_kernel(H, mt, ks, float(softmax_scale))
    elif num_stages is None and threads is None and block_m in (None, engine_bm) and not skip_empty_splits:
        mt = -(-bucket_q(max_seqlen_q) * H // engine_bm)
        kern = _engine_kernel(H, mt, ks, float(softmax_scale), block_m=engine_bm)  # precompile's call form
    else:
        bm = block_m or engine_bm
        mt = -(-bucket_q(max_seqlen_q) * H // bm)
        th = threads or (SMALL_THREADS if bm < BLOCK_M else 256)
        kern = get_kernel(H, mt, ks, float(softmax_scale), num_stages or 2, threads=th,
                          block_m=bm, skip_empty_splits=skip_empty_splits)
    if out is None:
        out = torch.empty_like(q_latent)
    if lse is None:
        lse = torch.empty(Tq, H, dtype=torch.float32, device=q_latent.device)
    S = num_splits
    if S > 1:
        o_part = torch.empty(S, Tq, H, KV_LORA, dtype=torch.float32, device=q_latent.device)
        l_part = torch.empty(S, Tq, H, dtype=torch.float32, device=q_latent.device)
    else:
        o_part, l_part = _dummy_partials(q_latent.device)
    q_start = cu_seqlens_q[:B]
    if use_ws:  # its Q inputs are the [T * H, D] row views
        q_latent, q_rope = q_latent.reshape(Tq * H, KV_LORA), q_rope.reshape(Tq * H, ROPE)
    kv = fp8_views(kv_cache) if kv_fp8 else (kv_cache,)
    kern(q_latent, q_rope, *kv, block_tables, q_start, seqlens_q, seqlens_k, out, lse, o_part, l_part)
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
    kv_fp8 = kv_cache.dtype == torch.uint8
    kern = _engine_kernel(H, mt, 1, float(softmax_scale), causal=True, kv_fp8=kv_fp8)
    if out is None:
        out = torch.empty_like(q_latent)
    if lse is None:
        lse = torch.empty(Tq, H, dtype=torch.float32, device=q_latent.device)
    o_part, l_part = _dummy_partials(q_latent.device)
    kv = fp8_views(kv_cache) if kv_fp8 else (kv_cache,)
    kern(q_latent, q_rope, *kv, block_tables, cu_seqlens_q[:B], seqlens_q, seqlens_k, out, lse, o_part, l_part)
    return out, lse
