"""Paged MLA decode (absorbed), warp-specialized by hand for Hopper, in TileLang.

Same op, layout and launch contract as ``mla_decode.py`` (FlashMLA layout: 576 values a token, pages of 64; query
tokens x heads folded into 64-row tiles; split-KV with the shared combine kernel); ``mla_decode.mla_decode`` takes
this kernel with ``warp_specialized=True`` where the tile has 64 rows (``applies``).

Why a second kernel: at 128 heads the decode is tensor-core bound (kernels_cuda/NOTES.md, the table at the top), and
the pipelined kernel ran its wgmma at ~380-400 TFLOP/s (0.39 of copy, H200): in each 64-key tile its two consumer
warpgroups compute QK^T half each, then exchange row maxima and sums through shared memory and named barriers, then
PV, all in lockstep, so the tensor cores idle through the softmax. Here (FlashMLA's split of the work, as in
TileLang's ``examples/deepseek_mla/example_mla_decode_ws.py``), 384 threads:

- warpgroup 0 (240 registers): QK^T of the whole 64 x 64 tile (three async wgmma, one wait), the mask and the
  softmax without any cross-warpgroup reduction, P to shared memory, P @ V[:, :256];
- warpgroup 1 (168 registers): P @ V[:, 256:] of tile k while warpgroup 0 already runs QK^T of tile k + 1;
- warpgroup 2 (producer, 80 registers): TMA loads of Q once and of each page (through the block table) into a
  ``num_stages`` ring of shared-memory slots.

mbarriers: ``ready[s]`` (TMA bytes + the producer's 128 arrivals), ``free[s]`` (both consumers done with slot s),
``s_ready`` / ``s_free`` (P and the rescale factors handed from warpgroup 0 to 1, and back), ``done`` (warpgroup 0's
final row sums, which warpgroup 1 needs to normalize its half). A tile index k uses slot k % num_stages in round
k // num_stages; waits take the parity of the round (or of k for the per-tile barriers).

Measured on an H200 (session 8, graph replays; kernels_cuda/NOTES.md): ``--check`` 15 cases PASS (<= 1.67 bf16 ulp);
128 heads at batch 64 / 128 x 4K / 8K: 0.466-0.474 of the copy bandwidth, 450-475 TFLOP/s, 1.17-1.22x the pipelined
kernel; 16 heads with 4 query tokens 1.26x. ``--diagnose`` (B=64, 4K): 129.5 us without KV loads, 150.3 with them,
so the warpgroups' own work (2.0 us a 64-key tile against 1.49 us of tensor-core time at 790 TFLOP/s) is the bound.

Two schedules (``SCHEDULE``, ``DEEPINFER_CUDA_MLA_SCHEDULE``): "ws", the one above, and "seesaw",
``mla_decode_seesaw.py``'s (FlashMLA's), the default since session 9: ``--check`` 17 cases PASS (<= 1.67 bf16 ulp),
128 heads at batch 64 / 128 x 4K / 8K 148.2 / 293.6 / 298.3 / 561.7 us = 0.496-0.519 of copy (ws in the same run:
161.7 / 315.9 / 315.1 / 627.5), 2 query tokens 265.4 against 297.6, 16 heads x 4 tokens 98.2 against 97.5 (session 9,
call 5). The engine takes this module's ``SCHEDULE`` for every 64-row decode tile on a Hopper
(``backends/cuda/kernels.py``, ``is_sm90``).

Run alone:  python kernels_cuda/mla_decode_ws.py --check --bench [--diagnose]   (GPU; --compile-only without one)
"""

import argparse
import functools
import json
import os
import sys
import time

import torch

try:  # tilelang is optional at import time so that the module imports without it
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover - exercised where tilelang is absent
    tilelang = None
    T = None

try:
    from . import mla_decode as md
    from . import mla_decode_seesaw as seesaw
    from ._ast_guard import compile_pool
    from ._pdl import pdl_enabled
except ImportError:  # run as a script: python kernels_cuda/mla_decode_ws.py
    import mla_decode as md
    import mla_decode_seesaw as seesaw
    from _ast_guard import compile_pool
    from _pdl import pdl_enabled

THREADS = 384  # two consumer warpgroups and one producer
#: "ws": this file's schedule (above). "seesaw": ``mla_decode_seesaw.py`` (FlashMLA's schedule: both warpgroups
#: compute QK^T and softmax of alternate tiles and half of every P @ V; 256 threads, loads issued per slot half),
#: the default since session 9 (H200, B=64 H=128 4K: 140-148 us against 152-162; kernels_cuda/NOTES.md).
#: ``DEEPINFER_CUDA_MLA_SCHEDULE=ws`` keeps the first one (A/B runs).
SCHEDULES = ("ws", "seesaw")


