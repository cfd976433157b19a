"""A decode step's per-token inputs (``decode_inputs``) for Hopper, in TileLang: one launch.

Op contract and reference: backends/cpu/step_inputs.py ``decode_inputs(seqlens_q, seqlens_k, block_tables,
state_slots, first_ids, last_token, drafts, block_size, num_tokens) -> DecodeInputs``; every output (positions,
slot_mapping, cu_seqlens_q, row_of_token, j_of_token, input_ids, draft_next) equals the reference's exactly. Why: on
an H200 a batch-1 decode step ran ~62 tiny launches before its CUDA graph replay (profile_decode.py),
~45 of them the reference's torch ops; this is one launch for those.

Kernel: CTA ``c`` of ``ceil(T / threads)`` owns tokens ``c * threads + tid``. Every CTA scans the B <= MAX_ROWS
query lengths into shared memory (MAX_ROWS / threads consecutive rows a thread, a warp shfl scan, per-warp totals
in shared memory; re-reading B ints from L2 is cheaper than a second launch); CTA 0 writes ``cu_seqlens_q``. A token
finds its row by a branch-free binary search for the largest ``r < B`` with ``cu[r] <= t`` (rows with q = 0 are
skipped as ``repeat_interleave`` skips them), then computes the reference's formulas; ``//`` and ``%`` are TIR
floordiv / floormod, so they agree with torch's floor semantics. The reference's ``drafts[slot, 0]`` read at j = 0
(discarded there) is not made. Batch-1 decode (T <= threads) is one CTA.
Preconditions (no host read checks them): ``num_tokens == seqlens_q.sum()``, ``0 <= seqlens_q <= seqlens_k``, slots
and table entries in range (the reference would fault on what the kernel reads out of bounds).

Checked on an H200: every output equal to the reference on the same CUDA tensors in 18 cases up to 1024 rows /
16384 tokens and a graph replay (tests/kernels_cuda/test_decode_inputs.py); 2.5-3.7 us against the reference's
52-109 us.
"""

import numbers

import torch

from deepinfer_npu.backends.cpu.step_inputs import DecodeInputs

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
THREADS = 256
MAX_ROWS = 1024  # shared cu[MAX_ROWS + 1] int32; the binary search's steps
MAX_TOKENS = 16384


