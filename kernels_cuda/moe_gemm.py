"""Grouped expert GEMM for MoE decode (bf16, Hopper), in TileLang: ``out[rows of e] = a[rows of e] @ w[e]^T``.

Op: the two GEMMs of ``grouped_mlp`` (docs/interfaces.md §2): ``a`` [M, K] bf16 holds the dispatched rows sorted by
expert (``moe_dispatch``), ``tokens_per_expert`` [E] the row count of each expert, ``w`` [E, N, K] bf16 the
experts' weights (the checkpoint's ``[out, in]`` layout). Result [M, N] bf16, fp32 accumulation.

Why a kernel of our own: on decode each expert holds a handful of rows (1 token at batch 1, ~6 at batch 64 for
64 experts / top-6), so the step is a stream over the weights of the experts that were hit. CUTLASS's grouped GEMM
(``torch._grouped_mm``) ran at ~45 % of the copy bandwidth at batch 1 (37 + 26 us per V2-Lite layer for 104 MB) on
an H200. Here one CTA owns one (N tile, expert): it reads the expert's row range from the exclusive scan of the
counts (device values, no host sync, CUDA-graph capturable), exits at once when the expert got no row, and
otherwise streams its [BLOCK_N, K] weight tile through a multi-stage pipeline into wgmma with the rows padded
to BLOCK_M = 64 (the wgmma minimum; compute is free here, bytes are not). Experts with more than 64 rows loop
over row blocks (prefill-sized batches should use the library GEMM: the backend routes by the host row count).

Run alone:  python kernels_cuda/moe_gemm.py --check --bench
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

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
BLOCK_M, BLOCK_K = 64, 64


def build_moe_gemm(n: int, k: int, block_n: int = 128, num_stages: int = 3, threads: int = 128):
    """PrimFunc for weights [E, n, k]; rows M and experts E are dynamic. n % block_n == 0, k % BLOCK_K == 0."""
    assert tilelang is not None, "tilelang is not installed"
    assert n % block_n == 0 and k % BLOCK_K == 0, (n, k, block_n)
    N, K, BM, BN, BK = n, k, BLOCK_M, block_n, BLOCK_K
    dtype, acc = T.bfloat16, T.float32
    M = T.dynamic("num_rows")
    E = T.dynamic("num_experts")
    E1 = T.dynamic("num_experts_plus_1")

    @T.prim_func
    def moe_gemm(
        A: T.Tensor([M, K], dtype),
        W: T.Tensor([E, N, K], dtype),
        starts: T.Tensor([E1], T.int32),  # exclusive scan of the per-expert row counts, starts[E] == M
        Out: T.Tensor([M, N], dtype),
    ):
        with T.Kernel(N // BN, E, threads=threads) as (bn, e):
            A_s = T.alloc_shared([BM, BK], dtype)
            B_s = T.alloc_shared([BN, BK], dtype)
            C = T.alloc_fragment([BM, BN], acc)
            row0 = starts[e]
            cnt = starts[e + 1] - row0
            for mb in T.serial(T.ceildiv(cnt, BM)):
                T.clear(C)
                for kk in T.Pipelined(K // BK, num_stages=num_stages):
                    for i, j in T.Parallel(BM, BK):  # rows past this expert's range read as zero
                        A_s[i, j] = T.if_then_else(
                            mb * BM + i < cnt, A[row0 + mb * BM + i, kk * BK + j], T.cast(0, dtype)
                        )
                    T.copy(W[e, bn * BN : (bn + 1) * BN, kk * BK : (kk + 1) * BK], B_s)
                    T.gemm(A_s, B_s, C, transpose_B=True)
                for i, j in T.Parallel(BM, BN):
                    if mb * BM + i < cnt:
                        Out[row0 + mb * BM + i, bn * BN + j] = T.cast(C[i, j], dtype)

    return moe_gemm


_KERNELS: dict = {}


def pick_block_n(n: int, rows: int) -> int:
    """Host heuristic. Measured on an H200 (V2-Lite experts, 1 / 16 / 64 tokens x top-6): BLOCK_N 128 with 3
    stages was within 5 % of the best variant everywhere; 64 only where N is not a multiple of 128."""
    return 128 if n % 128 == 0 else 64


def supported(n: int, k: int) -> bool:
    return n % 64 == 0 and k % BLOCK_K == 0


def get_kernel(n: int, k: int, block_n: int, num_stages: int = 3):
    key = (n, k, block_n, num_stages)
    if key not in _KERNELS:
        func = build_moe_gemm(n, k, block_n, num_stages)
        _KERNELS[key] = tilelang.compile(func, out_idx=None, target=dict(SM90_TARGET))
    return _KERNELS[key]


def expert_starts(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Exclusive scan of the per-expert row counts, int32 [E + 1] (shared by the two GEMMs of one MLP)."""
    e = tokens_per_expert.shape[0]
    starts = torch.zeros(e + 1, dtype=torch.int32, device=tokens_per_expert.device)
    torch.cumsum(tokens_per_expert, 0, out=starts[1:])
    return starts