def _schedule_from_env() -> str:
    name = os.environ.get("DEEPINFER_CUDA_MLA_SCHEDULE", "seesaw").strip() or "seesaw"
    if name not in SCHEDULES:
        raise ValueError(f"DEEPINFER_CUDA_MLA_SCHEDULE={name!r}: one of {', '.join(SCHEDULES)}")
    return name


SCHEDULE = _schedule_from_env()


def threads(schedule: str | None = None) -> int:
    """Threads a CTA of the given (default: ``SCHEDULE``) schedule."""
    return seesaw.THREADS if (schedule or SCHEDULE) == "seesaw" else THREADS


#: True: warpgroup 0 runs tile j's softmax while both halves of P @ V of tile j - 1 are in flight. False (the
#: default): QK^T, softmax and a synchronous PV in sequence. On an H200 (session 8, --diagnose, B=64 H=128 4K, call 7)
#: the overlap without KV loads takes 115.9 us (630 TFLOP/s) against 128.7, but 148.8 with every tile re-reading one
#: page (L2) and 181.2 with the real pages, against 135.8 / 154.9: the PV of tile j - 1 ends during step j, so its
#: slot is released later and the load of tile j + 1 (two slots of 72 KB fit next to Q) lands too late.
OVERLAP_SOFTMAX = False
#: L2 prefetch distance in tiles (``build_mla_decode_ws``'s ``prefetch_tiles``). 0: on an H200 (session 8, call 7,
#: B=64 H=128 4K) 4 tiles ahead made the real-pages time longer, 169.8 against 154.9 us (181.2 -> 184.9 overlapped)
PREFETCH_TILES = 0
PAGE_BYTES = md.PAGE * md.HEAD_DIM * 2  # one page of the latent cache, contiguous: one bulk prefetch
L2_PREFETCH_SOURCE = r"""
__device__ __forceinline__ void di_prefetch_l2(const void* ptr, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(ptr), "r"(bytes) : "memory");
}
"""
REGS_SOFTMAX_WG, REGS_PV_WG, REGS_PRODUCER = 240, 168, 80  # setmaxnreg; 128 x (240 + 168 + 80) <= 64K registers


#: why this kernel is off in this process (a failed compile at warm-up: ``mla_decode.precompile``); None: usable
disabled_reason: str | None = None


def disable(reason: str) -> None:
    """Turn the kernel off for this process: ``mla_decode.mla_decode`` then runs the pipelined 64-row kernel."""
    global disabled_reason
    disabled_reason = reason


def applies(heads: int, q_bucket: int) -> bool:
    """The engine's tile for this step has 64 rows (the 16-row mma.sync tile has no warpgroups to specialize)."""
    return md.decode_block_m(heads, q_bucket) == md.BLOCK_M


