"""Kernel benchmarks: ``python -m deepinfer_npu.kernels_cuda.bench NAME [options]`` on a CUDA device.

One JSON line per measurement on stdout (and appended to ``--out``), each with ``deepinfer_npu.benchmark_meta``'s
date, commit, hardware and command. Times are medians of CUDA-graph replays of 20 launches where the launch can be
captured (so the per-launch figure excludes launch overhead), else of event-timed launches; ``frac_of_copy`` is the
achieved bytes/s over the device-to-device copy bandwidth measured in the same run. NAME is a kernel module
(``rms_norm``, ``mla_decode`` ...), ``mla_decode_ws`` (the warp-specialized decode against the pipelined one) or
``copy``; ``all`` runs every one. Numerics are checked by tests/kernels_cuda, not here.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import json
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator

import torch

from deepinfer_npu.benchmark_meta import row_meta

from . import _testing as problems

BENCHES: dict[str, Callable[[argparse.Namespace, float], Iterator[dict]]] = {}


def bench(fn):
    """Register ``bench_<name>(args, copy_gbps)`` as NAME (a generator of rows)."""
    BENCHES[fn.__name__.removeprefix("bench_")] = fn
    return fn


# ---- timing ------------------------------------------------------------------------------------------------------
def copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy GB/s counting bytes read + written (median of do_bench)."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def time_us(fn, graph: bool = True) -> tuple[float, str]:
    """-> (microseconds per call, "graph" | "events")."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            reps = 20
            side = torch.cuda.Stream()  # warm the launch on a side stream, as graph capture wants
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(reps):
                    fn()
            return do_bench(gr.replay, warmup=25, rep=200, return_mode="median") / reps * 1e3, "graph"
        except Exception:  # noqa: BLE001 - e.g. a syncing torch op
            torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3, "events"


def rate(row: dict, nbytes: int, us: float, copy: float) -> dict:
    """``row`` with bytes, GB/s and the fraction of the copy bandwidth."""
    gbps = nbytes / (us * 1e-6) / 1e9
    return dict(row, bytes=nbytes, GBps=round(gbps, 1), copy_GBps=round(copy, 1), frac_of_copy=round(gbps / copy, 4))


def against(row: dict, kernel_us: float, other: str, other_us: float) -> dict:
    """``row`` with the kernel's time, another path's and the speedup over it."""
    return dict(row, us=round(kernel_us, 2), **{f"{other}_us": round(other_us, 2),
                                               f"speedup_vs_{other}": round(other_us / kernel_us, 3)})


# ---- norms, activations, the MLA prolog ----------------------------------------------------------------------------
@bench
def bench_copy(args, copy):
    yield {"GBps": round(copy, 1)}


@bench
def bench_rms_norm(args, copy):
    """The fused add + RMSNorm (reads x and the residual, writes y and the new residual)."""
    from . import rms_norm as m

    for hidden in (2048, 7168):
        for rows in (64, 128, 4096, 16384):
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            r, w = torch.randn_like(x), torch.rand(hidden, device="cuda").to(torch.bfloat16)
            y, ro = torch.empty_like(x), torch.empty_like(x)
            us, how = time_us(lambda: m.add_rms_norm(x, r, w, 1e-6, out=y, residual_out=ro))
            yield rate({"op": "add_rms_norm", "rows": rows, "hidden": hidden, "us": round(us, 2), "timing": how},
                       rows * hidden * 2 * 4 + hidden * 2, us, copy)


@bench
def bench_silu_mul(args, copy):
    from deepinfer_npu.backends.cpu.linear import silu_and_mul as torch_op

    from . import silu_mul as m

    for inter in (1408, 2048):
        for rows in (1, 6, 64, 128, 384, 4096, 16384):
            x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
            us, how = time_us(lambda: m.silu_and_mul(x, out=y))
            us_torch, _ = time_us(lambda: torch_op(x))
            yield rate(against({"rows": rows, "inter": inter, "timing": how}, us, "torch", us_torch),
                       rows * inter * 2 * 3, us, copy)


@bench
def bench_mla_rope_cache(args, copy):
    """The fused kv norm + two ropes + cache write against the composed path it replaces (rms_norm kernel, the
    reference ropes, the sync-free cache write)."""
    from deepinfer_npu.backends.cpu.rope import rope

    from . import mla_rope_cache as m
    from . import rms_norm

    def composed(inp):
        q, off, kv = inp["q"], inp["q_off"], inp["kv"]
        c_kv, k_pe = kv.split([m.KV_LORA, m.ROPE], dim=-1)
        q_rope = rope(q[:, :, off : off + m.ROPE], inp["positions"], inp["cos_sin_cache"], True)
        c = rms_norm.rms_norm(c_kv.contiguous(), inp["weight"], inp["eps"])
        k_rot = rope(k_pe.unsqueeze(1), inp["positions"], inp["cos_sin_cache"], True).squeeze(1)
        lat = torch.cat((c, k_rot), dim=-1)
        flat, slots = inp["kv_cache"].view(-1, m.HEAD_DIM), inp["slot_mapping"]
        valid = slots >= 0
        idx = torch.where(valid, slots, torch.zeros_like(slots))
        flat.index_copy_(0, idx, torch.where(valid.unsqueeze(-1), lat, flat[0].unsqueeze(0)))
        return q_rope

    for heads in (16, 128):
        for tokens in (1, 16, 64, 128, 256, 4096):
            inp = problems.rope_cache(tokens, heads, seed=123)
            out = torch.empty(tokens, heads, m.ROPE, dtype=torch.bfloat16, device="cuda")
            us, how = time_us(lambda: m.mla_rope_cache(**inp, interleaved=True, out=out))
            us_c, _ = time_us(lambda: composed(inp))
            nbytes = tokens * (m.HEAD_DIM * 2 * 2 + heads * m.ROPE * 2 * 2 + m.ROPE * 4 + 16) + m.KV_LORA * 2
            yield rate(against({"tokens": tokens, "heads": heads, "timing": how}, us, "composed", us_c), nbytes, us,
                       copy)


