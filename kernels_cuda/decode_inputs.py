"""A decode step's per-token inputs (``decode_inputs``) for Hopper, in TileLang: one launch.

Op contract and reference: backends/cpu/step_inputs.py ``decode_inputs(seqlens_q, seqlens_k, block_tables,
state_slots, first_ids, last_token, drafts, block_size, num_tokens) -> DecodeInputs``; every output (positions,
slot_mapping, cu_seqlens_q, row_of_token, j_of_token, input_ids, draft_next) equals the reference's exactly. Why: on
an H200 a batch-1 decode step ran ~62 tiny launches before its CUDA graph replay (profile_decode.py, session 6),
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

Verified: ``--check`` below compares every output with the reference on the same CUDA tensors (passed on an H200,
session 7: 18 cases up to 1024 rows / 16384 tokens and a graph replay; ``--bench`` 2.5-3.7 us against 52-109 us).
CI compiles it for sm_90a and sm_100a (tests/kernels_cuda/test_compile.py).

Run alone:  python kernels_cuda/decode_inputs.py --check --bench
"""

import argparse
import numbers
import os
import sys
import time

import torch

try:
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover
    tilelang = None
    T = None

try:
    from . import _bench
    from ._kernel_cache import KernelCache
except ImportError:  # run as a script: python kernels_cuda/decode_inputs.py
    import _bench
    from _kernel_cache import KernelCache


def _ensure_repo_on_path():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


_ensure_repo_on_path()
from deepinfer_npu.backends.cpu.step_inputs import DecodeInputs  # noqa: E402
from deepinfer_npu.backends.cpu.step_inputs import decode_inputs as decode_inputs_ref  # noqa: E402

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
THREADS = 256
MAX_ROWS = 1024  # shared cu[MAX_ROWS + 1] int32; the binary search's steps
MAX_TOKENS = 16384


# ---- kernel ----------------------------------------------------------------------------------------------------
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


