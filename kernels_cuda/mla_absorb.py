"""W_UK absorption of one decode token's query, in TileLang: ``q_latent[h] = q_nope[h] @ W_UK[h]``.

Op: the first half of ``mla_prolog``'s absorbed query (docs/interfaces.md §2; backends/cpu/mla.py
``einsum("thn,hnl->thl", q_nope, w_uk)``) for one token: ``q`` [1, H, QD] bf16 (the projected query, its nope
part first), ``w_uk`` [H, N, L] bf16 in the checkpoint's layout (N = qk_nope_head_dim, L = kv_lora_rank) ->
[1, H, L] bf16. fp32 products and sums, rounded once to bf16 (cuBLAS' batched GEMM, the path it replaces, also
accumulates in fp32; the summation order differs, so the result is not bit-identical to it). Tolerance against the
fp32 reference: one bf16 ulp of the reference plus the fp32 reordering bound N * 2^-23 * sum |q * w| (which covers
sums that nearly cancel), NaN / inf at the same positions.

Why: at batch 1 the backend ran this as cuBLAS' batched GEMM (``absorb_heads``: 3.2-3.3 us a layer for 2 MB on an
H200, the 27 ``nvjet ... NNT`` launches of profile_decode.py) and a library kernel ends the programmatic launch
chain of the TileLang kernels around it (kernels_cuda/_pdl.py). Its twin on the output side, W_UV on skinny_gemm's
grouped mode, measured +2.3 / +1.8 % at batch 1 (two A/B pairs, session 7). W_UK's rows are only N = 128 long, too
short for skinny_gemm's one-warp-a-row dot products, so this kernel walks W_UK along L instead: a CTA owns 64
columns of one head, each of its 256 threads 8 adjacent columns (one 16-byte vector a row) of N / 32 rows; it loads
its whole slice of W_UK before it waits for the previous kernel (the weights do not depend on it), then the query,
then sums the 32 row groups through shared memory. Grid: L / 64 x H CTAs (128 for V2-Lite's 16 heads).

Checked on an H200 (session 8): ``--check`` (fp32 reference and cuBLAS) passed, 0-2 bf16 ulp, NaN/inf positions equal,
graph replay; 1.40 us for 16 heads against cuBLAS' 2.73 us, 3.84 against 4.94 us for 128 (graph-timed, weights in
L2). In the engine at batch 1 it raised decode from 433.9 / 428.2 to 449.4 / 449.8 tok/s (A/B/A/B, 9 windows each).

Run alone:  python kernels_cuda/mla_absorb.py --check --bench
"""

import argparse
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
    from ._check import bf16_ulps
    from ._kernel_cache import KernelCache
    from ._pdl import pdl_enabled
except ImportError:  # run as a script: python kernels_cuda/mla_absorb.py
    import _bench
    from _check import bf16_ulps
    from _kernel_cache import KernelCache
    from _pdl import pdl_enabled

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
THREADS = 256
VEC = 8  # bf16 columns a thread: one 16-byte vector of a W_UK row
COLS = 64  # columns of L a CTA
LANES = COLS // VEC  # threads sharing one W_UK row (8 x 16 bytes = one 128-byte segment)
GROUPS = THREADS // LANES  # row groups a CTA (32)


def supported(heads: int, nope: int, lrank: int, q_dim: int) -> str | None:
    """None when the kernel is built for these dims, else why not."""
    if heads < 1 or nope % GROUPS or nope < GROUPS:
        return f"qk_nope_head_dim {nope}: the kernel splits the rows into {GROUPS} groups"
    if lrank % COLS:
        return f"kv_lora_rank {lrank}: a multiple of {COLS} columns"
    if q_dim < nope:
        return f"query width {q_dim} < qk_nope_head_dim {nope}"
    return None


