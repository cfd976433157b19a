"""Paged MLA decode (absorbed), warp-specialized by hand for Hopper, in TileLang: FlashMLA's "seesaw" schedule.

Same op, layout and launch contract as ``mla_decode`` (576 values a token, pages of 64, query tokens x heads
folded into 64-row tiles, split-KV with the shared combine); ``mla_decode.mla_decode(..., warp_specialized=True)``
takes this kernel where the tile has 64 rows (``applies``), on a Hopper only (wgmma issued by hand, setmaxnreg).

Why: at 128 heads the decode is tensor-core bound, and the pipelined kernel's two consumer warpgroups compute QK^T,
exchange row maxima and sums, then P @ V in lockstep, so the tensor cores idle through every softmax. The seesaw
schedule (FlashMLA's ``docs/20250422-new-kernel-deep-dive.md``, written here from that description and its
published smem plan) takes the key tiles in pairs (a = 2p in slot 0, b = 2p + 1 in slot 1), 256 threads, no
producer warpgroup:

- warpgroup 0 owns O[:, :256] and computes S_a = Q K_a^T and its softmax; warpgroup 1 owns O[:, 256:] and computes
  S_b = Q K_b^T (running while warpgroup 0 does softmax a) and softmax b (running while warpgroup 0 multiplies
  P_a by V_a's left half). Each then multiplies the other's P (through shared memory) by its half of V, so both
  warpgroups do the same tensor work, one QK^T and two half P @ V a pair, and one's softmax overlaps the other's
  wgmma. The running max m is handed over through shared memory (m after a, m after b); P_a is rescaled by b's
  factor before warpgroup 1 uses it, so no output is rescaled twice.
- Loads are issued by the warpgroups themselves (one elected thread, TMA) as soon as a half of a slot is free:
  slot s's left half (columns 0-255, V's left half) after its last left-half P @ V, the right half (256-575) after
  the last right-half P @ V, each with its own mbarrier, so QK^T of the next pair starts on the half that landed.
- Shared memory: Q 72 KB, two slots 144 KB, P_a 8 KB; P_b reuses Q's rope columns (8 KB), whose values both
  warpgroups keep in registers (wgmma with A from registers) once Q has landed. 224 KB of the 227 KB.

Measured on an H200 (graph replays): 128 heads, batch 64 / 128 x 4K / 8K: 0.496-0.519 of the copy bandwidth
(490-520 TFLOP/s), 1.24-1.31x the pipelined kernel; a first hand schedule (a producer warpgroup, warpgroup 0 doing
QK^T, softmax and half of P @ V) was 6-12 % slower and is gone. Where the time goes (B=64, 4K): 105-106 us without
KV loads (~88 % of the bf16 tensor peak), 140-148 with the real pages; two 72 KB slots next to Q keep too few bytes
in flight to hide HBM latency, and L2 prefetch, cache hints, earlier loads, multicast clusters and in-order pages
were each measured no faster.
"""

import functools

from ._ast_guard import compile_pool
from ._mla_common import (
    BLOCK_M,
    BLOCK_N,
    DYNAMIC_SPLITS,
    HEAD_DIM,
    KV_LORA,
    LN2,
    LOG2E,
    PAGE,
    ROPE,
    T,
    combine_splits,
    compile_sm90,
    decode_block_m,
    split_layout,
    tilelang,
)
from ._prim_func_cache import cached_prim_func

THREADS = 256  # two warpgroups, each a consumer and its own TMA issuer

#: why this kernel is off in this process (a failed compile at warm-up: ``mla_decode.precompile``); None: usable
disabled_reason: str | None = None


def disable(reason: str) -> None:
    """Turn the kernel off for this process: ``mla_decode.mla_decode`` then runs the pipelined 64-row kernel."""
    global disabled_reason
    disabled_reason = reason


def applies(heads: int, q_bucket: int) -> bool:
    """The engine's tile for this step has 64 rows (the 16-row mma.sync tile has no warpgroups to specialize)."""
    return decode_block_m(heads, q_bucket) == BLOCK_M


