"""What the two paged MLA decode kernels share: the FlashMLA cache layout, the tile shape, the split-KV combine
and the sm_90a compile. ``mla_decode`` (pipelined, the launch API) and ``mla_decode_ws`` (warp-specialized, 64-row
tiles on a Hopper) both import this module; neither imports the other's internals.

Layout: per token 576 bf16 values, 512 latent (c_kv) then 64 rope (k_pe); pages of 64 tokens; the query tokens of
a request times its heads are folded into the rows of a tile.
"""

from ._tilelang import T, tilelang

KV_LORA = 512
ROPE = 64
HEAD_DIM = KV_LORA + ROPE  # 576
PAGE = 64  # block_size of the paged latent cache
BLOCK_M = 64  # folded (q token x head) rows per CTA
# One token of a few heads (V2-Lite's 16, batch-1 decode): the 16 rows in an mma.sync tile of 16 at 128 threads
# instead of a 64-row wgmma tile (48 padding rows). Batch-1 sweep on an H200 (bench.py mla_decode --sweep-batch1,
# 512-token context): 8.2 us at 32 splits against 16.0-16.5 us for the 64-row tile.
SMALL_BLOCK_M = 16
SMALL_THREADS = 128
BLOCK_N = 64  # keys per pipeline stage (= one page)
# Packed FP8 rows (kv_cache_dtype="fp8", model_executor/quantization/kv_fp8.py): 512 e4m3 latent values, one fp32
# scale per 128 of them, 64 bf16 RoPE values = 656 bytes a token; offsets in the units of the view that reads them
FP8_GROUP = 128
FP8_ROW_BYTES = KV_LORA + 4 * (KV_LORA // FP8_GROUP) + 2 * ROPE  # 656
FP8_SCALE_OFFSET = KV_LORA // 4  # the scales in the row's fp32 view
FP8_PE_OFFSET = (KV_LORA + 4 * (KV_LORA // FP8_GROUP)) // 2  # the RoPE values in the row's bf16 view
# A kernel's split count: 1 writes the bf16 output from the split kernel itself; DYNAMIC_SPLITS builds one kernel
# for every count above 1, the count read at launch from the partial buffers' first dimension (grid z). One build
# instead of one a count: the V2-Lite engine's decode graphs took 7 counts, about 10 s of compile each at start-up.
DYNAMIC_SPLITS = 0
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def compile_sm90(func, target=None):
    """Compile a PrimFunc of the MLA decode kernels for ``target`` (default ``SM90_TARGET``), fast math on."""
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET),
                            pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})


def kernel_splits(num_splits: int) -> int:
    """The split count a launch of ``num_splits`` splits compiles for: 1, or ``DYNAMIC_SPLITS`` above 1."""
    if num_splits < 1:
        raise ValueError(f"mla_decode: num_splits must be at least 1, got {num_splits}")
    return 1 if num_splits == 1 else DYNAMIC_SPLITS


def split_layout(num_splits: int, num_tokens, heads: int):
    """A kernel factory's split count (1 or ``DYNAMIC_SPLITS``, as ``kernel_splits`` gives them) -> (the grid's z
    extent: 1 or the run-time size ``num_splits``; the fp32 partial outputs' shape; the partial LSEs' shape). A
    one-split build never touches the partials: [1, 1, 1, 1] and [1, 1, 1], so its launches pass tiny placeholders
    rather than buffers of the step's size (a 131072-token prefill's would hold 4 GiB); else [S, T, H, 512] and
    [S, T, H]."""
    if num_splits == 1:
        return 1, [1, 1, 1, 1], [1, 1, 1]
    if num_splits != DYNAMIC_SPLITS:
        raise ValueError(f"mla_decode: a kernel is built for 1 split or DYNAMIC_SPLITS ({DYNAMIC_SPLITS}: any count "
                         f"above 1), got {num_splits} (kernel_splits maps a launch's count)")
    splits = T.dynamic("num_splits")
    return splits, [splits, num_tokens, heads, KV_LORA], [splits, num_tokens, heads]


def m_tiles_for(heads: int, max_seqlen_q: int) -> int:
    return -(-max_seqlen_q * heads // BLOCK_M)


def decode_block_m(heads: int, q_bucket: int) -> int:
    """Rows a CTA tile of the engine's decode kernel: 16 when one tile of 16 holds all the (token x head) rows."""
    return SMALL_BLOCK_M if heads * q_bucket <= SMALL_BLOCK_M else BLOCK_M


def combine_splits(heads: int, num_splits, skip_empty_splits: bool = False):
    """The split-KV combine as a TileLang macro (one CTA per (head, token), 128 threads x 4 values), shared by the
    pipelined and the warp-specialized decode kernels: fp32 partial outputs and base-2 LSEs in, the bf16 output and
    the natural-log LSE out. Call it inside a prim_func after the split kernel. ``num_splits``: the count, or the
    factory's ``split_layout`` extent (a run-time size)."""
    H, S, DV = heads, num_splits, KV_LORA
    acc, dtype = T.float32, T.bfloat16

    @T.macro
    def combine(Out, Lse, O_part, Lse_part, num_tokens):
        with T.Kernel(H, num_tokens, threads=128) as (h, t):
            T.pdl_sync()  # PDL (_pdl.py): wait for the previous kernel, then let the next one launch
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