def build_absorb(heads: int, nope: int, lrank: int, q_dim: int):
    """PrimFunc: (Q [1, H, QD], W [H, N, L], Out [1, H, L]) for compile-time dims."""
    assert tilelang is not None, "tilelang is not installed"
    assert supported(heads, nope, lrank, q_dim) is None, supported(heads, nope, lrank, q_dim)
    PDL = pdl_enabled()
    H, N, L, QD = heads, nope, lrank, q_dim
    RPT = N // GROUPS  # W_UK rows a thread
    f32, bf16 = T.float32, T.bfloat16

    @T.prim_func
    def mla_absorb(Q: T.Tensor([1, H, QD], bf16), W: T.Tensor([H, N, L], bf16), Out: T.Tensor([1, H, L], bf16)):
        with T.Kernel(L // COLS, H, threads=THREADS) as (bx, h):
            tid = T.get_thread_binding()
            lane = tid % LANES
            grp = tid // LANES
            col0 = bx * COLS + lane * VEC
            w = T.alloc_local([RPT * VEC], bf16)
            acc = T.alloc_local([VEC], f32)
            part = T.alloc_shared([GROUPS, COLS], f32)
            for i in T.unroll(RPT, explicit=True):  # every weight load first: none depends on earlier kernels
                for v in T.vectorized(VEC):
                    w[i * VEC + v] = W[h, grp * RPT + i, col0 + v]
            if PDL:  # _pdl.py: wait for the kernel that wrote Q, then let the next one launch
                T.pdl_sync()
                T.pdl_trigger()
            for v in T.unroll(VEC, explicit=True):
                acc[v] = T.float32(0)
            for i in T.unroll(RPT, explicit=True):
                qn = T.Cast(f32, Q[0, h, grp * RPT + i])
                for v in T.unroll(VEC, explicit=True):
                    acc[v] = acc[v] + qn * T.Cast(f32, w[i * VEC + v])
            for v in T.unroll(VEC, explicit=True):
                part[grp, lane * VEC + v] = acc[v]
            T.sync_threads()
            if tid < COLS:  # one thread a column sums the row groups in a fixed order
                s = T.alloc_local([1], f32)
                s[0] = T.float32(0)
                for g in T.serial(GROUPS):
                    s[0] = s[0] + part[g, tid]
                Out[0, h, bx * COLS + tid] = T.Cast(bf16, s[0])

    return mla_absorb


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


_CACHE = KernelCache({"absorb": build_absorb}, _compile, available=tilelang is not None)


def config_for(heads: int, nope: int, lrank: int, q_dim: int) -> tuple:
    """The cache key of the kernel :func:`absorb_q` launches."""
    return (int(heads), int(nope), int(lrank), int(q_dim))


def get_kernel(*cfg):
    return _CACHE.get("absorb", tuple(cfg))


def precompile(configs):
    """Compile ``config_for`` tuples in parallel threads (nvcc subprocesses)."""
    _CACHE.precompile(("absorb", tuple(c)) for c in configs)


CI_CONFIGS = [("absorb", (16, 128, 512, 192)), ("absorb", (128, 128, 512, 192))]  # V2-Lite, V3


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)


def reason(q: torch.Tensor, w_uk: torch.Tensor) -> str | None:
    """None when :func:`absorb_q` takes these operands (``q`` [1, H, QD], ``w_uk`` [H, N, L]), else why not."""
    if not (q.is_cuda and w_uk.is_cuda):
        return "tensor not on a CUDA device"
    if q.dtype != torch.bfloat16 or w_uk.dtype != torch.bfloat16:
        return f"q {q.dtype}, w_uk {w_uk.dtype}: the kernel is bf16-only"
    if q.dim() != 3 or q.shape[0] != 1 or w_uk.dim() != 3 or q.shape[1] != w_uk.shape[0]:
        return f"q {list(q.shape)}, w_uk {list(w_uk.shape)}: one token's [1, H, QD] against [H, N, L]"
    why = supported(w_uk.shape[0], w_uk.shape[1], w_uk.shape[2], q.shape[2])
    if why is not None:
        return why
    if not (q.is_contiguous() and w_uk.is_contiguous()) or w_uk.data_ptr() % 16:
        return f"contiguous q={q.is_contiguous()}, w_uk={w_uk.is_contiguous()}: 16-byte weight vectors needed"
    return None