# ---- kernel ----------------------------------------------------------------------------------------------------
@cached_prim_func
def build_decode_inputs(block_size: int = 64, threads: int = THREADS):
    """PrimFunc (Sq [B] i32, Sk [B] i32, Tables [B, W] i32, Slots [B] i64, First [B] i64, Last [S] i64,
    Drafts [S, K] i64, Pos [T] i64, SlotMap [T] i64, Cu [B+1] i32, Row [T] i64, J [T] i64, Ids [T] i64,
    Next [T] i64); grid ceil(T / threads), B <= MAX_ROWS."""
    assert tilelang is not None, "tilelang is not installed"
    BS = int(block_size)
    assert BS >= 1 and threads % 32 == 0 and MAX_ROWS % threads == 0
    R = MAX_ROWS // threads  # scan rows a thread
    NW = threads // 32
    LOG = (MAX_ROWS - 1).bit_length()  # search steps: 2^(LOG-1) + ... + 1 = MAX_ROWS - 1
    i32, i64 = T.int32, T.int64
    B = T.dynamic("num_rows")
    W = T.dynamic("table_width")
    S = T.dynamic("num_slots")
    K = T.dynamic("num_drafts")
    Tn = T.dynamic("num_tokens")

    @T.prim_func
    def decode_inputs_kernel(
        Sq: T.Tensor([B], i32),
        Sk: T.Tensor([B], i32),
        Tables: T.Tensor([B, W], i32),
        Slots: T.Tensor([B], i64),
        First: T.Tensor([B], i64),
        Last: T.Tensor([S], i64),
        Drafts: T.Tensor([S, K], i64),
        Pos: T.Tensor([Tn], i64),
        SlotMap: T.Tensor([Tn], i64),
        Cu: T.Tensor([B + 1], i32),
        Row: T.Tensor([Tn], i64),
        J: T.Tensor([Tn], i64),
        Ids: T.Tensor([Tn], i64),
        Next: T.Tensor([Tn], i64),
    ):
        with T.Kernel(T.ceildiv(Tn, threads), threads=threads) as bx:
            tid = T.get_thread_binding()
            lane = tid % 32
            warp = tid // 32
            s_cu = T.alloc_shared([MAX_ROWS + 1], i32)
            s_warp = T.alloc_shared([NW], i32)
            qs = T.alloc_local([R], i32)
            mine = T.alloc_var(i32)
            incl = T.alloc_var(i32)
            up = T.alloc_var(i32)
            run = T.alloc_var(i32)
            r = T.alloc_var(i32)
            t = T.alloc_var(i32)
            j = T.alloc_var(i64)
            q = T.alloc_var(i64)
            pos = T.alloc_var(i64)
            blk = T.alloc_var(i64)
            block = T.alloc_var(i64)
            slot = T.alloc_var(i64)
            first = T.alloc_var(i64)

            # 1. cu = exclusive scan of the query lengths (rows >= B count 0, so cu[B..MAX_ROWS] = the total)
            mine = 0
            for i in T.unroll(R, explicit=True):
                qs[i] = T.if_then_else(tid * R + i < B, Sq[T.min(tid * R + i, B - 1)], 0)
                mine = mine + qs[i]
            incl = mine
            for d in T.unroll(5, explicit=True):
                up = T.shfl_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            if lane == 31:
                s_warp[warp] = incl
            T.sync_threads()
            run = incl - mine
            for w in T.unroll(NW, explicit=True):
                if w < warp:
                    run = run + s_warp[w]
            for i in T.unroll(R, explicit=True):
                s_cu[tid * R + i] = run
                run = run + qs[i]
            if tid == threads - 1:
                s_cu[MAX_ROWS] = run
            T.sync_threads()
            if bx == 0:
                for it in T.serial(T.ceildiv(B + 1, threads)):
                    if it * threads + tid <= B:
                        Cu[it * threads + tid] = s_cu[it * threads + tid]

            # 2. this thread's token
            t = bx * threads + tid
            if t < Tn:
                r = 0
                for s in T.unroll(LOG, explicit=True):  # largest r < B with cu[r] <= t
                    if r + (1 << (LOG - 1 - s)) < B:
                        if s_cu[r + (1 << (LOG - 1 - s))] <= t:
                            r = r + (1 << (LOG - 1 - s))
                j = T.Cast(i64, t - s_cu[r])
                q = T.Cast(i64, Sq[r])
                pos = T.Cast(i64, Sk[r]) - q + j
                blk = pos // BS
                block = T.int64(0)
                if blk < T.Cast(i64, W):
                    block = T.Cast(i64, Tables[r, T.min(blk, T.Cast(i64, W) - 1)])
                slot = Slots[r]
                Pos[t] = pos
                SlotMap[t] = block * BS + pos % BS
                Row[t] = T.Cast(i64, r)
                J[t] = j
                if j == 0:
                    first = First[r]
                    if first < 0:
                        first = Last[slot]
                    Ids[t] = first
                else:
                    Ids[t] = Drafts[slot, T.min(j - 1, T.Cast(i64, K) - 1)]
                if j + 1 < q:
                    Next[t] = Drafts[slot, T.min(j, T.Cast(i64, K) - 1)]
                else:
                    Next[t] = T.int64(-1)

    return decode_inputs_kernel


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