# ---- checks ----------------------------------------------------------------------------------------------------
def make_problem(rows, q_lo, q_hi, k, block_size=64, short_tables=False, neg_first=0.3, zero_rows=0.0, seed=0,
                 device="cuda"):
    """Operands as the worker passes them; returns (args, block_size, num_tokens). ``short_tables``: the tables
    are narrower than the longest context needs (positions past them map to block 0); ``zero_rows``: that fraction
    of rows has q = 0 (row 0 keeps q >= 1, so T >= 1); ``neg_first``: fraction of first_ids that are -1."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * rows + 3
    q = torch.randint(q_lo, q_hi + 1, (rows,), generator=g)
    q[torch.rand(rows, generator=g) < zero_rows] = 0
    q[0] = max(int(q[0]), 1)
    sk = q + torch.randint(0, 5000, (rows,), generator=g)
    w = -(-int(sk.max()) // block_size)
    w = max(1, w // 3) if short_tables else w
    tables = torch.randint(0, 1 << 20, (rows, w), generator=g, dtype=torch.int32)
    slots = torch.randperm(s, generator=g)[:rows]
    first = torch.randint(0, 1 << 17, (rows,), generator=g)
    first[torch.rand(rows, generator=g) < neg_first] = -1
    last = torch.randint(0, 1 << 17, (s,), generator=g)
    drafts = torch.randint(0, 1 << 17, (s, k), generator=g)
    args = [q.int(), sk.int(), tables, slots, first, last, drafts]
    return [x.to(device) for x in args], block_size, int(q.sum())


# (name, rows, q_lo, q_hi, k, block_size, short_tables, neg_first, zero_rows)
CHECK_CASES = [
    ("batch-1 decode, no drafts", 1, 1, 1, 1, 64, False, 0.0, 0.0),
    ("batch-1, first unknown", 1, 1, 1, 1, 64, False, 1.0, 0.0),
    ("batch-1 verify q=4", 1, 4, 4, 3, 64, False, 0.5, 0.0),
    ("B=64 q=1", 64, 1, 1, 3, 64, False, 0.3, 0.0),
    ("B=64 q 1..6 K=5", 64, 1, 6, 5, 64, False, 0.3, 0.0),
    ("B=64 q 0..6 K=5 bs16", 64, 1, 6, 5, 16, False, 0.3, 0.3),
    ("B=37 short tables bs16", 37, 1, 6, 5, 16, True, 0.5, 0.1),
    ("B=50 short tables bs64", 50, 1, 4, 3, 64, True, 0.0, 0.0),
    ("K=1 with q up to 4", 8, 1, 4, 1, 64, False, 0.3, 0.0),
    ("mostly empty rows", 300, 1, 3, 2, 64, False, 0.3, 0.95),
    ("B=MAX_ROWS q 1..4", MAX_ROWS, 1, 4, 3, 64, False, 0.3, 0.0),
    ("B=MAX_ROWS q 0..16 bs16", MAX_ROWS, 0, 16, 15, 16, True, 0.3, 0.2),
    ("B=MAX_ROWS T=MAX_TOKENS", MAX_ROWS, 16, 16, 15, 64, False, 0.3, 0.0),
]


def check_case(name, *case, seed=0, verbose=True):
    args, bs, t = make_problem(*case, seed=seed)
    out = decode_inputs(*args, bs, t)
    ref = decode_inputs_ref(*args, bs, t)
    torch.cuda.synchronize()
    bad = [f for f, a, b in zip(DecodeInputs._fields, out, ref) if not (a.dtype == b.dtype and torch.equal(a, b))]
    if verbose:
        print(f"check decode_inputs {name:28s} B={case[0]:4d} T={t:5d}: {'PASS' if not bad else 'FAIL ' + str(bad)}",
              flush=True)
    return not bad


def check_graph(verbose=True):
    """Captured in a CUDA graph, replayed on new lengths / slot state (same T)."""
    args, bs, t = make_problem(64, 1, 6, 5, seed=9)
    decode_inputs(*args, bs, t)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = decode_inputs(*args, bs, t)
    new, _, _ = make_problem(64, 1, 6, 5, seed=10)
    q = args[0][torch.randperm(64, device=args[0].device)]  # same total (T is baked in): a re-split
    args[1].copy_(q + new[1] - new[0])  # context lengths >= query lengths
    args[0].copy_(q)
    for i in (3, 4, 5, 6):  # slots, first ids, slot state
        args[i].copy_(new[i])
    gr.replay()
    ref = decode_inputs_ref(*args, bs, t)
    ok = all(torch.equal(a, b) for a, b in zip(out, ref))
    if verbose:
        print(f"check graph capture + replay: {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def check() -> bool:
    t0 = time.time()
    precompile({(c[5], THREADS) for c in CHECK_CASES})
    print(f"compiled {len(_KERNELS)} configurations in {time.time() - t0:.1f}s", flush=True)
    ok = True
    for i, c in enumerate(CHECK_CASES):
        for seed in (0, 1):
            ok &= check_case(*c, seed=100 * i + seed)
    return check_graph() and ok


# ---- benchmark -------------------------------------------------------------------------------------------------
BENCH_SHAPES = [(1, 1, 1), (1, 4, 3), (64, 1, 3), (64, 4, 3), (256, 4, 3), (1024, 4, 3)]  # rows, q, drafts


def bench_case(rows, q, k):
    args, bs, t = make_problem(rows, q, q, k, seed=1)
    tk, how = _bench.time_us(lambda: decode_inputs(*args, bs, t))
    tr, how_r = _bench.time_us(lambda: decode_inputs_ref(*args, bs, t))
    return {"bench": "decode_inputs", "hardware": torch.cuda.get_device_name(), "rows": rows, "q": q, "k": k,
            "tokens": t, "kernel_us": round(tk, 2), "reference_us": round(tr, 2), "speedup": round(tr / tk, 2),
            "timing": how, "timing_ref": how_r}


def main(argv=None):
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None, help="append the --bench JSON lines here")
    args = ap.parse_args(argv)
    _bench.exit_without_cuda(args)
    if args.compile_only:
        t = time.time()
        ci_compile()
        print(f"compiled {len(CI_CONFIGS)} configurations in {time.time() - t:.1f}s")
    ok = True
    if args.check:
        ok = check()
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.bench:
        precompile([(64, THREADS)])
        for c in BENCH_SHAPES:
            row = json.dumps(bench_case(*c))
            print(row, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(row + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