def absorb_q(q: torch.Tensor, w_uk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` [1, H, QD] (nope part first) x ``w_uk`` [H, N, L] -> [1, H, L] bf16; one launch, no host sync."""
    why = reason(q, w_uk)
    if why is not None:
        raise ValueError(f"mla_absorb: {why}")
    h, n, lrank = w_uk.shape
    if out is None:
        out = torch.empty(1, h, lrank, dtype=q.dtype, device=q.device)
    get_kernel(*config_for(h, n, lrank, q.shape[2]))(q, w_uk, out)
    return out


# ---- reference and checks -------------------------------------------------------------------------------------
def absorb_ref(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """fp32 reference: ``einsum("thn,hnl->thl")`` on the nope part, fp32 throughout (rounded by the caller)."""
    return torch.einsum("thn,hnl->thl", q[..., : w_uk.shape[1]].float(), w_uk.float())


def absorb_cublas(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The path this kernel replaces: the backend's ``absorb_heads`` (cuBLAS' batched GEMM over the heads)."""
    return torch.bmm(q[..., : w_uk.shape[1]].transpose(0, 1), w_uk).view(1, q.shape[1], w_uk.shape[2])


def make_inputs(heads, nope=128, lrank=512, q_dim=192, seed=0, special=False, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(1, heads, q_dim, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(heads, nope, lrank, generator=g) * 0.05).to(torch.bfloat16)
    if special:
        q[0, 0, 3] = float("nan")  # head 0: every column NaN
        w[1, 5, 7] = float("inf")  # head 1, column 7: inf (or NaN with a 0 query entry)
        q[0, 2, : nope // 2] = 0  # head 2: half the rows contribute nothing
    return q.to(device), w.to(device)


CHECK_CASES = [(16, 128, 512, 192, False), (16, 128, 512, 192, True), (128, 128, 512, 192, False),
               (1, 128, 512, 192, False), (8, 64, 256, 96, True), (16, 128, 512, 128, False)]


def within_tolerance(out: torch.Tensor, q: torch.Tensor, w_uk: torch.Tensor) -> tuple[bool, dict]:
    """The module docstring's tolerance, with NaN / inf positions compared; -> (ok, stats)."""
    ref32 = absorb_ref(q, w_uk)
    ref = ref32.to(torch.bfloat16)
    same_nan = torch.equal(torch.isnan(out), torch.isnan(ref))
    same_inf = torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = torch.isfinite(ref)
    bound = torch.einsum("thn,hnl->thl", q[..., : w_uk.shape[1]].float().abs(), w_uk.float().abs())
    tol = ref32.abs() * 2.0**-7 + w_uk.shape[1] * 2.0**-23 * bound
    err = (out.float() - ref32).abs()
    within = bool((err[finite] <= tol[finite]).all()) if finite.any() else True
    ulps = float(bf16_ulps(out[finite], ref[finite]).max()) if finite.any() else 0.0
    stats = dict(ulps=ulps, within=within, same_nan=same_nan, same_inf=same_inf)
    return same_nan and same_inf and within, stats


def check_case(heads, nope, lrank, q_dim, special=False, seed=0, verbose=True):
    """:func:`within_tolerance` of the fp32 reference, the output poisoned with NaN first; also reports the distance
    to cuBLAS' batched GEMM in bf16 ulps."""
    q, w = make_inputs(heads, nope, lrank, q_dim, seed, special)
    out = torch.full((1, heads, lrank), float("nan"), dtype=torch.bfloat16, device="cuda")
    absorb_q(q, w, out=out)
    torch.cuda.synchronize()
    ok, stats = within_tolerance(out, q, w)
    ulps, same_nan, same_inf = stats["ulps"], stats["same_nan"], stats["same_inf"]
    vs_cublas = absorb_cublas(q, w)
    cfin = torch.isfinite(vs_cublas) & torch.isfinite(out)
    ulps_cublas = float(bf16_ulps(out[cfin], vs_cublas[cfin]).max()) if cfin.any() else 0.0
    if verbose:
        print(f"check H={heads} N={nope} L={lrank} QD={q_dim} special={special}: {'PASS' if ok else 'FAIL'} "
              f"(max {ulps} ulp vs fp32 ref, {ulps_cublas} vs cuBLAS, NaN same {same_nan}, inf same {same_inf})",
              flush=True)
    return ok, dict(stats, ulps_cublas=ulps_cublas)


def check_graph(heads=16, verbose=True):
    """Captured once, replayed on a new query: the result follows the new input."""
    q, w = make_inputs(heads, seed=5)
    out = torch.empty(1, heads, 512, dtype=torch.bfloat16, device="cuda")
    absorb_q(q, w, out=out)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        absorb_q(q, w, out=out)
    q.copy_(make_inputs(heads, seed=6)[0])
    gr.replay()
    torch.cuda.synchronize()
    ok, _stats = within_tolerance(out, q, w)
    if verbose:
        print(f"check graph capture + replay: {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def run_checks(verbose=True):
    oks = [check_case(*c, seed=i, verbose=verbose)[0] for i, c in enumerate(CHECK_CASES)]
    return all(oks) and check_graph(verbose=verbose)


def bench_case(heads, nope=128, lrank=512, q_dim=192, copy_gbps=None):
    q, w = make_inputs(heads, nope, lrank, q_dim)
    out = torch.empty(1, heads, lrank, dtype=torch.bfloat16, device="cuda")
    us, timing = _bench.time_us(lambda: absorb_q(q, w, out=out))
    us_cublas, _t = _bench.time_us(lambda: absorb_cublas(q, w))
    nbytes = w.numel() * 2
    row = {"bench": "mla_absorb", "hardware": torch.cuda.get_device_name(), "heads": heads, "nope": nope,
           "lrank": lrank, "us": round(us, 2), "cublas_us": round(us_cublas, 2),
           "speedup_vs_cublas": round(us_cublas / us, 3), "bytes": nbytes,
           "timing": f"{timing} (20 launches a replay: the 2-16 MB of weights stay in L2, for both paths)"}
    if copy_gbps:
        row.update(copy_GBps=round(copy_gbps, 1), frac_of_copy=round(nbytes / (us * 1e-6) / 1e9 / copy_gbps, 3))
    return row


def main(argv=None):
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", help="append the --bench rows (JSON lines) here")
    args = ap.parse_args(argv)
    _bench.exit_without_cuda(args)
    if args.compile_only:
        t = time.time()
        ci_compile()
        print(f"compiled {len(CI_CONFIGS)} configurations in {time.time() - t:.1f}s")
    ok = True
    if args.check or args.bench:
        t = time.time()
        precompile([config_for(h, n, lr, qd) for h, n, lr, qd, _s in CHECK_CASES])
        print(f"compiled in {time.time() - t:.1f}s", flush=True)
    if args.check:
        ok = run_checks()
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.bench:
        cb = _bench.copy_gbps()
        for heads in (16, 128):
            row = bench_case(heads, copy_gbps=cb)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
