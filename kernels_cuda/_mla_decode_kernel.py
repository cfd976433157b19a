"""The paged MLA decode kernel's factory (``build_mla_decode``): the design and the contract are in
``mla_decode``'s module docstring, which also holds the configurations, the compile cache and the launchers."""

from ._mla_common import (
    BLOCK_M,
    BLOCK_N,
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
    SMALL_BLOCK_M,
    SMALL_THREADS,
    T,
    combine_splits,
    split_layout,
    tilelang,
)
from ._prim_func_cache import cached_prim_func

# Registers a consumer thread takes at two CTAs an SM: each CTA launches with 128 a thread (the launch bound), the
# producer warpgroup gives back down to 24, so the consumer may grow to 128 + (128 - 24) = 232 (240 would wait for
# registers that never come)
FP8_CONSUMER_REGS = 232


@cached_prim_func
def build_mla_decode(
    heads: int, m_tiles: int, num_splits: int, softmax_scale: float, num_stages: int = 2, threads: int = 256,
    causal_tile_bound: bool = False, block_m: int = BLOCK_M, skip_empty_splits: bool = False, kv_fp8: bool = False,
):
    """Return the TileLang PrimFunc (not compiled).

    heads: query heads H (compile-time); m_tiles: CTAs per request along the folded rows, ceil(max_q*H/64);
    num_splits: KV splits (grid z): 1 (the split kernel writes the output) or ``DYNAMIC_SPLITS`` (any count above 1,
    read from the partial buffers' first dimension at launch); softmax_scale: applied to q.k before the softmax.
    causal_tile_bound: a CTA stops at the last key tile its last row can see (prefill: rows early in a long
    chunk skip the tiles past their position). Off for decode / verification, where it changes nothing.
    skip_empty_splits (tuning sweeps; off in the engine): a split with no key tile writes only its -inf LSE, not
    its zero partial output, and the combine does not read such partials (a batch-1 graph on a wide table runs
    32 splits for a 9-page context).
    kv_fp8: the cache holds packed FP8 rows (``kv_cache_dtype="fp8"``, FP8_ROW_BYTES a token: 512 e4m3 latent
    values, their 4 fp32 scales, 64 bf16 RoPE values), passed as three views of the same bytes (:func:`fp8_views`);
    each half page's latents are dequantised into the bf16 tile the two GEMMs read (FlashMLA's FP8 decode does the
    same); half-page key tiles keep both tiles double-buffered within the shared memory.
    Dynamic (run-time) sizes: total tokens T, requests B, cache blocks, block-table width.
    """
    assert tilelang is not None, "tilelang is not installed"
    H = heads
    DV, DPE = KV_LORA, ROPE
    BM, BN = block_m, BLOCK_N  # block_m < 64 (tuning sweeps only): mma.sync instead of wgmma on sm_90a
    if kv_fp8:  # half-page key tiles: the fp8 staging tile and the bf16 tile, each double-buffered, fit in 227 KB
        BN = BLOCK_N // 2
    TPP = PAGE // BN  # key tiles a page
    # The FP8 16-row tile: two CTAs an SM, so that one dequantises while the other runs its GEMMs (alone, a CTA's
    # dequantise -> GEMM -> softmax -> GEMM chain bounds it; its shared memory, ~95 KB, fits twice)
    two_ctas_per_sm = kv_fp8 and BM == SMALL_BLOCK_M and threads == SMALL_THREADS
    NG = DV // FP8_GROUP  # scale groups a latent row
    direct = num_splits == 1  # no partials, no combine
    scale = float(softmax_scale * LOG2E)
    dtype = T.bfloat16
    acc = T.float32
    neg_big = -(2.0**30)  # finite "minus infinity" for the running max (avoids inf - inf)

    Tq = T.dynamic("num_tokens")
    B = T.dynamic("batch")
    NB = T.dynamic("num_blocks")
    NBT = T.dynamic("max_blocks_per_seq")
    S, OP, LP = split_layout(num_splits, Tq, H)
    combine = combine_splits(H, S, skip_empty_splits)

    @T.macro
    def split_kernel(Q, Q_pe, KV_lat, KV_sc, KV_pe, block_table, q_start, seqlens_q, seqlens_k, Out, Lse, O_part,
                     Lse_part):
        """The split kernel; KV_lat / KV_sc / KV_pe: the cache (bf16: the same tensor three times; FP8: its e4m3,
        fp32 and bf16 views)."""
        with T.Kernel(m_tiles, B, S, threads=threads) as (mt, b, z):
            if two_ctas_per_sm:
                T.annotate_min_blocks_per_sm(2)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(FP8_CONSUMER_REGS)
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            Q_shared = T.alloc_shared([BM, DV], dtype)
            Q_pe_shared = T.alloc_shared([BM, DPE], dtype)
            KV_shared = T.alloc_shared([BN, DV], dtype)
            K_pe_shared = T.alloc_shared([BN, DPE], dtype)
            if kv_fp8:
                KV8_shared = T.alloc_shared([BN, DV], T.float8_e4m3fn)
                SC_shared = T.alloc_shared([BN, NG], acc)
                KV_dq = T.alloc_fragment([BN, DV], dtype)
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
                if kv_fp8:
                    page = block_table[b, (t0 + k) // TPP]
                    r0 = ((t0 + k) % TPP) * BN  # the tile's first row in its page
                    T.copy(KV_lat[page, r0 : r0 + BN, 0:DV], KV8_shared)
                    T.copy(KV_sc[page, r0 : r0 + BN, FP8_SCALE_OFFSET : FP8_SCALE_OFFSET + NG], SC_shared)
                    T.copy(KV_pe[page, r0 : r0 + BN, FP8_PE_OFFSET : FP8_PE_OFFSET + DPE], K_pe_shared)
                    # value * its group's scale (fp32), rounded to bf16; through registers, so that the whole
                    # tile is read before it is written (one barrier, not one per row chunk) and the scales come
                    # from shared memory (per-element global loads made this kernel slower than the bf16 one)
                    for i, d in T.Parallel(BN, DV):
                        KV_dq[i, d] = T.cast(T.cast(KV8_shared[i, d], acc) * SC_shared[i, d // FP8_GROUP], dtype)
                    T.copy(KV_dq, KV_shared)
                else:
                    page = block_table[b, t0 + k]
                    T.copy(KV_lat[page, :, 0:DV], KV_shared)
                    T.copy(KV_pe[page, :, DV:HEAD_DIM], K_pe_shared)
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
            if direct:
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

    if kv_fp8:
        RB = FP8_ROW_BYTES

        @T.prim_func
        def mla_decode_split_fp8(
            Q: T.Tensor([Tq, H, DV], dtype),
            Q_pe: T.Tensor([Tq, H, DPE], dtype),
            KV8: T.Tensor([NB, PAGE, RB], T.float8_e4m3fn),
            KVs: T.Tensor([NB, PAGE, RB // 4], acc),
            KVr: T.Tensor([NB, PAGE, RB // 2], dtype),
            block_table: T.Tensor([B, NBT], T.int32),
            q_start: T.Tensor([B], T.int32),
            seqlens_q: T.Tensor([B], T.int32),
            seqlens_k: T.Tensor([B], T.int32),
            Out: T.Tensor([Tq, H, DV], dtype),
            Lse: T.Tensor([Tq, H], acc),
            O_part: T.Tensor(OP, acc),
            Lse_part: T.Tensor(LP, acc),
        ):
            split_kernel(Q, Q_pe, KV8, KVs, KVr, block_table, q_start, seqlens_q, seqlens_k, Out, Lse, O_part,
                         Lse_part)
            if not direct:
                combine(Out, Lse, O_part, Lse_part, Tq)

        return mla_decode_split_fp8

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
        O_part: T.Tensor(OP, acc),
        Lse_part: T.Tensor(LP, acc),
    ):
        split_kernel(Q, Q_pe, KV, KV, KV, block_table, q_start, seqlens_q, seqlens_k, Out, Lse, O_part, Lse_part)
        if not direct:
            combine(Out, Lse, O_part, Lse_part, Tq)

    return mla_decode_split