# ----------------------------------------------------------------------------------------------------
# factory
# ----------------------------------------------------------------------------------------------------
def build_mla_decode_ws(
    heads: int,
    m_tiles: int,
    num_splits: int,
    softmax_scale: float,
    num_stages: int = 2,
    overlap: bool | None = None,
    load_kv: bool = True,
    prefetch_tiles: int | None = None,
    schedule: str | None = None,
):
    """Return the TileLang PrimFunc (not compiled). Arguments as ``mla_decode.build_mla_decode``; Q and Q_pe are
    passed as their [T * H, D] row views (one TMA box loads a CTA's 64 folded rows; rows past the tensor read as
    zeros, rows of the next request are computed and never stored). ``overlap``: the softmax-overlapping schedule
    of warpgroup 0 (``OVERLAP_SOFTMAX``). ``load_kv=False`` is a measurement switch only (``--diagnose``): the
    producer signals each slot without loading it, so the time is the warpgroups' compute and hand-offs alone.
    ``prefetch_tiles``: the producer asks for the page ``prefetch_tiles`` tiles ahead to be brought into L2
    (``cp.async.bulk.prefetch.L2``, one instruction a page), so that the slot's TMA load, which can only start once
    the slot is free, reads L2 instead of HBM; 0: no prefetch (``PREFETCH_TILES``). ``schedule``: ``SCHEDULE`` when
    None; "seesaw" builds ``mla_decode_seesaw``'s kernel (two slots, no overlap or prefetch switches). Switches left
    None take the schedule's defaults (``schedule_switches``)."""
    assert tilelang is not None, "tilelang is not installed"
    assert (schedule or SCHEDULE) in SCHEDULES, f"schedule {schedule!r}: one of {SCHEDULES}"
    schedule, overlap, prefetch_tiles = schedule_switches(schedule, overlap, prefetch_tiles).values()
    if schedule == "seesaw":
        assert num_stages == 2 and not overlap and not prefetch_tiles, "the seesaw schedule has no such switches"
        return seesaw.build_mla_decode_seesaw(heads, m_tiles, num_splits, softmax_scale, load_kv)
    assert num_stages >= 2, "the ring needs two slots to overlap a load with the tile before it"
    PDL = pdl_enabled()
    H, S, NS = heads, num_splits, num_stages
    DV, DPE, DH = md.KV_LORA, md.ROPE, md.KV_LORA // 2
    BM, BN, PAGE, HD = md.BLOCK_M, md.BLOCK_N, md.PAGE, md.HEAD_DIM
    PF = prefetch_tiles
    assert PF == 0 or PF >= NS, f"prefetch_tiles {PF}: 0 or at least the {NS} slots (nearer tiles load at once)"
    scale = float(softmax_scale * md.LOG2E)
    dtype, acc = T.bfloat16, T.float32
    neg_big = -(2.0**30)  # finite "minus infinity" for the running max (avoids inf - inf)

    Tq = T.dynamic("num_tokens")
    TH = T.dynamic("num_rows")
    B = T.dynamic("batch")
    NB = T.dynamic("num_blocks")
    NBT = T.dynamic("max_blocks_per_seq")
    combine = md.combine_splits(H, S, False, PDL)

    @T.macro
    def softmax_tile(acc_s, m_i, m_prev, alpha, row_sum, l_i, lim, tile, first_masked):
        """Key tile ``tile`` (its index in the request) of warpgroup 0's rows: the causal / length mask where the
        tile reaches past the first query's position, the running max, rescale factor, probabilities (in acc_s)
        and running sum. acc_o is not touched (its PV may still be in flight). first_masked: keys at positions past
        it are invisible to the first query row."""
        if (tile + 1) * BN - 1 > first_masked:
            for i, c in T.Parallel(BM, BN):
                acc_s[i, c] = T.if_then_else(tile * BN + c > lim[i], -T.infinity(acc), acc_s[i, c])
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        for i in T.Parallel(BM):
            alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale)
        for i, c in T.Parallel(BM, BN):
            acc_s[i, c] = T.exp2(acc_s[i, c] * scale - m_i[i] * scale)
        T.reduce_sum(acc_s, row_sum, dim=1)
        for i in T.Parallel(BM):
            l_i[i] = l_i[i] * alpha[i] + row_sum[i]

    @T.prim_func
    def mla_decode_ws(
        Q: T.Tensor([TH, DV], dtype),
        Q_pe: T.Tensor([TH, DPE], dtype),
        KV: T.Tensor([NB, PAGE, HD], dtype),
        block_table: T.Tensor([B, NBT], T.int32),
        q_start: T.Tensor([B], T.int32),
        seqlens_q: T.Tensor([B], T.int32),
        seqlens_k: T.Tensor([B], T.int32),
        Out: T.Tensor([Tq, H, DV], dtype),
        Lse: T.Tensor([Tq, H], acc),
        O_part: T.Tensor([S, Tq, H, DV], acc),
        Lse_part: T.Tensor([S, Tq, H], acc),
    ):
        with T.Kernel(m_tiles, B, S, threads=THREADS) as (mt, b, z):
            if PDL:  # _pdl.py: wait for the previous kernel, then let the next one launch
                T.pdl_sync()
                T.pdl_trigger()
            Q_shared = T.alloc_shared([BM, DV], dtype)
            Q_pe_shared = T.alloc_shared([BM, DPE], dtype)
            KV_shared = T.alloc_shared([NS, BN, DV], dtype)
            K_pe_shared = T.alloc_shared([NS, BN, DPE], dtype)
            S_shared = T.alloc_shared([BM, BN], dtype)
            alpha_shared = T.alloc_shared([BM], acc)
            l_shared = T.alloc_shared([BM], acc)

            acc_s = T.alloc_fragment([BM, BN], acc)
            acc_o_l = T.alloc_fragment([BM, DH], acc)
            acc_o_r = T.alloc_fragment([BM, DH], acc)
            m_i = T.alloc_fragment([BM], acc)
            m_prev = T.alloc_fragment([BM], acc)
            alpha = T.alloc_fragment([BM], acc)
            row_sum = T.alloc_fragment([BM], acc)
            l_i = T.alloc_fragment([BM], acc)
            lim = T.alloc_fragment([BM], T.int32)

            bar_q = T.alloc_barrier(arrive_count=128)
            bar_ready = T.alloc_barrier(arrive_count=[128] * NS)
            bar_free = T.alloc_barrier(arrive_count=[256] * NS)
            bar_s_ready = T.alloc_barrier(arrive_count=256)
            bar_s_free = T.alloc_barrier(arrive_count=256)
            bar_done = T.alloc_barrier(arrive_count=128)

            sq = seqlens_q[b]
            sk = seqlens_k[b]
            qs = q_start[b]
            row0 = mt * BM
            n_valid_rows = sq * H
            n_tiles = T.ceildiv(sk, BN)
            per = n_tiles // S
            rem = n_tiles % S
            my_tiles = T.if_then_else(row0 < n_valid_rows, per + T.if_then_else(z < rem, 1, 0), 0)
            t0 = per * z + T.min(z, rem)
            first_masked = sk - sq  # keys at positions > this are invisible to the first query row
            rounds = T.ceildiv(my_tiles, NS)
            tx = T.get_thread_binding()

            if tx < 128:  # warpgroup 0: QK^T, mask, softmax, P @ V left half
                T.set_max_nreg(REGS_SOFTMAX_WG, 1)
                T.fill(acc_o_l, 0)
                T.fill(l_i, 0)
                T.fill(m_i, neg_big)
                for i in T.Parallel(BM):  # last visible key position per row (inclusive); rows past sq clamp
                    lim[i] = T.min(sk - sq + (row0 + i) // H, sk - 1)
                T.barrier_wait(bar_q, 0)
                if overlap:
                    # Step j issues QK^T of tile j and only then hands tile j - 1's P to warpgroup 1 and issues its
                    # own half of P @ V of tile j - 1, so both halves run while warpgroup 0 waits for QK^T only
                    # and computes tile j's softmax; acc_o_l is rescaled after its PV has landed. Each wgmma wait
                    # sits in the branch of its issues: ptxas then sees which accumulators are in flight.
                    for r in T.serial(T.ceildiv(my_tiles + 1, NS)):
                        for st in T.unroll(NS):
                            j = r * NS + st
                            prev = (st + NS - 1) % NS  # tile j - 1's slot
                            if j < my_tiles:
                                T.barrier_wait(bar_ready[st], r & 1)
                                T.clear(acc_s)
                                T.wgmma_gemm(Q_shared[:, 0:DH], KV_shared[st, :, 0:DH], acc_s, transpose_B=True)
                                T.wgmma_gemm(Q_shared[:, DH:DV], KV_shared[st, :, DH:DV], acc_s, transpose_B=True)
                                T.wgmma_gemm(Q_pe_shared, K_pe_shared[st, :, :], acc_s, transpose_B=True)
                                if j > 0:
                                    T.barrier_arrive(bar_s_ready)  # tile j - 1's P and factors
                                    T.wgmma_gemm(S_shared, KV_shared[prev, :, 0:DH], acc_o_l)
                                    T.wait_wgmma(1)  # QK^T done; the PV may still run
                                    softmax_tile(acc_s, m_i, m_prev, alpha, row_sum, l_i, lim, t0 + j, first_masked)
                                    T.wait_wgmma(0)
                                    T.barrier_arrive(bar_free[prev])
                                    for i, d in T.Parallel(BM, DH):
                                        acc_o_l[i, d] *= alpha[i]
                                    T.barrier_arrive(bar_s_free)  # warpgroup 1 is done with tile j - 1's P
                                    T.barrier_wait(bar_s_free, (j - 1) & 1)
                                else:
                                    T.wait_wgmma(0)
                                    softmax_tile(acc_s, m_i, m_prev, alpha, row_sum, l_i, lim, t0 + j, first_masked)
                                T.copy(alpha, alpha_shared)
                                T.copy(acc_s, S_shared)
                                T.fence_proxy_async()  # P is read by wgmma (the async proxy) after the hand-off
                            elif j == my_tiles and j > 0:  # the last tile's P @ V
                                T.barrier_arrive(bar_s_ready)
                                T.wgmma_gemm(S_shared, KV_shared[prev, :, 0:DH], acc_o_l)
                                T.wait_wgmma(0)
                                T.barrier_arrive(bar_free[prev])
                else:
                    for r in T.serial(rounds):
                        for st in T.unroll(NS):
                            k = r * NS + st
                            if k < my_tiles:
                                T.barrier_wait(bar_ready[st], r & 1)
                                T.clear(acc_s)
                                T.wgmma_gemm(Q_shared[:, 0:DH], KV_shared[st, :, 0:DH], acc_s, transpose_B=True)
                                T.wgmma_gemm(Q_shared[:, DH:DV], KV_shared[st, :, DH:DV], acc_s, transpose_B=True)
                                T.wgmma_gemm(Q_pe_shared, K_pe_shared[st, :, :], acc_s, transpose_B=True)
                                T.wait_wgmma(0)
                                softmax_tile(acc_s, m_i, m_prev, alpha, row_sum, l_i, lim, t0 + k, first_masked)
                                for i, d in T.Parallel(BM, DH):
                                    acc_o_l[i, d] *= alpha[i]
                                if k > 0:  # warpgroup 1 is done with the previous tile's P and factors
                                    T.barrier_arrive(bar_s_free)
                                    T.barrier_wait(bar_s_free, (k - 1) & 1)
                                T.copy(alpha, alpha_shared)
                                T.copy(acc_s, S_shared)
                                # T.gemm emits fence.proxy.async before its wgmma: P's generic-proxy writes are
                                # visible to warpgroup 1's wgmma (async proxy) once s_ready is arrived below
                                T.gemm(S_shared, KV_shared[st, :, 0:DH], acc_o_l)
                                T.barrier_arrive(bar_s_ready)
                                T.barrier_arrive(bar_free[st])
                T.copy(l_i, l_shared)
                T.barrier_arrive(bar_done)
                # finalize: rows with no visible key in this split give o = 0, lse = -inf
                for i, d in T.Parallel(BM, DH):
                    acc_o_l[i, d] = T.if_then_else(l_i[i] > 0, acc_o_l[i, d] / l_i[i], 0.0)
                for i in T.Parallel(BM):
                    m_prev[i] = T.if_then_else(l_i[i] > 0, T.log2(l_i[i]) + m_i[i] * scale, -T.infinity(acc))
                if S == 1:
                    for i, d in T.Parallel(BM, DH):
                        if row0 + i < n_valid_rows:
                            Out[qs + (row0 + i) // H, (row0 + i) % H, d] = T.cast(acc_o_l[i, d], dtype)
                    for i in T.Parallel(BM):
                        if row0 + i < n_valid_rows:
                            Lse[qs + (row0 + i) // H, (row0 + i) % H] = m_prev[i] * md.LN2
                else:
                    for i, d in T.Parallel(BM, DH):
                        if row0 + i < n_valid_rows:
                            O_part[z, qs + (row0 + i) // H, (row0 + i) % H, d] = acc_o_l[i, d]
                    for i in T.Parallel(BM):
                        if row0 + i < n_valid_rows:
                            Lse_part[z, qs + (row0 + i) // H, (row0 + i) % H] = m_prev[i]
            elif tx < 256:  # warpgroup 1: P @ V right half, one tile behind warpgroup 0's QK^T
                T.set_max_nreg(REGS_PV_WG, 1)
                T.fill(acc_o_r, 0)
                for r in T.serial(rounds):
                    for st in T.unroll(NS):
                        k = r * NS + st
                        if k < my_tiles:
                            T.barrier_arrive(bar_s_ready)
                            T.barrier_wait(bar_s_ready, k & 1)
                            for i, d in T.Parallel(BM, DH):
                                acc_o_r[i, d] *= alpha_shared[i]
                            T.gemm(S_shared, KV_shared[st, :, DH:DV], acc_o_r)
                            T.barrier_arrive(bar_free[st])
                            T.barrier_arrive(bar_s_free)  # after the last tile nobody waits: harmless
                T.barrier_wait(bar_done, 0)
                for i, d in T.Parallel(BM, DH):
                    acc_o_r[i, d] = T.if_then_else(l_shared[i] > 0, acc_o_r[i, d] / l_shared[i], 0.0)
                if S == 1:
                    for i, d in T.Parallel(BM, DH):
                        if row0 + i < n_valid_rows:
                            Out[qs + (row0 + i) // H, (row0 + i) % H, DH + d] = T.cast(acc_o_r[i, d], dtype)
                else:
                    for i, d in T.Parallel(BM, DH):
                        if row0 + i < n_valid_rows:
                            O_part[z, qs + (row0 + i) // H, (row0 + i) % H, DH + d] = acc_o_r[i, d]
            else:  # warpgroup 2: TMA producer
                T.set_max_nreg(REGS_PRODUCER, 0)
                T.tma_copy(Q[qs * H + row0 : qs * H + row0 + BM, :], Q_shared, barrier=bar_q)
                T.tma_copy(Q_pe[qs * H + row0 : qs * H + row0 + BM, :], Q_pe_shared, barrier=bar_q)
                T.barrier_arrive(bar_q)
                if PF > 0:
                    T.import_source(L2_PREFETCH_SOURCE)
                    if tx == 2 * 128:  # tiles NS .. PF - 1 now; tile k + PF when tile k's slot is taken
                        for k in T.serial(NS, T.min(PF, my_tiles)):
                            T.evaluate(
                                T.call_extern(
                                    "handle",
                                    "di_prefetch_l2",
                                    T.access_ptr(KV[block_table[b, t0 + k], 0, 0], "r"),
                                    PAGE_BYTES,
                                )
                            )
                for r in T.serial(rounds):
                    for st in T.unroll(NS):
                        k = r * NS + st
                        if k < my_tiles:
                            if PF > 0:
                                if tx == 2 * 128 and k + PF < my_tiles:
                                    T.evaluate(
                                        T.call_extern(
                                            "handle",
                                            "di_prefetch_l2",
                                            T.access_ptr(KV[block_table[b, t0 + k + PF], 0, 0], "r"),
                                            PAGE_BYTES,
                                        )
                                    )
                            T.barrier_wait(bar_free[st], (r & 1) ^ 1)
                            if load_kv:
                                page = block_table[b, t0 + k]
                                T.tma_copy(KV[page, :, 0:DV], KV_shared[st, :, :], barrier=bar_ready[st])
                                T.tma_copy(KV[page, :, DV:HD], K_pe_shared[st, :, :], barrier=bar_ready[st])
                            T.barrier_arrive(bar_ready[st])

        if S > 1:
            combine(Out, Lse, O_part, Lse_part, Tq)

    return mla_decode_ws


_compile = md.compile_sm90


def get_kernel(
    heads: int,
    m_tiles: int,
    num_splits: int,
    softmax_scale: float,
    num_stages: int = 2,
    overlap: bool | None = None,
    prefetch_tiles: int | None = None,
    schedule: str | None = None,
):
    """Compile for sm_90a (cached per configuration, in memory and in TileLang's disk cache). Switches left None
    take the schedule's defaults (``schedule_switches``)."""
    assert tilelang is not None, "tilelang is not installed"
    v = schedule_switches(schedule, overlap, prefetch_tiles)
    return _get_kernel(heads, m_tiles, num_splits, softmax_scale, num_stages, *v.values())


@functools.cache
def _get_kernel(heads, m_tiles, num_splits, softmax_scale, num_stages, schedule, overlap, prefetch_tiles):
    return _compile(
        build_mla_decode_ws(
            heads,
            m_tiles,
            num_splits,
            softmax_scale,
            num_stages,
            overlap,
            prefetch_tiles=prefetch_tiles,
            schedule=schedule,
        )
    )


def schedule_switches(schedule=None, overlap=None, prefetch_tiles=None) -> dict:
    """Every switch of a schedule (``get_kernel``'s keyword arguments), None replaced by its default (read now:
    ``bench`` and the tests change the module's)."""
    schedule = schedule or SCHEDULE
    ws = schedule == "ws"
    return {
        "schedule": schedule,
        "overlap": (OVERLAP_SOFTMAX and ws) if overlap is None else overlap,
        "prefetch_tiles": (PREFETCH_TILES if ws else 0) if prefetch_tiles is None else prefetch_tiles,
    }


def precompile(configs, softmax_scale: float = md.HEAD_DIM**-0.5, num_workers=None, **variant):
    """Compile ``(heads, m_tiles, num_splits)`` configurations ahead of use (builds on this thread, nvcc in
    parallel), then warm ``get_kernel``'s cache with the launcher's call form. ``variant``: ``schedule`` /
    ``overlap`` / ``prefetch_tiles`` other than the defaults (``bench``)."""
    assert all(len(c) == 3 or (len(c) == 6 and c[5]) for c in configs), f"not 64-row ws configurations: {configs}"
    configs = list(dict.fromkeys(tuple(c[:3]) for c in configs))
    if not configs:
        return
    v = schedule_switches(**variant)  # what get_kernel will ask for (module switches read now, not at import)
    funcs = [build_mla_decode_ws(h, mt, s, float(softmax_scale), **v) for h, mt, s in configs]
    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(_compile, funcs))
    for h, mt, s in configs:
        if v == _default_variant():
            get_kernel(h, mt, s, float(softmax_scale))
        else:
            get_kernel(h, mt, s, float(softmax_scale), **v)


CI_CONFIGS = [(128, 2, 1), (16, 4, 3)]  # V3 decode without splits; V2-Lite verification (q <= 4) with the combine


def ci_compile(configs=None):
    """Compile representative configurations of this file's schedule for sm_90a without a GPU
    (tests/kernels_cuda/test_compile.py), and one with its switches on (overlap, prefetch); the seesaw schedule's:
    ``mla_decode_seesaw.ci_compile``."""
    funcs = [build_mla_decode_ws(h, mt, s, md.HEAD_DIM**-0.5, schedule="ws") for h, mt, s in (configs or CI_CONFIGS)]
    if configs is None:
        funcs.append(build_mla_decode_ws(128, 2, 1, md.HEAD_DIM**-0.5, overlap=True, prefetch_tiles=4, schedule="ws"))
    with compile_pool(len(funcs)) as ex:
        return list(ex.map(_compile, funcs))


# ----------------------------------------------------------------------------------------------------
# checks and benchmark (the reference, inputs and comparison are mla_decode's)
# ----------------------------------------------------------------------------------------------------
def _q_bucket(seqlens_q) -> int:
    return md.bucket_q(max(seqlens_q) if isinstance(seqlens_q, list) else seqlens_q)


def check_cases(seed=0):
    """mla_decode's cases whose tile has 64 rows (all 128-head ones; 16 heads from 2 query tokens), plus 16 heads
    with 2 query tokens (32 valid rows of the 64: V2-Lite with one MTP draft)."""
    extra = [(4, 16, 1000, 2, 1), (5, 16, [700, 64, 1500, 2, 3000], 2, 3)]
    return [c for c in md.check_cases(seed) if applies(c[1], _q_bucket(c[3]))] + extra


def run_checks(seed=0) -> bool:
    ok, mine, theirs = True, check_cases(seed), md.check_cases(seed)
    for i, case in enumerate(theirs):
        if case in mine:  # the seed mla_decode's own run of the case uses
            ok &= md.check_case(*case, seed=seed + i, warp_specialized=True)[0]
    for i, case in enumerate(c for c in mine if c not in theirs):
        ok &= md.check_case(*case, seed=seed + 1000 + i, warp_specialized=True)[0]
    return ok


BENCH_SHAPES = [(B, H, S, 1) for B, H, S in md.BENCH_SHAPES] + [(64, 128, 4096, 2), (64, 16, 4096, 4)]


def bench_configs(num_sms: int = 132) -> list[tuple]:
    """(heads, m_tiles, num_splits) of the bench shapes this kernel applies to, at the launch's split choice."""
    out = []
    for B, H, S, q in BENCH_SHAPES:
        bq = md.bucket_q(q)
        if applies(H, bq):
            out.append(md.decode_config(H, bq, md.default_num_splits(B, H, bq, S // md.PAGE, num_sms))[:3])
    return out


#: the schedules ``bench`` and ``diagnose`` compare with the default (``get_kernel``'s keyword arguments). Left out
#: to save compile time, each measured slower with real pages (``--diagnose``, B=64 H=128 4K, H200; add them here to
#: measure them again): the ws schedule's overlap / prefetch (session 8, call 7). The seesaw schedule's variants of
#: session 9 (L2 prefetch, evict_first, early left load, multicast, chunked, early_pv) were removed after their
#: calls; their code is in commit ae3ee03.
VARIANTS = [
    schedule_switches("ws", False, 0),
    schedule_switches("seesaw", False, 0),
]


def _default_variant() -> dict:
    return schedule_switches()


def bench(copy_gbps: float, shapes=None, out=None):
    """JSON lines (also appended to ``out``): each issue shape and two verification shapes on the pipelined kernel,
    this kernel's default and each of ``VARIANTS``, graph-timed in one run, the warp-specialized rows checked against
    the fp32 reference."""
    for B, H, S, q in shapes or BENCH_SHAPES:
        if not applies(H, md.bucket_q(q)):
            continue
        base = md.bench_case(B, H, S, q, copy_gbps=copy_gbps)
        for variant in [_default_variant()] + [v for v in VARIANTS if v != _default_variant()]:
            default = variant == _default_variant()
            r = md.bench_case(
                B,
                H,
                S,
                q,
                copy_gbps=copy_gbps,
                warp_specialized=True,
                check=True,
                ws_variant=None if default else variant,
            )
            r.update(  # (bench_case's row already names the schedule)
                overlap_softmax=variant["overlap"],
                prefetch_tiles=variant["prefetch_tiles"],
                default=default,
                pipelined_us=base["us"],
                speedup=round(base["us"] / r["us"], 3),
            )
            print(json.dumps(r), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(r) + "\n")


def diagnose(copy_gbps: float, batch: int = 64, heads: int = 128, seqlen_k: int = 4096):
    """Where the time goes at one issue shape (JSON lines). For the default and each of ``VARIANTS``: the real
    pages (shuffled, as ``make_inputs`` lays them out) and the same pages in order (request b's pages contiguous, as
    FlashMLA's benchmark lays them out), both checked against the fp32 reference; every tile of a request
    re-reading its first page (HBM traffic ~0, L2 -> SM traffic unchanged) and, without prefetch, no KV loads at
    all (the warpgroups' compute and hand-offs alone; garbage output)."""
    scale = md.HEAD_DIM**-0.5
    inp = md.make_inputs(batch, heads, seqlen_k, 1, seed=100, spare_blocks=0)
    mt = md.m_tiles_for(heads, 1)
    schedules = [_default_variant()] + [v for v in VARIANTS if v != _default_variant()]
    variants = [(v, True) for v in schedules] + [(v, False) for v in schedules if not v["prefetch_tiles"]]
    with compile_pool(len(variants)) as ex:
        kernels = list(
            ex.map(_compile, [build_mla_decode_ws(heads, mt, 1, scale, load_kv=load, **v) for v, load in variants])
        )
    q2 = inp["q_latent"].view(-1, md.KV_LORA)
    qpe2 = inp["q_rope"].view(-1, md.ROPE)
    out = torch.empty_like(inp["q_latent"])
    lse = torch.empty(out.shape[:2], dtype=torch.float32, device=out.device)
    o_part, l_part = md._dummy_partials(out.shape[0], heads, out.device)
    one_page = inp["block_tables"][:, :1].expand_as(inp["block_tables"]).contiguous()
    # each request's pages contiguous and in order (FlashMLA's benchmark layout): random pages minus page scatter
    assert seqlen_k % md.PAGE == 0, "in-order pages: every page of every request full (no poisoned tails)"
    in_order = torch.arange(inp["block_tables"].numel(), device=out.device, dtype=torch.int32)
    in_order = in_order.view_as(inp["block_tables"])
    ref, _ = md.mla_decode_ref(**inp, softmax_scale=scale)
    ref_in_order, _ = md.mla_decode_ref(**{**inp, "block_tables": in_order}, softmax_scale=scale)
    nbytes = batch * seqlen_k * md.HEAD_DIM * 2
    flops = 2 * batch * heads * seqlen_k * (md.HEAD_DIM + md.KV_LORA)
    for (v, load), kern in zip(variants, kernels):
        tables = [("pages", inp["block_tables"]), ("pages_in_order", in_order), ("one_page", one_page)]
        tables = tables if load else [("no_loads", one_page)]
        for mode, bt in tables:

            def fn(kern=kern, bt=bt):
                kern(
                    q2,
                    qpe2,
                    inp["kv_cache"],
                    bt,
                    inp["cu_seqlens_q"][:batch],
                    inp["seqlens_q"],
                    inp["seqlens_k"],
                    out,
                    lse,
                    o_part,
                    l_part,
                )

            out.fill_(float("nan"))
            us, timing = md._bench.time_us(fn)
            row = {
                "bench": "mla_decode_ws_diagnose",
                "hardware": torch.cuda.get_device_name(),
                "batch": batch,
                "heads": heads,
                "seqlen_k": seqlen_k,
                "schedule": v["schedule"],
                "overlap_softmax": v["overlap"],
                "prefetch_tiles": v["prefetch_tiles"],
                "default": v == _default_variant(),
                "kv": mode,
                "us": round(us, 2),
                "us_per_64_keys": round(us / (seqlen_k // 64), 3),
                "TFLOPs": round(flops / us / 1e6, 1),
                "frac_of_copy": round(nbytes / us / 1e3 / copy_gbps, 3),
                "copy_GBps": round(copy_gbps, 1),
                "timing": timing,
            }
            if mode in ("pages", "pages_in_order"):
                ok, info = md.compare(out, ref if mode == "pages" else ref_in_order, "diagnose")
                row.update(check="PASS" if ok else "FAIL", check_info={k: v for k, v in info.items() if k != "name"})
            print(json.dumps(row), flush=True)


def main(argv=None):
    global SCHEDULE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="numerics vs the fp32 reference (needs a GPU)")
    ap.add_argument("--bench", action="store_true", help="both decode kernels on the issue's shapes (needs a GPU)")
    ap.add_argument("--compile-only", action="store_true", help="compile the check and bench configurations")
    ap.add_argument("--out", help="also append the bench rows to this JSONL file")
    ap.add_argument("--diagnose", action="store_true", help="compute vs memory split at B=64, H=128, 4K (GPU)")
    ap.add_argument("--schedule", choices=SCHEDULES, help=f"the default schedule in this run (else {SCHEDULE})")
    args = ap.parse_args(argv)
    if args.schedule:
        SCHEDULE = args.schedule
    md._bench.exit_without_cuda(args)
    if args.check or args.bench or args.compile_only:
        cfgs = [md.decode_config(h, _q_bucket(sq), s) for _, h, _, sq, s in check_cases()]
        cfgs += bench_configs()
        t = time.time()
        precompile(cfgs)
        print(f"compiled {len(set(cfgs))} configurations in {time.time() - t:.1f}s", flush=True)
    ok = True
    if args.check:
        ok = run_checks()
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.bench:
        md.precompile(bench_configs())  # the pipelined kernel's, for the comparison
        for variant in VARIANTS:
            precompile(bench_configs(), **variant)
        cb = md.copy_bandwidth()
        print(json.dumps({"bench": "copy", "GBps": round(cb, 1)}), flush=True)
        bench(cb, out=args.out)
    if args.diagnose:
        diagnose(md.copy_bandwidth())
    return 0 if ok else 1


if __name__ == "__main__":
    # mla_decode's import must find this module (its SCHEDULE is what --schedule sets): as a script it imports
    # `mla_decode_ws`, under `python -m kernels_cuda.mla_decode_ws` the package's name
    sys.modules.setdefault("mla_decode_ws", sys.modules[__name__])
    if __spec__ is not None:
        sys.modules.setdefault(__spec__.name, sys.modules[__name__])
    sys.exit(main())