def moe_gemm(a: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, out: torch.Tensor | None = None,
             block_n: int | None = None, num_stages: int = 3, starts: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] rows sorted by expert x [E, N, K] -> [M, N] bf16 (no host read of device values). ``starts``: the
    :func:`expert_starts` of ``tokens_per_expert`` when the caller already has it."""
    m, k = a.shape
    e, n, k2 = w.shape
    if k2 != k:
        raise ValueError(f"moe_gemm: a has K={k} but w is [E={e}, N={n}, K={k2}]")
    if tokens_per_expert.shape[0] != e:
        raise ValueError(f"moe_gemm: tokens_per_expert has {tokens_per_expert.shape[0]} entries for {e} experts")
    if starts is None:
        starts = expert_starts(tokens_per_expert)
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    kern = get_kernel(n, k, block_n or pick_block_n(n, m), num_stages)
    kern(a.contiguous(), w, starts, out)
    return out


def moe_gemm_ref(a: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """fp32 reference: per expert, rows @ w[e]^T."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for e, c in enumerate(tokens_per_expert.tolist()):
        if c:
            out[start : start + c] = a[start : start + c].float() @ w[e].float().t()
        start += c
    return out


CI_CONFIGS = [(2816, 2048, 128), (2048, 1408, 64)]  # V2-Lite w13 / w2


def ci_compile(configs=None):
    """Compile representative configurations for sm_90a (no GPU, no cache); see tests/kernels_cuda."""
    import concurrent.futures as cf

    funcs = [build_moe_gemm(*c) for c in (configs or CI_CONFIGS)]  # parse on this thread (ast is not thread-safe)

    def one(func):
        return tilelang.compile(func, out_idx=None, target=dict(SM90_TARGET))

    with cf.ThreadPoolExecutor(len(funcs)) as ex:
        return list(ex.map(one, funcs))


def _problem(tokens: int, top_k: int, experts: int, n: int, k: int, seed: int = 0, skew: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if skew:  # every token picks expert 0 first: one expert with many rows (row-block loop), many empty
        ids = torch.stack([torch.zeros(tokens, dtype=torch.long, device="cuda")]
                          + [torch.randint(1, experts, (tokens,), generator=g, device="cuda")
                             for _ in range(top_k - 1)], 1)
    else:
        ids = torch.stack([torch.randperm(experts, generator=g, device="cuda")[:top_k] for _ in range(tokens)])
    counts = torch.bincount(ids.flatten(), minlength=experts)
    m = tokens * top_k
    a = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(experts, n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    return a, w, counts


def check() -> bool:
    """Against the fp32 reference: bf16 output within 2 bf16 ulp of |ref| + 1e-2 abs; NaN positions equal."""
    ok = True
    cases = [(1, 6, 64, 2816, 2048, False), (1, 6, 64, 2048, 1408, False), (7, 6, 64, 2816, 2048, False),
             (64, 6, 64, 2048, 1408, False), (64, 6, 64, 2816, 2048, True), (5, 8, 256, 4096, 7168, False),
             (200, 2, 16, 256, 512, True)]
    for tokens, top_k, experts, n, k, skew in cases:
        a, w, counts = _problem(tokens, top_k, experts, n, k, skew=skew)
        ref = moe_gemm_ref(a, w, counts)
        for bn in (64, 128) if n % 128 == 0 else (64,):
            out = moe_gemm(a, w, counts, block_n=bn).float()
            err = (out - ref).abs()
            tol = 2 * 2.0**-8 * ref.abs() + 1e-2
            bad = int((err > tol).sum())
            nan_ok = bool(torch.equal(torch.isnan(out), torch.isnan(ref)))
            cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
            good = bad == 0 and nan_ok and cos > 0.99999
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} tokens={tokens} k={top_k} E={experts} N={n} K={k} skew={skew} "
                  f"BN={bn}: max err {err.max().item():.3e}, {bad} beyond tol, cos {cos:.7f}")
    return ok


def bench(out=None):
    """Bytes of the experts hit / time, vs torch._grouped_mm and the copy bandwidth measured here (JSON lines)."""
    import json

    def timed(fn, iters=50):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters

    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(20):  # let the clocks ramp up (an idle H200 sits at 345 MHz SM clock)
        y.copy_(x)
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        y.copy_(x)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    copy_bw = 2 * x.numel() * 2 / sorted(times)[len(times) // 2]  # bytes read + written per second
    del x, y
    rows = []
    for tokens in (1, 16, 64):
        for n, k, name in ((2816, 2048, "w13"), (2048, 1408, "w2")):
            a, w, counts = _problem(tokens, 6, 64, n, k)
            hit = int((counts > 0).sum())
            nbytes = hit * n * k * 2 + a.numel() * 2 + a.shape[0] * n * 2
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            t_ref = timed(lambda a=a, w=w, offs=offs: torch._grouped_mm(a, w.transpose(1, 2), offs=offs))
            for bn in (64, 128):
                for stages in (3, 4):
                    o = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device="cuda")
                    def run(a=a, w=w, c=counts, o=o, bn=bn, st=stages):
                        return moe_gemm(a, w, c, out=o, block_n=bn, num_stages=st)

                    t = timed(run)
                    row = {"bench": "moe_gemm", "hardware": torch.cuda.get_device_name(), "shape": "v2-lite-" + name,
                           "tokens": tokens, "experts_hit": hit, "N": n, "K": k, "block_n": bn, "stages": stages,
                           "us": round(t * 1e6, 2), "GBps": round(nbytes / t / 1e9, 1),
                           "frac_of_copy": round(nbytes / t / copy_bw, 4),
                           "grouped_mm_us": round(t_ref * 1e6, 2), "speedup_vs_grouped_mm": round(t_ref / t, 3),
                           "copy_GBps": round(copy_bw / 1e9, 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    status = 0
    if args.check:
        status |= 0 if check() else 1
    if args.bench:
        bench(args.out)
    sys.exit(status)