@bench
def bench_mla_absorb(args, copy):
    """W_UK of one token against cuBLAS' batched GEMM over the heads (the 2-16 MB of weights stay in L2 across the
    20 launches of a replay, for both paths)."""
    from . import mla_absorb as m

    for heads in (16, 128):
        q, w = problems.absorb(heads)
        out = torch.empty(1, heads, w.shape[2], dtype=torch.bfloat16, device="cuda")
        us, how = time_us(lambda: m.absorb_q(q, w, out=out))
        us_cublas, _ = time_us(lambda: torch.bmm(q[..., : w.shape[1]].transpose(0, 1), w))
        yield rate(against({"heads": heads, "nope": w.shape[1], "lrank": w.shape[2], "timing": how}, us, "cublas",
                           us_cublas), w.numel() * 2, us, copy)


# ---- MLA decode ----------------------------------------------------------------------------------------------------
def _mla_decode_row(batch, heads, seqlen_k, q_len, copy, num_splits=None, warp_specialized=False, kv_fp8=False,
                    **tuning):
    """One decode launch timed; bytes = the latent cache read once (FlashMLA's count) + q + out + lse + tables.
    kv_fp8: the cache packed into FP8 rows (FP8_ROW_BYTES a token) first."""
    from . import mla_decode as m

    inp = problems.mla_paged(batch, heads, seqlen_k, q_len, seed=100, spare_blocks=0)
    row_bytes = m.HEAD_DIM * 2
    if kv_fp8:
        from deepinfer_npu.model_executor.quantization.kv_fp8 import pack_fp8_latents

        kv = inp["kv_cache"]
        inp["kv_cache"] = pack_fp8_latents(kv.reshape(-1, m.HEAD_DIM).float(), m.KV_LORA).view(
            kv.shape[0], kv.shape[1], -1)
        row_bytes = m.FP8_ROW_BYTES
        del kv
    tq = batch * q_len
    out = torch.empty(tq, heads, m.KV_LORA, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(tq, heads, dtype=torch.float32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bq = m.bucket_q(q_len)
    splits = num_splits or m.default_num_splits(batch, heads, bq, -(-seqlen_k // m.PAGE), sms, kv_fp8)
    us, how = time_us(lambda: m.mla_decode(**inp, softmax_scale=m.HEAD_DIM**-0.5, max_seqlen_q=q_len,
                                           num_splits=splits, out=out, lse=lse, num_sms=sms,
                                           warp_specialized=warp_specialized, **tuning))
    ws = m.takes_warp_specialized(heads, bq, warp_specialized) and not kv_fp8
    block_m = tuning.get("block_m") or m.decode_block_m(heads, bq)
    threads = m._ws_module().THREADS if ws else tuning.get("threads") or (
        m.SMALL_THREADS if block_m < m.BLOCK_M else 256)
    nbytes = (batch * seqlen_k * row_bytes + tq * heads * (m.HEAD_DIM + m.KV_LORA) * 2 + tq * heads * 4
              + batch * -(-seqlen_k // m.PAGE) * 4)
    row = {"batch": batch, "seqlen_k": seqlen_k, "heads": heads, "q_len": q_len, "num_splits": splits,
           "num_stages": tuning.get("num_stages") or 2, "threads": threads, "block_m": block_m,
           "skip_empty_splits": bool(tuning.get("skip_empty_splits")),
           "kernel": "warp_specialized" if ws else "pipelined", "kv_cache_dtype": "fp8" if kv_fp8 else "bfloat16",
           "us": round(us, 2),
           "TFLOPs": round(2 * tq * heads * seqlen_k * (m.HEAD_DIM + m.KV_LORA) / (us * 1e-6) / 1e12, 1),
           "timing": how}
    return rate(row, nbytes, us, copy)


@bench
def bench_mla_decode(args, copy):
    """The issue's shapes (batch 64 / 128, context 4K / 8K, 16 and 128 heads, one query token) at the split
    heuristic, plus ``--splits`` / ``--block-m`` / ``--warp-specialized`` variants; ``--sweep-batch1``: batch-1
    latency over splits x stages x threads x tile rows at 16 heads (512 and 4096 keys)."""
    from . import mla_decode as m

    if args.sweep_batch1:
        # 32 splits: what a batch-1 decode graph gets from a wide table (the split count is capped by the table
        # width, not the context), so most of its CTAs hold no page at a 512-token context
        grid = [(s, st, th, bm, False) for s in (1, 3, 9, 32) for st in (1, 2) for th in (128, 256) for bm in (64, 16)]
        grid += [(s, 2, 256, bm, True) for s in (9, 32) for bm in (64, 16)]  # empty splits write / read nothing
        for ctx in (512, 4096):
            for s, st, th, bm, sk in grid:
                yield dict(_mla_decode_row(1, 16, ctx, 1, copy, s, num_stages=st, threads=th, block_m=bm,
                                           skip_empty_splits=sk), sweep="batch1")
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(b, h, s, q) for h in args.heads for b in args.batch for s in args.seqlen_k for q in args.q_len]
    cfgs = []
    for b, h, s, q in shapes:
        bq = m.bucket_q(q)
        splits = m.default_num_splits(b, h, bq, s // m.PAGE, sms)
        cfgs += [m.decode_config(h, bq, n) for n in [splits, *args.splits]]
        if args.kv_fp8:
            cfgs.append(m.decode_config(h, bq, m.default_num_splits(b, h, bq, s // m.PAGE, sms, True), kv_fp8=True))
        if args.warp_specialized:
            cfgs.append(m.decode_config(h, bq, splits, True))
    m.precompile(cfgs)
    for b, h, s, q in shapes:
        base = _mla_decode_row(b, h, s, q, copy)
        yield base
        if args.kv_fp8:  # the packed FP8 cache at the engine's split count, against the bf16 cache's time
            row = _mla_decode_row(b, h, s, q, copy, kv_fp8=True)
            yield dict(row, over_bf16_cache=round(base["us"] / row["us"], 3))
        for n in args.splits:
            yield _mla_decode_row(b, h, s, q, copy, n)
        for bm in args.block_m:  # tile variants at the engine's split count (compiled at first use)
            if bm != m.decode_block_m(h, m.bucket_q(q)) and bm >= m.SMALL_BLOCK_M and h * q <= 8 * bm:
                yield dict(_mla_decode_row(b, h, s, q, copy, block_m=bm), variant=f"block_m={bm}")
        if args.warp_specialized and m._ws_module().applies(h, m.bucket_q(q)):
            yield _mla_decode_row(b, h, s, q, copy, warp_specialized=True)


@bench
def bench_mla_decode_ws(args, copy):
    """The warp-specialized decode against the pipelined kernel in the same run: the issue's shapes where the tile
    has 64 rows, two query tokens at 128 heads and four at 16."""
    from . import mla_decode as m

    shapes = [(b, h, s, 1) for h in (16, 128) for b in (64, 128) for s in (4096, 8192)]
    for b, h, s, q in shapes + [(64, 128, 4096, 2), (64, 16, 4096, 4)]:
        if m._ws_module().applies(h, m.bucket_q(q)):
            base = _mla_decode_row(b, h, s, q, copy)
            row = _mla_decode_row(b, h, s, q, copy, warp_specialized=True)
            yield dict(row, pipelined_us=base["us"], speedup=round(base["us"] / row["us"], 3))


# ---- MoE and dense GEMMs -------------------------------------------------------------------------------------------
@bench
def bench_moe_gemm(args, copy):
    """V2-Lite expert GEMMs (bytes of the experts hit / time) at each tile width and pipeline depth, against
    torch._grouped_mm; the expert scan reported apart (once per MLP, both GEMMs)."""
    from . import moe_gemm as m

    for tokens in (1, 16, 64):
        for n, k, name in ((2816, 2048, "w13"), (2048, 1408, "w2")):
            a, w, counts = problems.expert_rows(tokens, 6, 64, n, k)
            hit = int((counts > 0).sum())
            nbytes = hit * n * k * 2 + a.numel() * 2 + a.shape[0] * n * 2
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            us_ref, _ = time_us(lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs))
            starts = m.expert_starts(counts)
            us_scan, _ = time_us(lambda: m.expert_starts(counts))
            for bn in (64, 128):
                for stages in (3, 4, 6):
                    o = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device="cuda")
                    us, how = time_us(lambda: m.moe_gemm(a, w, counts, out=o, block_n=bn, num_stages=stages,
                                                         starts=starts))
                    row = {"shape": "v2-lite-" + name, "tokens": tokens, "experts_hit": hit, "N": n, "K": k,
                           "block_n": bn, "stages": stages, "scan_us": round(us_scan, 2), "timing": how}
                    yield rate(against(row, us, "grouped_mm", us_ref), nbytes, us, copy)


@bench
def bench_moe_gemm_swap(args, copy):
    """V2-Lite experts at 1 / 2 / 4 / 8 tokens x top-6: w13 (SwiGLU fused) + w2 against moe_gemm + silu_mul; then
    batch decode sizes (``--swap-tokens``) at row tiles of 16 to 32 and 64, and moe_gemm with the SwiGLU fused
    (``"kernel": "moe_gemm_gated"``)."""
    from . import moe_gemm as mg
    from . import moe_gemm_swap as m
    from . import silu_mul

    mlp_bytes = 2 * (2816 * 2048 + 2048 * 1408)  # one expert's w13 + w2, bf16

    def problem(tokens):
        """(rows, w13, w2, counts, scan, h, o, moe_gemm + silu_mul's microseconds) for ``tokens`` x top-6."""
        a, w13, counts = problems.expert_rows(tokens, 6, 64, 2816, 2048, seed=1)
        _, w2, _ = problems.expert_rows(tokens, 6, 64, 2048, 1408, seed=2)
        starts = mg.expert_starts(counts)
        h = torch.empty(a.shape[0], 1408, dtype=torch.bfloat16, device="cuda")
        o = torch.empty(a.shape[0], 2048, dtype=torch.bfloat16, device="cuda")

        def unfused():
            mid = silu_mul.silu_and_mul(mg.moe_gemm(a, w13, counts, starts=starts))
            mg.moe_gemm(mid, w2, counts, out=o, starts=starts)

        return a, w13, w2, counts, starts, h, o, time_us(unfused)[0]

    for tokens in () if args.swap_wide_only else (1, 2, 4, 8):
        a, w13, w2, counts, starts, h, o, us_unfused = problem(tokens)
        hit = int((counts > 0).sum())
        for bn in (64, 128):
            for st in (3, 4, 6):
                def w13_only(bn=bn, st=st):
                    m.moe_gemm_swap(a, w13, starts, gated=True, out=h, block_n=bn, num_stages=st)

                def both(bn=bn, st=st):
                    w13_only(bn, st)
                    m.moe_gemm_swap(h, w2, starts, out=o, block_n=bn, num_stages=st)

                us, how = time_us(both)
                row = {"shape": "v2-lite-mlp", "tokens": tokens, "experts_hit": hit, "block_n": bn, "stages": st,
                       "w13_gated_us": round(time_us(w13_only)[0], 2), "timing": how}
                yield rate(against(row, us, "moe_gemm_silu_mul", us_unfused), hit * mlp_bytes, us, copy)
    # batch decode sizes (moe_gemm + silu_mul in the engine): one weight pass an expert when its rows fit the tile
    for tokens in args.swap_tokens:
        a, w13, w2, counts, starts, h, o, us_unfused = problem(tokens)
        hit, most = int((counts > 0).sum()), int(counts.max())
        for rt in m.ROWS_TILES[1:]:
            def fused(rt=rt):
                m.moe_gemm_swap(a, w13, starts, gated=True, out=h, rows_tile_=rt)
                m.moe_gemm_swap(h, w2, starts, out=o, rows_tile_=rt)

            us, how = time_us(fused)
            row = {"shape": "v2-lite-mlp", "tokens": tokens, "experts_hit": hit, "most_rows_an_expert": most,
                   "rows_tile": rt, "block_n": m.BLOCK_N, "stages": 4, "timing": how}
            yield rate(against(row, us, "moe_gemm_silu_mul", us_unfused), hit * mlp_bytes, us, copy)

        def gated_moe_gemm():  # the engine's path past moe_gemm_swap's rows: moe_gemm with the SwiGLU fused
            mg.moe_gemm(a, w13, counts, out=h, starts=starts, gated=True)
            mg.moe_gemm(h, w2, counts, out=o, starts=starts)

        us, how = time_us(gated_moe_gemm)
        row = {"shape": "v2-lite-mlp", "tokens": tokens, "experts_hit": hit, "most_rows_an_expert": most,
               "kernel": "moe_gemm_gated", "block_n": mg.pick_block_n(2816, 0, True), "stages": 3, "timing": how}
        yield rate(against(row, us, "moe_gemm_silu_mul", us_unfused), hit * mlp_bytes, us, copy)


@bench
def bench_skinny_gemm(args, copy):
    """V2-Lite decode GEMMs against the library path (F.linear [+ SwiGLU], moe_gemm for the grouped expert GEMMs),
    at the engine's (rows_per_warp, unroll) and the variants ``--variants`` names."""
    import torch.nn.functional as F

    from . import moe_gemm
    from . import skinny_gemm as m

    shapes = [("q_proj", 3072, 2048, False), ("kv_a", 576, 2048, False), ("o_proj", 2048, 2048, False),
              ("shared_gate_up", 5632, 2048, True), ("shared_down", 2048, 2816, False),
              ("dense_gate_up", 21888, 2048, True), ("dense_down", 2048, 10944, False),
              ("lm_head", 102400, 2048, False)]
    variants = [tuple(int(x) for x in v.split(",")) for v in args.variants]  # (rows_per_warp, unroll[, col_iters])

    def cfg(k, m_rows, gated, grouped, v):
        return m.config_for(k, m_rows, gated, grouped, "bfloat16", "bfloat16", "bfloat16")[:7] + v

    m.precompile([cfg(k, rows, g, False, v) for rows in (1, 6) for _name, _n, k, g in shapes for v in variants]
                 + [cfg(k, r, g, True, v) for r in (1, 2) for k, g in ((2048, True), (1408, False)) for v in variants])
    for rows in (1, 6, 16):
        for name, n, k, gated in shapes:
            a, w = problems.dense_rows(rows, n, k)
            nbytes = w.numel() * 2 + a.numel() * 2 + rows * (n // 2 if gated else n) * 2

            def lib(a=a, w=w, g=gated):
                h = F.linear(a, w)
                return F.silu(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2 :] if g else h

            us_lib, _ = time_us(lib)
            base = {"shape": name, "rows": rows, "N": n, "K": k, "gated": gated}
            if rows > m.MAX_ROWS:
                yield rate(dict(base, library_us=round(us_lib, 2)), nbytes, us_lib, copy)
                continue
            for v in variants:
                kern = m.get_kernel(*cfg(k, rows, gated, False, v))
                o = torch.empty(rows, n // 2 if gated else n, dtype=torch.bfloat16, device="cuda")
                us, how = time_us(lambda kern=kern, a=a, w=w, o=o: kern(a, w, o))
                row = dict(base, rows_per_warp=v[0], unroll=v[1], col_iters=v[2] if len(v) > 2 else 1, timing=how)
                yield rate(against(row, us, "library", us_lib), nbytes, us, copy)
    for tokens in (1, 2, 4):
        for name, n, k, gated in (("expert_w13", 2816, 2048, True), ("expert_w2", 2048, 1408, False)):
            a, w, counts = problems.expert_rows(tokens, 6, 64, n, k)
            scan = moe_gemm.expert_starts(counts)
            hit = int((counts > 0).sum())
            nbytes = hit * n * k * 2 + a.numel() * 2 + a.shape[0] * (n // 2 if gated else n) * 2
            us_mg, _ = time_us(lambda a=a, w=w, c=counts, s=scan: moe_gemm.moe_gemm(a, w, c, starts=s))
            for v in variants:
                kern = m.get_kernel(*cfg(k, min(a.shape[0], 2), gated, True, v))
                o = torch.empty(a.shape[0], n // 2 if gated else n, dtype=torch.bfloat16, device="cuda")
                us, how = time_us(lambda kern=kern, a=a, w=w, s=scan, o=o: kern(a, w, s, o))
                row = {"shape": name, "tokens": tokens, "rows": a.shape[0], "experts_hit": hit, "N": n, "K": k,
                       "gated": gated, "rows_per_warp": v[0], "unroll": v[1], "col_iters": v[2] if len(v) > 2 else 1,
                       "timing": how}
                yield rate(against(row, us, "moe_gemm", us_mg), nbytes, us, copy)


@bench
def bench_moe_routing(args, copy):
    """Gating, permute and unpermute against the torch composition they replace (V2-Lite, V3), and the fused route
    against gating + permute with the expert scan."""
    from deepinfer_npu.backends.cpu import moe as ref

    from . import moe_routing as m

    for name in ("v2lite", "v3"):
        params, d = problems.GATINGS[name], problems.HIDDEN[name]
        e, k = params.num_experts, params.top_k
        for t in (1, 64, 256, 1024):
            logits = torch.randn(t, e, device="cuda")
            bias = torch.randn(e, device="cuda") * 0.1 if params.topk_method == "noaux_tc" else None
            hidden = torch.randn(t, d, device="cuda").to(torch.bfloat16)
            w, ids = m.gating_topk(logits, bias, params)
            sh, counts, order = m.permute(hidden, ids, e)
            state = ref.DispatchState(order=order, num_tokens=t, top_k=k)
            for op, kern, torch_path in (
                ("gating", lambda: m.gating_topk(logits, bias, params),
                 lambda: ref.moe_gating_topk(logits, bias, params)),
                ("permute", lambda: m.permute(hidden, ids, e), lambda: ref.moe_dispatch(hidden, ids, e)),
                ("unpermute", lambda: m.unpermute(sh, order, w, t, k), lambda: ref.moe_combine(sh, state, w)),
            ):
                us, how = time_us(kern)
                us_torch, how_torch = time_us(torch_path)
                yield against({"op": op, "model": name, "T": t, "E": e, "k": k, "D": d, "timing": how,
                               "timing_torch": how_torch}, us, "torch", us_torch)
        for t in (1, 4, 16):
            logits = torch.randn(t, e, device="cuda")
            bias = torch.randn(e, device="cuda") * 0.1 if params.topk_method == "noaux_tc" else None
            hidden = torch.randn(t, d, device="cuda").to(torch.bfloat16)

            def two():
                w, ids = m.gating_topk(logits, bias, params)
                return w, ids, *m.permute(hidden, ids, e, with_scan=True)

            us, how = time_us(lambda: m.route(logits, bias, params, hidden, e))
            yield against({"op": "route", "model": name, "T": t, "E": e, "k": k, "D": d, "timing": how}, us,
                          "gating_permute", time_us(two)[0])


# ---- step inputs, verification, ZOS ----------------------------------------------------------------------------------
@bench
def bench_decode_inputs(args, copy):
    from deepinfer_npu.backends.cpu.step_inputs import decode_inputs as ref

    from . import decode_inputs as m

    for rows, q, k in ((1, 1, 1), (1, 4, 3), (64, 1, 3), (64, 4, 3), (256, 4, 3), (1024, 4, 3)):
        step, bs, t = problems.decode_step(rows, q, q, k, seed=1)
        us, how = time_us(lambda: m.decode_inputs(*step, bs, t))
        us_ref, how_ref = time_us(lambda: ref(*step, bs, t))
        yield against({"rows": rows, "q": q, "k": k, "tokens": t, "timing": how, "timing_ref": how_ref}, us,
                      "reference", us_ref)


@bench
def bench_spec_verify(args, copy):
    from deepinfer_npu.backends.cpu.spec_verify import spec_verify as ref

    from . import _argmax
    from . import spec_verify as m

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(b, q, v, 1.0) for v in (102400, 129280) for b, q in ((1, 1), (1, 4), (16, 4), (64, 1), (64, 2),
                                                                      (64, 4), (256, 4))]
    for rows, q, v, greedy_frac in shapes + [(b, 1, 129280, 0.0) for b in (1, 64, 256)]:
        step = problems.verify_step(rows, q, v, layout="full", seed=1)
        n = step["logits"].shape[0]
        t = problems.sampling(n, greedy_frac, seed=1)
        us, how = time_us(lambda: m.spec_verify(**step, t=t))
        us_ref, how_ref = time_us(lambda: ref(**step, t=t))
        row = {"rows": rows, "q": q, "T": n, "V": v, "greedy_frac": greedy_frac,
               "splits": _argmax.num_splits(n, v, sms, greedy_frac < 1.0), "timing": how, "timing_ref": how_ref,
               "torch_argmax_us": round(time_us(lambda: step["logits"].argmax(-1))[0], 2)}
        yield rate(against(row, us, "reference", us_ref), n * v * 4, us, copy)


@bench
def bench_zos_fixup(args, copy):
    from deepinfer_npu.backends.cpu.zos import zos_fixup as ref

    from . import zos_fixup as m

    for resplit in (False, True):
        for rows, k in ((1, 3), (16, 3), (64, 3), (256, 3), (1024, 3), (64, 8)):
            step = problems.zos_step(rows, k, resplit, "conf", 0.9, seed=1)
            us, how = time_us(lambda: m.zos_fixup(*step))
            us_ref, how_ref = time_us(lambda: ref(*step))
            yield against({"rows": rows, "k": k, "resplit": resplit, "timing": how, "timing_ref": how_ref}, us,
                          "reference", us_ref)


# ---- FP8 (DeepGEMM's numerics) ------------------------------------------------------------------------------------
#: dense (N, K): DeepGEMM's published V3 set, then V2-Lite's projections (q_proj, kv_a_proj, o_proj)
FP8_DENSE_SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048),
                    (3072, 2048), (576, 2048), (2048, 2048),
                    (3648, 2048), (5632, 2048), (2048, 2816)]  # V2-Lite's q + kv_a, shared experts' w13 and w2
#: grouped contiguous prefill (experts, rows an expert, N, K): DeepGEMM's published set
FP8_GROUPED_PREFILL = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (8, 4096, 7168, 2048)]
#: grouped decode (name, experts, top_k, D, I)
FP8_GROUPED_DECODE = [("v2-lite", 64, 6, 2048, 1408), ("v3", 256, 8, 7168, 2048)]


def fp8_operands(m: int, n: int, k: int, experts: int | None = None):
    """Random e4m3 operands with their scales: a [m, k] (1 x 128 groups), w [(experts,) n, k] (128 x 128 blocks)."""
    from deepinfer_npu.model_executor.quantization.fp8 import quantize_per_token_group

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    aq, sa = quantize_per_token_group(a)
    lead = () if experts is None else (experts,)
    wq = (torch.randn(*lead, n, k, device="cuda", dtype=torch.bfloat16) * 16).to(torch.float8_e4m3fn)
    sw = torch.rand(*lead, -(-n // 128), -(-k // 128), device="cuda") * 1e-3 + 1e-4
    return a, aq, sa, wq, sw


def scaled_mm_blockwise(aq, sa, wq, sw):
    """``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales (cuBLASLt, CUDA >= 12.9): ->
    (callable, None), or (None, the error of every scale layout tried)."""
    scale_a = sa.t().contiguous().t()  # [M, K/128], M-major, as ScaledBlas.cpp checks it
    kb = sw.shape[1]
    padded = torch.zeros(sw.shape[0], -(-kb // 4) * 4, device=sw.device)  # newer torch: K/128 padded to 4
    padded[:, :kb] = sw
    errors = []
    for scale_b in (sw.t(), padded[:, :kb].t()):
        def fn(scale_b=scale_b):
            return torch._scaled_mm(aq, wq.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        try:
            fn()
            torch.cuda.synchronize()
            return fn, None
        except Exception as e:  # noqa: BLE001 - reported in the row
            errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
    return None, "; ".join(errors)


def _compile_one(module: str, cfg) -> None:
    importlib.import_module(f"deepinfer_npu.kernels_cuda.{module}").precompile([cfg])


def precompile_in_processes(jobs: list[tuple[str, object]]) -> None:
    """Compile ``(kernels_cuda module, precompile item)`` jobs in worker processes (TileLang's lowering holds the
    GIL, so threads build one kernel at a time); the workers fill TileLang's disk cache, from which each module's own
    ``precompile`` then loads them without recompiling. Also used by the FP8 kernel tests."""
    jobs = list(dict.fromkeys(jobs))
    if not jobs:
        return
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) // 2, 16))
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        for fut in [ex.submit(_compile_one, module, cfg) for module, cfg in jobs]:
            fut.result()
    for module in dict.fromkeys(module for module, _cfg in jobs):
        importlib.import_module(f"deepinfer_npu.kernels_cuda.{module}").precompile(
            [cfg for mod, cfg in jobs if mod == module])


def tflops(m: int, n: int, k: int, us: float) -> float:
    return round(2 * m * n * k / (us * 1e-6) / 1e12, 1)


@bench
def bench_fp8_quant(args, copy):
    """The per-token-group quantisation (plain and with the SwiGLU fused) against the torch composition."""
    from deepinfer_npu.model_executor.quantization.fp8 import quantize_per_token_group

    from . import fp8_quant as m

    for rows in (1, 64, 4096):
        for k, gated in ((2048, False), (7168, False), (1408, True), (2048, True)):
            x = torch.randn(rows, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
            us, how = time_us(lambda: m.quantize(x, gated=gated))

            def composed():
                src = x
                if gated:
                    g, u = x.chunk(2, dim=-1)
                    src = torch.nn.functional.silu(g) * u
                return quantize_per_token_group(src)

            us_ref, _ = time_us(composed)
            row = {"rows": rows, "K": k, "gated": gated, "timing": how}
            yield rate(against(row, us, "torch", us_ref), x.numel() * 2 + rows * k * (1 + 4 / 128), us, copy)


def fp8_gemm_variants(m, n: int, k: int, rows: int) -> list[tuple[str, tuple]]:
    """Configurations ``--fp8-sweep`` times beside the heuristic's: tile shapes and pipeline depths at prefill
    rows; at decode rows K slicing off and doubled, and the heuristic's own with the promotion reading its scales
    from global memory (``staged_scales=False``)."""
    if rows > m.SWAP_MAX_ROWS:
        bn = 128 if n % 128 == 0 else 64
        return [("tile", (n, k, 128, bn, 3)), ("tile", (n, k, 128, bn, 6)), ("tile", (n, k, 64, bn, 4, 128)),
                ("tile", (n, k, 128, 64, 4))]
    rt, split = m.rows_tile(rows), m.split_for(n, k)
    kb = -(-k // m.BLOCK_K)
    alts = [("swap", (n, k, rt, 1))] + ([("swap", (n, k, rt, 2 * split))] if kb % (2 * split) == 0 else [])
    return [c for c in alts if c[1][3] != split] + [("swap", (n, k, rt, split, 64, 4, 128, False))]


def grouped_decode_variants(base: tuple) -> list[tuple]:
    """Swapped grouped-GEMM configurations ``--fp8-sweep`` times beside the heuristic's ``base``: 8 / 16 token rows
    a tile, 64 / 128 weight rows a CTA, pipelines 4 / 6 / 8 deep, and the heuristic's own with its scales staged in
    shared memory."""
    n, k, swap, *_ = base
    if not swap:
        return []
    cfgs = [(n, k, True, r, bn, st) for r in (8, 16) for bn in (64, 128) for st in (4, 6, 8) if n % bn == 0]
    return [c for c in cfgs if c != tuple(base)] + [(*base, True)]  # base: config_for's full swapped tuple


@bench
def bench_fp8_gemm(args, copy):
    """Dense FP8 GEMM TFLOP/s: DeepGEMM's V3 shapes at M = 4096 and decode rows, V2-Lite's projections at decode
    rows; the kernel alone and with the activation quantisation (what ``fp8_linear`` costs), against
    ``torch._scaled_mm`` with block scales (cuBLASLt; "unsupported" with the error where torch refuses them) and
    the bf16 ``torch.matmul`` of the same shape. Decode rows also report the weight bytes / time. ``--fp8-sweep``:
    other configurations too (rows with ``variant``), for tuning the heuristic."""
    from . import fp8_gemm as m
    from . import fp8_quant

    cases = [(n, k, rows) for n, k in FP8_DENSE_SHAPES for rows in args.fp8_rows if n != 576 or rows <= 64]
    precompile_in_processes([("fp8_gemm", c) for n, k, rows in cases for c in m.configs_for(n, k, rows)
                             + (fp8_gemm_variants(m, n, k, rows) if args.fp8_sweep else [])]
                            + [("fp8_quant", fp8_quant.config_for(k, rows)) for _n, k, rows in cases])
    for n, k, rows in cases:
        a, aq, sa, wq, sw = fp8_operands(rows, n, k)
        out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
        us, how = time_us(lambda: m.fp8_gemm(aq, sa, wq, sw, out=out))
        us_linear, _ = time_us(lambda: m.fp8_gemm(*fp8_quant.quantize(a), wq, sw, out=out))
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        us_bf16, _ = time_us(lambda: torch.matmul(a, w_bf16.t()))
        row = {"M": rows, "N": n, "K": k, "config": m.configs_for(n, k, rows)[0], "timing": how,
               "TFLOPs": tflops(rows, n, k, us), "with_quant_us": round(us_linear, 2),
               "with_quant_TFLOPs": tflops(rows, n, k, us_linear),
               "bf16_matmul_TFLOPs": tflops(rows, n, k, us_bf16)}
        row = against(row, us, "bf16_matmul", us_bf16)
        fn, why = scaled_mm_blockwise(aq, sa, wq, sw)
        if fn is None:
            row["scaled_mm"] = f"unsupported: {why}"
        else:
            us_sm, _ = time_us(fn)
            cos = torch.nn.functional.cosine_similarity(fn().float().flatten(), out.float().flatten(), dim=0)
            row.update(scaled_mm_us=round(us_sm, 2), scaled_mm_TFLOPs=tflops(rows, n, k, us_sm),
                       speedup_vs_scaled_mm=round(us_sm / us, 3), scaled_mm_cos=round(cos.item(), 5))
        nbytes = n * k + rows * k + rows * n * 2
        yield rate(row, nbytes, us, copy) if rows <= m.SWAP_MAX_ROWS else row
        for cfg in fp8_gemm_variants(m, n, k, rows) if args.fp8_sweep else ():
            us_v, how_v = time_us(lambda cfg=cfg: m.fp8_gemm(aq, sa, wq, sw, out=out, config=cfg))
            vrow = {"M": rows, "N": n, "K": k, "variant": cfg, "timing": how_v, "us": round(us_v, 2),
                    "TFLOPs": tflops(rows, n, k, us_v), "vs_heuristic": round(us / us_v, 3)}
            yield rate(vrow, nbytes, us_v, copy) if rows <= m.SWAP_MAX_ROWS else vrow
        del a, aq, sa, wq, sw, w_bf16, out


@bench
def bench_fp8_grouped_gemm(args, copy):
    """Grouped FP8 GEMM over rows sorted by expert: DeepGEMM's contiguous prefill set (TFLOP/s) against the bf16
    ``torch._grouped_mm``, and decode of the V2-Lite / V3 experts (1 / 16 / 64 tokens, random top-k; the weight
    bytes of the hit experts / time) with the whole FP8 MLP (quant, w13, gated quant, w2) beside it."""
    from . import fp8_grouped_gemm as m
    from . import fp8_quant
    from . import moe_gemm

    decode = [(e, top_k, d, inter, t * top_k) for _name, e, top_k, d, inter in FP8_GROUPED_DECODE for t in (1, 16, 64)]
    grouped = [m.config_for(n, k, e * per, e) for e, per, n, k in FP8_GROUPED_PREFILL]
    grouped += [m.config_for(n, k, rows, e) for e, _t, d, inter, rows in decode
                for n, k in ((2 * inter, d), (d, inter))]
    if args.fp8_sweep:
        grouped += [c for e, _t, d, inter, rows in decode for c in grouped_decode_variants(
            m.config_for(2 * inter, d, rows, e))]
    quant = [c for _e, _t, d, inter, rows in decode
             for c in (fp8_quant.config_for(d, rows), fp8_quant.config_for(inter, rows, True))]
    precompile_in_processes([("fp8_grouped_gemm", c) for c in grouped] + [("fp8_quant", c) for c in quant])
    for experts, per, n, k in FP8_GROUPED_PREFILL:
        counts = torch.full((experts,), per, dtype=torch.int64, device="cuda")
        rows = experts * per
        a, aq, sa, wq, sw = fp8_operands(rows, n, k, experts)
        starts = moe_gemm.expert_starts(counts)
        out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
        us, how = time_us(lambda: m.fp8_grouped_gemm(aq, sa, wq, sw, starts, out=out))
        w_bf16 = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        us_bf16, _ = time_us(lambda: torch._grouped_mm(a, w_bf16.transpose(1, 2), offs=offs))
        row = {"layout": "contiguous", "experts": experts, "rows_per_expert": per, "N": n, "K": k,
               "config": list(m.config_for(n, k, rows, experts)), "timing": how, "TFLOPs": tflops(rows, n, k, us),
               "bf16_grouped_mm_TFLOPs": tflops(rows, n, k, us_bf16)}
        yield against(row, us, "bf16_grouped_mm", us_bf16)
        del a, aq, sa, wq, sw, w_bf16, out

    for name, experts, top_k, d, inter in FP8_GROUPED_DECODE:
        _, _, _, w13, s13 = fp8_operands(1, 2 * inter, d, experts)
        _, _, _, w2, s2 = fp8_operands(1, d, inter, experts)
        for tokens in (1, 16, 64):
            ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
            counts = torch.bincount(ids.flatten(), minlength=experts)
            hit, rows = int((counts > 0).sum()), tokens * top_k
            hidden = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
            starts = moe_gemm.expert_starts(counts)
            aq, sa = fp8_quant.quantize(hidden)
            us13, how = time_us(lambda: m.fp8_grouped_gemm(aq, sa, w13, s13, starts))

            def mlp():
                h = m.fp8_grouped_gemm(*fp8_quant.quantize(hidden), w13, s13, starts)
                return m.fp8_grouped_gemm(*fp8_quant.quantize(h, gated=True), w2, s2, starts)

            us_mlp, _ = time_us(mlp)
            nbytes = hit * (2 * inter * d + d * inter)
            row = {"layout": "decode", "model": name, "tokens": tokens, "experts_hit": hit,
                   "max_rows_an_expert": int(counts.max()),
                   "config_w13": list(m.config_for(2 * inter, d, rows, experts)), "timing": how,
                   "w13_us": round(us13, 2), "mlp_us": round(us_mlp, 2)}
            yield rate(row, nbytes, us_mlp, copy)
            variants = grouped_decode_variants(m.config_for(2 * inter, d, rows, experts)) if args.fp8_sweep else []
            for cfg in variants:  # w13 alone, as w13_us
                us_v, how_v = time_us(lambda cfg=cfg: m.fp8_grouped_gemm(aq, sa, w13, s13, starts, config=cfg))
                vrow = {"layout": "decode", "model": name, "tokens": tokens, "weight": "w13", "variant": list(cfg),
                        "timing": how_v, "us": round(us_v, 2), "vs_heuristic": round(us13 / us_v, 3)}
                yield rate(vrow, hit * 2 * inter * d, us_v, copy)
        del w13, s13, w2, s2


@bench
def bench_fp8_skinny_gemm(args, copy):
    """One-row FP8 projections: ``fp8_skinny_gemm`` (the quantisation inside the kernel, one launch) at the rule's
    columns a warp and at each other count, against the two-kernel path it replaces at one row (``fp8_quant`` +
    ``fp8_gemm``; gated: the gated quantisation of the next projection is not counted), on the V3 / V2-Lite dense
    shapes, V2-Lite's fused q / kv_a projection and shared experts' down, and two gated gate/up; weight bytes /
    time. The backend routes weights of at most ``ops/quant.py``'s SKINNY_MAX_WEIGHTS values to it."""
    from . import fp8_gemm, fp8_quant
    from . import fp8_skinny_gemm as m

    dense = [(n, k, False) for n, k in (*FP8_DENSE_SHAPES, (3648, 2048), (2048, 2816)) if m.supported(k)]
    dense += [(2 * 1408 * 2, 2048, True), (2 * 2048, 7168, True)]
    precompile_in_processes(
        [("fp8_skinny_gemm", m.config_for(k, 1, gated, rows_per_warp=r)) for _n, k, gated in dense
         for r in m.ROWS_PER_WARP]
        + [("fp8_gemm", c) for n, k, _g in dense for c in fp8_gemm.configs_for(n, k, 1)]
        + [("fp8_quant", fp8_quant.config_for(k, 1)) for _n, k, _g in dense])
    for n, k, gated in dense:
        a, _aq, _sa, wq, sw = fp8_operands(1, n, k)
        rule = m.rows_per_warp_for(n // 2 if gated else n, gated)
        variants = {r: time_us(lambda: m.fp8_skinny_gemm(a, wq, sw, gated=gated, rows_per_warp=r))
                    for r in m.ROWS_PER_WARP}
        us, how = variants[rule]
        us_two, _ = time_us(lambda: fp8_gemm.fp8_gemm(*fp8_quant.quantize(a), wq, sw))
        row = {"M": 1, "N": n, "K": k, "weights_M": round(n * k / 2**20, 2), "gated": gated, "rows_per_warp": rule,
               "us_by_rows_per_warp": {r: round(t, 2) for r, (t, _h) in variants.items()}, "timing": how}
        yield rate(against(row, us, "quant_plus_fp8_gemm", us_two), n * k, us, copy)
        del a, wq, sw

# ---- command line --------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", choices=[*BENCHES, "all"], help="the kernel to time")
    ap.add_argument("--out", help="also append the rows to this JSONL file")
    mla = ap.add_argument_group("mla_decode")
    mla.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    mla.add_argument("--seqlen-k", type=int, nargs="+", default=[4096, 8192])
    mla.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    mla.add_argument("--q-len", type=int, nargs="+", default=[1])
    mla.add_argument("--splits", type=int, nargs="*", default=[], help="also these fixed split counts")
    mla.add_argument("--block-m", type=int, nargs="*", default=[],
                     help="also these CTA row tiles (16: mma.sync tile at 128 threads; 64: wgmma tile at 256)")
    mla.add_argument("--warp-specialized", action="store_true", help="also mla_decode_ws' kernel (64-row tiles)")
    mla.add_argument("--kv-fp8", action="store_true", help="also the packed FP8 cache (kv_cache_dtype='fp8')")
    mla.add_argument("--sweep-batch1", action="store_true", help="batch-1 latency: splits x stages x threads x rows")
    sw = ap.add_argument_group("moe_gemm_swap")
    sw.add_argument("--swap-tokens", type=int, nargs="*", default=[16, 32, 64, 128, 200, 256],
                    help="batch decode sizes (tokens x top-6 rows) timed at row tiles of 16 to 64")
    sw.add_argument("--swap-wide-only", action="store_true", help="only those, not the 1-8 token block sweep")
    sk = ap.add_argument_group("skinny_gemm")
    sk.add_argument("--variants", nargs="+", default=["1,4", "2,4", "1,8", "2,8", "1,4,4"],
                    help="rows_per_warp,unroll[,col_iters] (the engine's: 1,4)")
    fp8 = ap.add_argument_group("fp8_gemm")
    fp8.add_argument("--fp8-sweep", action="store_true", help="also other tile / K-slice configurations")
    fp8.add_argument("--fp8-rows", type=int, nargs="+", default=[1, 16, 64, 4096],
                     help="fp8_gemm's row counts (kv_a_proj's N = 576 only up to 64)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    meta = row_meta("cuda")
    copy = copy_gbps()
    for name in BENCHES if args.name == "all" else [args.name]:
        for row in BENCHES[name](args, copy):
            line = json.dumps({"bench": name, **row, **meta})
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