@cached_prim_func
def build_mla_decode_ws(heads: int, m_tiles: int, num_splits: int, softmax_scale: float):
    """Return the TileLang PrimFunc (not compiled). Arguments as ``mla_decode.build_mla_decode``; Q and Q_pe are
    passed as their [T * H, D] row views (one TMA box loads a CTA's 64 folded rows; rows past the tensor read as
    zeros, rows of the next request are computed and never stored)."""
    assert tilelang is not None, "tilelang is not installed"
    H = heads
    direct = num_splits == 1  # no partials, no combine
    DV, DPE, DH = KV_LORA, ROPE, KV_LORA // 2
    BM, BN, HD = BLOCK_M, BLOCK_N, HEAD_DIM
    assert BM == 64 and BN == PAGE == 64 and DH == 256, "the seesaw tiles are 64 rows x 64 keys, V in two halves"
    scale = float(softmax_scale * LOG2E)
    dtype, acc = T.bfloat16, T.float32
    neg_big = -(2.0**30)  # finite "minus infinity" for the running max (scaled units; avoids inf - inf)

    Tq = T.dynamic("num_tokens")
    TH = T.dynamic("num_rows")
    B = T.dynamic("batch")
    NB = T.dynamic("num_blocks")
    NBT = T.dynamic("max_blocks_per_seq")
    S, OP, LP = split_layout(num_splits, Tq, H)
    combine = combine_splits(H, S)

    @T.macro
    def load_left(KV, KV_shared, bars, page, slot):
        """Columns 0-255 of a page (V's left half and the first half of K's latent part)."""
        T.tma_copy(KV[page, :, 0:DH], KV_shared[slot, :, 0:DH], barrier=bars[slot])
        T.barrier_arrive(bars[slot])

    @T.macro
    def load_right(KV, KV_shared, K_pe_shared, bars, page, slot):
        """Columns 256-575 of a page (V's right half and K's rope part)."""
        T.tma_copy(KV[page, :, DH:DV], KV_shared[slot, :, DH:DV], barrier=bars[slot])
        T.tma_copy(KV[page, :, DV:HD], K_pe_shared[slot, :, :], barrier=bars[slot])
        T.barrier_arrive(bars[slot])

    @T.macro
    def qk_left(Q_shared, KV_shared, acc_s, bars, slot, parity):
        T.barrier_wait(bars[slot], parity)
        T.wgmma_gemm(Q_shared[:, 0:DH], KV_shared[slot, :, 0:DH], acc_s, transpose_B=True)

    @T.macro
    def qk_right(Q_shared, KV_shared, K_pe_shared, q_pe, acc_s, bars, slot, parity):
        T.barrier_wait(bars[slot], parity)
        T.wgmma_gemm(Q_shared[:, DH:DV], KV_shared[slot, :, DH:DV], acc_s, transpose_B=True)
        T.wgmma_gemm(q_pe, K_pe_shared[slot, :, :], acc_s, transpose_B=True)

    @T.macro
    def softmax(acc_s, m_prev, m_i, f, row_sum, lim, tile, first_masked):
        """The mask where the tile reaches past the first row's last visible key, the new running max m_i from
        m_prev (scaled, base 2), the factor f = exp2(m_prev - m_i), P = exp2(S * scale - m_i) in acc_s and its
        row sums."""
        if (tile + 1) * BN - 1 > first_masked:
            for i, c in T.Parallel(BM, BN):
                acc_s[i, c] = T.if_then_else(tile * BN + c > lim[i], -T.infinity(acc), acc_s[i, c])
        T.reduce_max(acc_s, m_i, dim=1, clear=True)
        for i in T.Parallel(BM):
            m_i[i] = T.max(m_prev[i], m_i[i] * scale)
            f[i] = T.exp2(m_prev[i] - m_i[i])
        for i, c in T.Parallel(BM, BN):
            acc_s[i, c] = T.exp2(acc_s[i, c] * scale - m_i[i])
        T.reduce_sum(acc_s, row_sum, dim=1)

    @T.macro
    def finish(frags, wg, out):
        """Both halves need the total row sum (each warpgroup summed its own tiles' P); the final max is m_b.
        Rows with no visible key in this split: o = 0, lse = -inf. ``wg``: the warpgroup (0, 1), ``out``: the
        output tensors, the row sums' shared buffer and barrier, and the CTA's rows."""
        acc_o, m_i, l_i = frags[3], frags[4], frags[9]
        Out, Lse, O_part, Lse_part, l_shared, m_b_shared, bar_l, qs, row0, n_valid, z = out
        for i in T.Parallel(BM):
            l_shared[wg, i] = l_i[i]
        T.barrier_arrive(bar_l)
        T.barrier_wait(bar_l, 0)
        for i in T.Parallel(BM):
            l_i[i] = l_shared[0, i] + l_shared[1, i]
            m_i[i] = T.if_then_else(l_i[i] > 0, T.log2(l_i[i]) + m_b_shared[i], -T.infinity(acc))
        for i, d in T.Parallel(BM, DH):
            acc_o[i, d] = T.if_then_else(l_i[i] > 0, acc_o[i, d] / l_i[i], 0.0)
        if direct:
            for i, d in T.Parallel(BM, DH):
                if row0 + i < n_valid:
                    Out[qs + (row0 + i) // H, (row0 + i) % H, wg * DH + d] = T.cast(acc_o[i, d], dtype)
            if wg == 0:
                for i in T.Parallel(BM):
                    if row0 + i < n_valid:
                        Lse[qs + (row0 + i) // H, (row0 + i) % H] = m_i[i] * LN2
        else:
            for i, d in T.Parallel(BM, DH):
                if row0 + i < n_valid:
                    O_part[z, qs + (row0 + i) // H, (row0 + i) % H, wg * DH + d] = acc_o[i, d]
            if wg == 0:
                for i in T.Parallel(BM):
                    if row0 + i < n_valid:
                        Lse_part[z, qs + (row0 + i) // H, (row0 + i) % H] = m_i[i]

    @T.macro
    def wg0_pair(sh, frags, bars, ctx, p, has_b: bool, has_next_a: bool, has_next_b: bool):
        """Pair p (S_a in acc_s): softmax a, P_a @ V_aL, P_b @ V_bL, QK^T of the next a."""
        Q_shared, Q_pe_shared, KV_shared, K_pe_shared, P_a_shared, m_a_sh, m_b_sh, sc_a_sh, sc_b_sh = sh
        acc_s, p_local, q_pe, acc_o, m_i, m_prev, f_a, f_b, row_sum, l_i, lim = frags
        bar_left, bar_right, bar_scale_a, bar_scale_b, bar_p_a, bar_p_b = bars
        KV, block_table, b, t0, first_masked = ctx
        a = 2 * p
        for i in T.Parallel(BM):
            m_prev[i] = m_b_sh[i]
        softmax(acc_s, m_prev, m_i, f_a, row_sum, lim, t0 + a, first_masked)
        for i in T.Parallel(BM):
            l_i[i] = l_i[i] * f_a[i] + row_sum[i]
            m_a_sh[i] = m_i[i]
            sc_a_sh[i] = f_a[i]
        T.barrier_arrive(bar_scale_a)
        for i, d in T.Parallel(BM, DH):
            acc_o[i, d] *= f_a[i]
        T.copy(acc_s, p_local)
        T.wgmma_gemm(p_local, KV_shared[0, :, 0:DH], acc_o)  # P_a @ V_aL
        T.wait_wgmma(0)
        T.barrier_wait(bar_scale_b, p & 1)
        if has_next_a:  # slot 0's left half is free: the next a's
            load_left(KV, KV_shared, bar_left, block_table[b, t0 + a + 2], 0)
        for i in T.Parallel(BM):
            f_b[i] = sc_b_sh[i]
        for i, c in T.Parallel(BM, BN):
            P_a_shared[i, c] = T.cast(acc_s[i, c] * f_b[i], dtype)
        T.fence_proxy_async()  # P_a is read by warpgroup 1's wgmma (the async proxy)
        T.barrier_arrive(bar_p_a)
        if has_b:
            T.barrier_wait(bar_p_b, p & 1)
            for i in T.Parallel(BM):
                l_i[i] *= f_b[i]
            for i, d in T.Parallel(BM, DH):
                acc_o[i, d] *= f_b[i]
            T.wgmma_gemm(Q_pe_shared, KV_shared[1, :, 0:DH], acc_o)  # P_b @ V_bL
        if has_next_a:
            T.clear(acc_s)
            qk_left(Q_shared, KV_shared, acc_s, bar_left, 0, (p + 1) & 1)
            if has_next_b:
                T.wait_wgmma(1)  # P_b @ V_bL done: slot 1's left half is free
                load_left(KV, KV_shared, bar_left, block_table[b, t0 + a + 3], 1)
            qk_right(Q_shared, KV_shared, K_pe_shared, q_pe, acc_s, bar_right, 0, (p + 1) & 1)
        T.wait_wgmma(0)

    @T.macro
    def wg1_pair(sh, frags, bars, ctx, p, has_b: bool, has_next_a: bool, has_next_b: bool):
        """Pair p (S_b in acc_s where there is a b): softmax b, P_b @ V_bR, P_a @ V_aR, QK^T of the next b."""
        Q_shared, Q_pe_shared, KV_shared, K_pe_shared, P_a_shared, m_a_sh, m_b_sh, sc_a_sh, sc_b_sh = sh
        acc_s, p_local, q_pe, acc_o, m_i, m_prev, f_a, f_b, row_sum, l_i, lim = frags
        bar_left, bar_right, bar_scale_a, bar_scale_b, bar_p_a, bar_p_b = bars
        KV, block_table, b, t0, first_masked = ctx
        T.barrier_wait(bar_scale_a, p & 1)
        for i in T.Parallel(BM):
            m_prev[i] = m_a_sh[i]
            f_a[i] = sc_a_sh[i]
        if has_b:
            softmax(acc_s, m_prev, m_i, f_b, row_sum, lim, t0 + 2 * p + 1, first_masked)
        else:
            for i in T.Parallel(BM):
                m_i[i] = m_prev[i]
                f_b[i] = 1.0
                row_sum[i] = 0.0
        for i in T.Parallel(BM):
            m_b_sh[i] = m_i[i]
            sc_b_sh[i] = f_b[i]
        T.barrier_arrive(bar_scale_b)
        for i in T.Parallel(BM):
            f_a[i] = f_a[i] * f_b[i]
            l_i[i] = l_i[i] * f_a[i] + row_sum[i]
        for i, d in T.Parallel(BM, DH):
            acc_o[i, d] *= f_a[i]
        if has_b:
            T.copy(acc_s, Q_pe_shared)  # P_b for warpgroup 0 (Q's rope columns are in registers)
            T.copy(acc_s, p_local)
            T.wgmma_gemm(p_local, KV_shared[1, :, DH:DV], acc_o)  # P_b @ V_bR
            T.fence_proxy_async()
        T.barrier_wait(bar_p_a, p & 1)
        T.wgmma_gemm(P_a_shared, KV_shared[0, :, DH:DV], acc_o)  # P_a @ V_aR
        if has_b:
            T.barrier_arrive(bar_p_b)
        if has_next_b:
            T.wait_wgmma(1)  # P_b @ V_bR done: slot 1's right half is free
            load_right(KV, KV_shared, K_pe_shared, bar_right, block_table[b, t0 + 2 * p + 3], 1)
        if has_next_a:
            T.wait_wgmma(0)  # P_a @ V_aR done: slot 0's right half is free
            load_right(KV, KV_shared, K_pe_shared, bar_right, block_table[b, t0 + 2 * p + 2], 0)
        if has_next_b:
            T.clear(acc_s)
            qk_right(Q_shared, KV_shared, K_pe_shared, q_pe, acc_s, bar_right, 1, (p + 1) & 1)
            qk_left(Q_shared, KV_shared, acc_s, bar_left, 1, (p + 1) & 1)
        T.wait_wgmma(0)

    def wg_fragments():
        """A warpgroup's register fragments, in the order the pair macros unpack them."""
        scalars = [T.alloc_fragment([BM], acc) for _ in range(6)]  # m_i, m_prev, f_a, f_b, row_sum, l_i
        return (
            T.alloc_fragment([BM, BN], acc),  # acc_s: S, then P
            T.alloc_fragment([BM, BN], dtype),  # p_local: P as wgmma's A operand
            T.alloc_fragment([BM, DPE], dtype),  # q_pe: Q's rope columns
            T.alloc_fragment([BM, DH], acc),  # acc_o: this warpgroup's half of O
            *scalars,
            T.alloc_fragment([BM], T.int32),  # lim: a row's last visible key
        )

    @T.macro
    def all_pairs(pair, args, n_full, left):
        """Every pair of a CTA's tiles through one warpgroup's ``pair`` macro: the pairs followed by a pair with a b
        (every step), then the 1-3 tiles left (the flags say which steps exist)."""
        for p in T.serial(n_full):
            pair(*args, p, True, True, True)
        if left == 3:
            pair(*args, n_full, True, True, False)
            pair(*args, n_full + 1, False, False, False)
        elif left == 2:
            pair(*args, n_full, True, False, False)
        elif left == 1:
            pair(*args, n_full, False, False, False)

    @T.prim_func
    def mla_decode_seesaw(
        Q: T.Tensor([TH, DV], dtype),
        Q_pe: T.Tensor([TH, DPE], dtype),
        KV: T.Tensor([NB, PAGE, HD], dtype),
        block_table: T.Tensor([B, NBT], T.int32),
        q_start: T.Tensor([B], T.int32),
        seqlens_q: T.Tensor([B], T.int32),
        seqlens_k: T.Tensor([B], T.int32),
        Out: T.Tensor([Tq, H, DV], dtype),
        Lse: T.Tensor([Tq, H], acc),
        O_part: T.Tensor(OP, acc),
        Lse_part: T.Tensor(LP, acc),
    ):
        with T.Kernel(m_tiles, B, S, threads=THREADS) as (mt, b, z):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            Q_shared = T.alloc_shared([BM, DV], dtype)
            Q_pe_shared = T.alloc_shared([BM, DPE], dtype)  # Q's rope columns, then P_b (same shape)
            KV_shared = T.alloc_shared([2, BN, DV], dtype)
            K_pe_shared = T.alloc_shared([2, BN, DPE], dtype)
            P_a_shared = T.alloc_shared([BM, BN], dtype)
            m_a_shared = T.alloc_shared([BM], acc)  # running max after tile a (scaled, base 2)
            m_b_shared = T.alloc_shared([BM], acc)  # ... after tile b
            scale_a_shared = T.alloc_shared([BM], acc)  # exp2(m before a - m after a)
            scale_b_shared = T.alloc_shared([BM], acc)  # exp2(m after a - m after b)
            l_shared = T.alloc_shared([2, BM], acc)

            # each warpgroup its own fragments (a fragment's layout spans the threads of the warpgroup that uses it):
            # acc_s, p_local, q_pe, acc_o, m_i, m_prev, f_a, f_b, row_sum, l_i, lim
            frags0 = wg_fragments()
            frags1 = wg_fragments()
            acc_s0, q_pe0, acc_o0, l_i0, lim0 = (frags0[k] for k in (0, 2, 3, 9, 10))
            acc_s1, q_pe1, acc_o1, l_i1, lim1 = (frags1[k] for k in (0, 2, 3, 9, 10))

            bar_q = T.alloc_barrier(arrive_count=128)
            bar_left = T.alloc_barrier(arrive_count=[128, 128])
            bar_right = T.alloc_barrier(arrive_count=[128, 128])
            bar_scale_a = T.alloc_barrier(arrive_count=128)  # wg0: softmax a done (m_a, scale_a)
            bar_scale_b = T.alloc_barrier(arrive_count=128)  # wg1: softmax b done (m_b, scale_b)
            bar_p_a = T.alloc_barrier(arrive_count=128)  # wg0: P_a (rescaled) in shared memory
            bar_p_b = T.alloc_barrier(arrive_count=128)  # wg1: P_b in shared memory, P_a @ V_aR issued
            bar_l = T.alloc_barrier(arrive_count=256)  # both: row sums in l_shared

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
            # pairs followed by a pair with a b (the loop body with every step), then the 1-3 tiles left
            n_full = T.max(my_tiles - 2, 0) // 2
            left = my_tiles - 2 * n_full
            sh = (
                Q_shared,
                Q_pe_shared,
                KV_shared,
                K_pe_shared,
                P_a_shared,
                m_a_shared,
                m_b_shared,
                scale_a_shared,
                scale_b_shared,
            )
            bars = (bar_left, bar_right, bar_scale_a, bar_scale_b, bar_p_a, bar_p_b)
            ctx = (KV, block_table, b, t0, first_masked)
            out = (Out, Lse, O_part, Lse_part, l_shared, m_b_shared, bar_l, qs, row0, n_valid_rows, z)
            tx = T.get_thread_binding()

            if tx < 128:  # warpgroup 0: Q, tile 0, every S_a; O[:, :256]
                T.fill(acc_o0, 0)
                T.fill(l_i0, 0)
                for i in T.Parallel(BM):  # last visible key position per row (inclusive); rows past sq clamp
                    lim0[i] = T.min(sk - sq + (row0 + i) // H, sk - 1)
                    m_b_shared[i] = neg_big  # "m after the previous b" for the first pair
                T.tma_copy(Q[qs * H + row0 : qs * H + row0 + BM, :], Q_shared, barrier=bar_q)
                T.tma_copy(Q_pe[qs * H + row0 : qs * H + row0 + BM, :], Q_pe_shared, barrier=bar_q)
                T.barrier_arrive(bar_q)
                if my_tiles > 0:
                    load_left(KV, KV_shared, bar_left, block_table[b, t0], 0)
                    load_right(KV, KV_shared, K_pe_shared, bar_right, block_table[b, t0], 0)
                T.barrier_wait(bar_q, 0)
                T.copy(Q_pe_shared, q_pe0)
                if my_tiles > 0:
                    T.clear(acc_s0)
                    qk_left(Q_shared, KV_shared, acc_s0, bar_left, 0, 0)
                    qk_right(Q_shared, KV_shared, K_pe_shared, q_pe0, acc_s0, bar_right, 0, 0)
                    T.wait_wgmma(0)
                all_pairs(wg0_pair, (sh, frags0, bars, ctx), n_full, left)
                finish(frags0, 0, out)
            else:  # warpgroup 1: tile 1, every S_b; O[:, 256:]
                T.fill(acc_o1, 0)
                T.fill(l_i1, 0)
                for i in T.Parallel(BM):
                    lim1[i] = T.min(sk - sq + (row0 + i) // H, sk - 1)
                if my_tiles > 1:
                    load_left(KV, KV_shared, bar_left, block_table[b, t0 + 1], 1)
                    load_right(KV, KV_shared, K_pe_shared, bar_right, block_table[b, t0 + 1], 1)
                T.barrier_wait(bar_q, 0)
                T.copy(Q_pe_shared, q_pe1)
                if my_tiles > 1:
                    T.clear(acc_s1)
                    qk_right(Q_shared, KV_shared, K_pe_shared, q_pe1, acc_s1, bar_right, 1, 0)
                    qk_left(Q_shared, KV_shared, acc_s1, bar_left, 1, 0)
                    T.wait_wgmma(0)
                all_pairs(wg1_pair, (sh, frags1, bars, ctx), n_full, left)
                finish(frags1, 1, out)

        if not direct:
            combine(Out, Lse, O_part, Lse_part, Tq)

    return mla_decode_seesaw


_compile = compile_sm90  # the module's compile, one name to replace in tests


@functools.cache
def get_kernel(heads: int, m_tiles: int, num_splits: int, softmax_scale: float):
    """Compile for sm_90a (cached per configuration, in memory and in TileLang's disk cache)."""
    assert tilelang is not None, "tilelang is not installed"
    return _compile(build_mla_decode_ws(heads, m_tiles, num_splits, softmax_scale))


def precompile(configs, softmax_scale: float = HEAD_DIM**-0.5, num_workers=None):
    """Compile ``(heads, m_tiles, num_splits)`` configurations ahead of use (builds on this thread, nvcc in
    parallel), then warm ``get_kernel``'s cache with the launcher's call form."""
    assert all(len(c) == 3 or (len(c) == 6 and c[5]) for c in configs), f"not 64-row ws configurations: {configs}"
    configs = list(dict.fromkeys(tuple(c[:3]) for c in configs))
    if not configs:
        return
    funcs = [build_mla_decode_ws(h, mt, s, float(softmax_scale)) for h, mt, s in configs]
    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(_compile, funcs))
    for h, mt, s in configs:
        get_kernel(h, mt, s, float(softmax_scale))


# V2-Lite verification (q <= 4) with the split combine (the suite compiles the first); V3 decode without splits
CI_CONFIGS = [(16, 4, DYNAMIC_SPLITS), (128, 2, 1)]


def ci_compile(configs=None):
    """Compile representative configurations for sm_90a without a GPU (tests/kernels_cuda/test_compile.py)."""
    funcs = [build_mla_decode_ws(h, mt, s, HEAD_DIM**-0.5) for h, mt, s in (configs or CI_CONFIGS)]
    with compile_pool(len(funcs)) as ex:
        return list(ex.map(_compile, funcs))