_CACHE = KernelCache({"decode_inputs": build_decode_inputs}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels  # (kind, cfg) -> compiled kernel


def get_kernel(block_size: int, threads: int = THREADS):
    return _CACHE.get("decode_inputs", (int(block_size), int(threads)))


def precompile(configs):
    """Compile ``(block_size, threads)`` configurations in parallel threads (nvcc runs in subprocesses)."""
    _CACHE.precompile(("decode_inputs", tuple(c)) for c in configs)


CI_CONFIGS = [(64, THREADS), (16, THREADS)]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile([("decode_inputs", tuple(c)) for c in (configs or CI_CONFIGS)], target)


# ---- host side -----------------------------------------------------------------------------------------------
_SPECS = (  # name, dtype, dims
    ("seqlens_q", torch.int32, 1), ("seqlens_k", torch.int32, 1), ("block_tables", torch.int32, 2),
    ("state_slots", torch.int64, 1), ("first_ids", torch.int64, 1), ("last_token", torch.int64, 1),
    ("drafts", torch.int64, 2),
)


def reason(seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts, block_size: int,
           num_tokens: int) -> str | None:
    """None when the kernel takes these operands (host facts only, no GPU needed), else why not."""
    tensors = (seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts)
    for (name, dtype, dims), x in zip(_SPECS, tensors):
        if not isinstance(x, torch.Tensor):
            return f"{name}: {type(x).__name__}, not a tensor"
        if x.dtype != dtype:
            return f"{name}: dtype {x.dtype}, expected {dtype}"
        if x.dim() != dims:
            return f"{name}: shape {tuple(x.shape)}, expected {dims} dims"
        if not x.is_contiguous():
            return f"{name}: not contiguous"
    b, s = seqlens_q.shape[0], last_token.shape[0]
    for name, x in (("seqlens_k", seqlens_k), ("block_tables", block_tables), ("state_slots", state_slots),
                    ("first_ids", first_ids)):
        if x.shape[0] != b:
            return f"{name}: {x.shape[0]} rows, seqlens_q has {b}"
    if drafts.shape[0] != s:
        return f"drafts: {drafts.shape[0]} slots, last_token has {s}"
    if b == 0:
        return "seqlens_q: no rows"
    if b > MAX_ROWS:
        return f"seqlens_q: {b} rows > MAX_ROWS {MAX_ROWS} (the kernel's shared scan)"
    if block_tables.shape[1] == 0:
        return "block_tables: 0 columns"
    if s == 0:
        return "last_token: no slots"
    if drafts.shape[1] == 0:
        return "drafts: 0 columns (the kernel needs K >= 1)"
    if not isinstance(block_size, numbers.Integral) or block_size < 1:
        return f"block_size {block_size!r}: expected a positive int"
    if not isinstance(num_tokens, numbers.Integral) or not 1 <= num_tokens <= MAX_TOKENS:
        return f"num_tokens {num_tokens!r}: kernel handles 1..MAX_TOKENS {MAX_TOKENS}"
    dev = seqlens_q.device
    if dev.type != "cuda":
        return "tensor not on a CUDA device"
    for (name, _d, _n), x in zip(_SPECS, tensors):
        if x.device != dev:
            return f"{name}: on {x.device}, seqlens_q on {dev}"
    return None


def decode_inputs(seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts, block_size: int,
                  num_tokens: int, check: bool = True) -> DecodeInputs:
    """:class:`DecodeInputs` like backends/cpu/step_inputs.py, in one launch; ValueError where :func:`reason`
    refuses the operands (``check=False``: the caller has just asked :func:`reason`, as the CUDA kernel set does)."""
    why = reason(seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts, block_size,
                 num_tokens) if check else None
    if why is not None:
        raise ValueError(f"decode_inputs: {why}")
    b, dev, t = seqlens_q.shape[0], seqlens_q.device, int(num_tokens)
    new = lambda n, dt=torch.int64: torch.empty(n, dtype=dt, device=dev)
    out = DecodeInputs(new(t), new(t), new(b + 1, torch.int32), new(t), new(t), new(t), new(t))
    get_kernel(block_size)(seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts,
                           out.positions, out.slot_mapping, out.cu_seqlens_q, out.row_of_token, out.j_of_token,
                           out.input_ids, out.draft_next)
    return out
