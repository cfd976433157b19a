"""ZOS step correction (``zos_fixup``) for Hopper, in TileLang: one launch.

Op contract: backends/cpu/zos.py ``zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None,
caps=None) -> (seqlens_q, seqlens_k)`` int32. Integer outputs equal the reference's exactly:

- ``seqlens_k -= correction[slot]`` on optimistic rows (int64 arithmetic, then int32 as ``.to(torch.int32)``);
- with ``draft_probs [S, k]`` and ``caps [B]`` (the varlen re-split): each optimistic row ``b`` scores its drafts
  ``i < caps[b]`` by ``cum[b, i] = cumprod(clamp(draft_probs[slot_b], 0, 1))[i]`` (NaN products -> 0); the
  ``num_slots = sum(seqlens_q - 1)`` best scores of all optimistic rows are chosen (descending, ties to the lower
  flat index ``b * k + i``: torch's stable ``argsort``), and row ``b`` verifies ``1 + #chosen`` tokens:
  ``seqlens_k += new_q - seqlens_q``, ``seqlens_q = new_q``.

The rounding of ``cum`` is torch's CUDA ``cumprod`` of the [B, k] fp32 tensor (aten/src/ATen/native/cuda/
ScanUtils.cuh): B > 1 rows run ``tensor_kernel_scan_innermost_dim``, a Sklansky scan (at stage s = 1, 2, 4, ... the
upper half of each 2s-group is multiplied by the last element of its lower half); a single row (numel == k) runs
``cub::DeviceScan::InclusiveScan``, whose first thread holds >= 8 consecutive items and scans them sequentially: a
sequential product for k <= 16 (assumed from CUB's scan agents; the GPU check covers B == 1 with k up to 16). The
kernel computes both and takes the one for the runtime B.

Kernels (no host reads; CUDA-graph capturable):
- ``zos_correct`` (no re-split): one thread per row.
- ``zos_resplit``: one CTA (128 threads for B <= 128, else 1024; ROWS_PER_THREAD rows a thread, compile-time), every
  thread holding its rows' k scores as int32 keys (the fp32 bits of a score in [0, 1]; -1 when not a candidate).
  The cut-off is found without sorting: a 30-step binary search on the key bits for the largest ``thr`` with
  ``#{key >= thr} >= num_slots`` (a block-wide count a step: warp sums, then per-warp partials in shared memory,
  double-buffered), then ``#{key > thr}`` are chosen outright and the ties ``key == thr`` by flat index up to the
  remaining quota (a block exclusive scan of the per-thread tie counts; threads own consecutive rows). The
  reference runs ~20 kernels (index_select, where, sum, clamp, cumprod, nan_to_num, arange, argsort (a segmented
  sort), scatter, ...).

Checked on an H200: both outputs equal to the CPU reference op on the same CUDA tensors
(tests/kernels_cuda/test_zos_fixup_kernel.py).
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
COMPILE_FLAGS = ["--fmad=false"]  # the cumprod's products are plain fp32 multiplies
CORRECT_THREADS = 256
MAX_K = 16  # drafts a row (the re-split's per-thread key array)
MAX_ROWS_PER_THREAD = 4
SEARCH_BITS = 30  # scores are in [0, 1]: fp32 bits <= 0x3F800000 < 2**30


def resplit_launch(rows: int) -> tuple[int, int]:
    """(threads, rows per thread) of the re-split CTA for ``rows`` rows."""
    if rows <= 128:
        return 128, 1
    return 1024, -(-rows // 1024)


# ---- kernels -------------------------------------------------------------------------------------------------
@cached_prim_func
def build_correct(threads: int = CORRECT_THREADS):
    """PrimFunc (Sq [B] i32, Sk [B] i32, Opt [B] u8, Slots [B] i64, Corr [S] i64, SqOut [B] i32, SkOut [B] i32)."""
    assert tilelang is not None, "tilelang is not installed"
    i32, i64, u8 = T.int32, T.int64, T.uint8
    B = T.dynamic("num_rows")
    S = T.dynamic("num_slots")

    @T.prim_func
    def zos_correct(
        Sq: T.Tensor([B], i32),
        Sk: T.Tensor([B], i32),
        Opt: T.Tensor([B], u8),
        Slots: T.Tensor([B], i64),
        Corr: T.Tensor([S], i64),
        SqOut: T.Tensor([B], i32),
        SkOut: T.Tensor([B], i32),
    ):
        with T.Kernel(T.ceildiv(B, threads), threads=threads) as bx:
            tid = T.get_thread_binding()
            fix = T.alloc_var(i64)
            if bx * threads + tid < B:
                fix = T.int64(0)
                if Opt[bx * threads + tid] != T.uint8(0):
                    fix = Corr[Slots[bx * threads + tid]]
                SkOut[bx * threads + tid] = T.Cast(i32, T.Cast(i64, Sk[bx * threads + tid]) - fix)
                SqOut[bx * threads + tid] = Sq[bx * threads + tid]

    return zos_correct


@cached_prim_func
def build_resplit(k: int, threads: int = 128, rows_per_thread: int = 1):
    """PrimFunc (Sq [B] i32, Sk [B] i32, Opt [B] u8, Slots [B] i64, Corr [S] i64, Probs [S, k] f32, Caps [B] i64,
    SqOut [B] i32, SkOut [B] i32); one CTA, B <= threads * rows_per_thread."""
    assert tilelang is not None, "tilelang is not installed"
    K, R = int(k), int(rows_per_thread)
    assert 1 <= K <= MAX_K and 1 <= R <= MAX_ROWS_PER_THREAD and threads % 32 == 0
    NW = threads // 32
    STAGES = max(0, (K - 1).bit_length())  # Sklansky stages s = 1, 2, ..., < K
    f32, i32, i64, u8 = T.float32, T.int32, T.int64, T.uint8
    B = T.dynamic("num_rows")
    S = T.dynamic("num_slots")

    @T.macro
    def block_sum(val, s_part, parity, res, ri, lane, warp):
        """res[ri] = sum of ``val`` over the CTA (one __syncthreads; s_part[parity] is rewritten two calls later,
        after every thread passed the call in between). A macro writes through buffer elements only."""
        res[ri] = T.warp_reduce_sum(val)
        if lane == 0:
            s_part[parity, warp] = res[ri]
        T.sync_threads()
        res[ri] = 0
        for w in T.unroll(NW, explicit=True):
            res[ri] = res[ri] + s_part[parity, w]

    @T.prim_func
    def zos_resplit(
        Sq: T.Tensor([B], i32),
        Sk: T.Tensor([B], i32),
        Opt: T.Tensor([B], u8),
        Slots: T.Tensor([B], i64),
        Corr: T.Tensor([S], i64),
        Probs: T.Tensor([S, K], f32),
        Caps: T.Tensor([B], i64),
        SqOut: T.Tensor([B], i32),
        SkOut: T.Tensor([B], i32),
    ):
        with T.Kernel(1, threads=threads) as _bx:
            tid = T.get_thread_binding()
            lane = tid % 32
            warp = tid // 32
            keys = T.alloc_local([R * K], i32)
            cum = T.alloc_local([K], f32)
            seq = T.alloc_local([K], f32)
            s_part = T.alloc_shared([3, NW], i32)  # rows 0, 1: block sums (alternating); row 2: the tie scan
            res = T.alloc_local([2], i32)  # [0] drafts to re-split (num_slots), [1] a block count
            mine = T.alloc_var(i32)
            thr = T.alloc_var(i32)
            cand = T.alloc_var(i32)
            cnt = T.alloc_var(i32)
            quota = T.alloc_var(i32)
            ties = T.alloc_var(i32)
            incl = T.alloc_var(i32)
            run = T.alloc_var(i32)
            nd = T.alloc_var(i32)
            fix = T.alloc_var(i64)
            p = T.alloc_var(f32)

            # 1. scores of this thread's rows (rows tid*R .. tid*R+R-1) as int32 keys; the drafts to re-split
            mine = 0
            for r in T.unroll(R, explicit=True):
                for i in T.unroll(K, explicit=True):
                    keys[r * K + i] = -1
                if tid * R + r < B:
                    if Opt[tid * R + r] != T.uint8(0):
                        mine = mine + Sq[tid * R + r] - 1
                        for i in T.unroll(K, explicit=True):
                            p = Probs[Slots[tid * R + r], i]
                            cum[i] = T.if_then_else(T.isnan(p), p, T.min(T.max(p, T.float32(0)), T.float32(1)))
                            seq[i] = cum[i]
                        for i in T.unroll(1, K, explicit=True):  # one row (B == 1): cub's sequential scan
                            seq[i] = seq[i - 1] * seq[i]
                        for m in T.unroll(STAGES, explicit=True):  # B > 1: torch's Sklansky scan
                            for ti in T.unroll(K, explicit=True):
                                if (ti >> m) % 2 == 1:
                                    cum[ti] = cum[ti] * cum[((ti >> (m + 1)) << (m + 1)) + (1 << m) - 1]
                        for i in T.unroll(K, explicit=True):
                            p = T.if_then_else(B == 1, seq[i], cum[i])
                            if T.Cast(i64, i) < Caps[tid * R + r]:
                                # nan_to_num(nan=0); -0.0 and +0.0 are one key
                                keys[r * K + i] = T.if_then_else(
                                    T.isnan(p) | (p == T.float32(0)), T.int32(0), T.reinterpret(p, "int32"))
            block_sum(mine, s_part, 0, res, 0, lane, warp)

            # 2. cut-off: the largest thr with #{key >= thr} >= num_slots (thr = 0 when fewer candidates)
            thr = 0
            for bit in T.serial(SEARCH_BITS):  # not unrolled: nvcc time grows fast with R * K * 30
                cand = thr | T.shift_left(1, SEARCH_BITS - 1 - bit)
                mine = 0
                for e in T.unroll(R * K, explicit=True):
                    mine = mine + T.if_then_else(keys[e] >= cand, 1, 0)
                block_sum(mine, s_part, (bit + 1) % 2, res, 1, lane, warp)
                if res[1] >= res[0]:
                    thr = cand
            mine = 0
            ties = 0
            for e in T.unroll(R * K, explicit=True):
                mine = mine + T.if_then_else(keys[e] > thr, 1, 0)
                ties = ties + T.if_then_else(keys[e] == thr, 1, 0)
            block_sum(mine, s_part, (SEARCH_BITS + 1) % 2, res, 1, lane, warp)
            quota = res[0] - res[1]

            # 3. ties before this thread's (in flat order): block exclusive scan of the tie counts
            incl = ties
            for d in T.unroll(5, explicit=True):
                cnt = T.shfl_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + cnt
            if lane == 31:
                s_part[2, warp] = incl
            T.sync_threads()
            run = incl - ties
            for w in T.unroll(NW, explicit=True):
                if w < warp:
                    run = run + s_part[2, w]

            # 4. chosen drafts per row, new lengths
            for r in T.unroll(R, explicit=True):
                nd = 0
                for i in T.unroll(K, explicit=True):
                    if keys[r * K + i] > thr:
                        nd = nd + 1
                    elif keys[r * K + i] == thr:
                        if run < quota:
                            nd = nd + 1
                        run = run + 1
                if tid * R + r < B:
                    fix = T.int64(0)
                    if Opt[tid * R + r] != T.uint8(0):
                        fix = Corr[Slots[tid * R + r]]
                        SkOut[tid * R + r] = T.Cast(
                            i32,
                            T.Cast(i64, Sk[tid * R + r]) - fix - T.Cast(i64, Sq[tid * R + r]) + T.Cast(i64, 1 + nd),
                        )
                        SqOut[tid * R + r] = 1 + nd
                    else:
                        SkOut[tid * R + r] = Sk[tid * R + r]
                        SqOut[tid * R + r] = Sq[tid * R + r]

    return zos_resplit


def _compile(func, target=None):
    return tilelang.compile(
        func, out_idx=None, target=dict(target or SM90_TARGET), compile_flags=list(COMPILE_FLAGS)
    )


_CACHE = KernelCache({"correct": build_correct, "resplit": build_resplit}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels  # (kind, cfg) -> compiled kernel


def get_kernel(kind: str, *cfg):
    return _CACHE.get(kind, cfg)


def precompile(items):
    """Compile (kind, cfg) pairs in parallel threads (nvcc runs in subprocesses)."""
    _CACHE.precompile(items)


CI_CONFIGS = [("correct", ()), ("resplit", (3, 128, 1))]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)


# ---- host side -----------------------------------------------------------------------------------------------
def reason(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None, caps=None) -> str | None:
    """None when :func:`zos_fixup` handles these arguments (host facts only), else why not."""
    b = seqlens_q.shape[0]
    if b == 0:
        return "no rows"
    if seqlens_q.dim() != 1 or seqlens_k.shape != (b,) or optimistic.shape != (b,) or slots.shape != (b,):
        return "row tensors are not [B]"
    if optimistic.dtype != torch.bool:
        return f"optimistic {optimistic.dtype}"
    if correction.dim() != 1 or correction.shape[0] == 0:
        return "correction is not [S]"
    if draft_probs is not None and caps is not None:
        if draft_probs.dim() != 2 or draft_probs.shape[0] != correction.shape[0]:
            return f"draft_probs {tuple(draft_probs.shape)} is not [S, k]"
        k = draft_probs.shape[1]
        if not 1 <= k <= MAX_K:
            return f"{k} drafts a row: re-split kernel handles 1..{MAX_K}"
        if caps.shape != (b,):
            return "caps is not [B]"
        if b > 1024 * MAX_ROWS_PER_THREAD:
            return f"{b} rows > {1024 * MAX_ROWS_PER_THREAD} (one CTA)"
    return None


def _i32(x):
    return x.to(torch.int32).contiguous()


def _i64(x):
    return x.to(torch.int64).contiguous()


def zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None, caps=None):
    """(seqlens_q, seqlens_k) int32 like backends/cpu/zos.py (see :func:`reason` for what is covered)."""
    b = seqlens_q.shape[0]
    dev = seqlens_q.device
    sq_out = torch.empty(b, dtype=torch.int32, device=dev)
    sk_out = torch.empty(b, dtype=torch.int32, device=dev)
    args = [_i32(seqlens_q), _i32(seqlens_k), optimistic.contiguous().view(torch.uint8), _i64(slots),
            _i64(correction)]
    if draft_probs is None or caps is None:
        get_kernel("correct")(*args, sq_out, sk_out)
    else:
        threads, rpt = resplit_launch(b)
        k = draft_probs.shape[1]
        get_kernel("resplit", k, threads, rpt)(*args, draft_probs.float().contiguous(), _i64(caps), sq_out, sk_out)
    return sq_out, sk_out
