"""Fused SwiGLU activation ``silu(x[:, :I]) * x[:, I:]`` for Hopper, in TileLang.

Op contract: docs/interfaces.md §2 ``silu_and_mul(x) -> y``; x [T, 2I] = [gate | up] bf16 -> y [T, I] bf16.
Semantics follow the CPU reference (backends/cpu/linear.py ``F.silu(gate) * up``) as torch runs it on bf16
CUDA tensors: silu in fp32 and rounded to bf16 (torch's kernel: ``x / (1 + expf(-x))``, precise expf and IEEE
division), then the product in fp32 and rounded to bf16:
  y = bf16(float(bf16(g / (1 + exp(-g)))) * float(u))
Compiled without fast math, so expf and the division are the same precise CUDA math-library functions torch
uses: bit-exact to the composed path is expected.

Kernel: grid (ceil(T / BM), I / BN), 128 threads; a CTA moves one [BM, BN] tile of gate and of up, BN the
largest of 256 .. 8 dividing I. Two variants, picked on the host from T (no device value):
  - "tile" (T > SMALL_ROWS): BM * BN = 2048 values, 16 a thread, 16-byte vector loads and stores; rows past T
    are masked by TileLang's bounds checks. Memory-bound: bytes = T * I * 2 * 3 (0.90-0.99 of copy from 4K rows).
  - "row" (T <= SMALL_ROWS, decode): BM = 1, one row per CTA, no masked rows, T * I / BN CTAs. On an H200 the
    masked 2048-value tile took 3.6 us at 1-6 rows (2.1 us at 16) and the row variant 1.2-1.8 us up to 64 rows,
    but 3.9 us at 384 rows (vs 2.6), hence the switch.

Run alone:  python kernels_cuda/silu_mul.py --check --bench
"""

import argparse
import functools
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
    from ._ast_guard import compile_pool
except ImportError:  # run as a script from kernels_cuda/
    from _ast_guard import compile_pool

try:
    from . import _bench
    from ._check import bf16_ulps
    from ._pdl import pdl_enabled
except ImportError:  # run as a script: python kernels_cuda/silu_mul.py
    import _bench
    from _check import bf16_ulps
    from _pdl import pdl_enabled

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}

TILE = 2048  # values of gate (and of up) per CTA ("tile" variant)
SMALL_ROWS = 128  # at most this many rows: the "row" variant (BM = 1)
THREADS = 128
MULT = 8  # I must be a multiple of this (16-byte vectors never straddle gate/up or rows)


def supported(inter: int) -> bool:
    return inter > 0 and inter % MULT == 0


def tile_for(inter: int, row_variant: bool = False) -> tuple[int, int]:
    """(BM, BN): BN the largest power of two in 8..256 dividing I; BM = 1 for the row variant, else TILE // BN."""
    assert supported(inter), f"I={inter}: need a multiple of {MULT}"
    bn = next(b for b in (256, 128, 64, 32, 16, 8) if inter % b == 0)
    return (1 if row_variant else TILE // bn), bn


def build_silu_mul(inter: int, row_variant: bool = False, threads: int = THREADS):
    """PrimFunc for I = ``inter`` (compile-time); the number of rows is dynamic."""
    assert tilelang is not None, "tilelang is not installed"
    PDL = pdl_enabled()
    I = inter  # noqa: E741
    BM, BN = tile_for(I, row_variant)
    dtype, acc = T.bfloat16, T.float32
    M = T.dynamic("num_rows")

    @T.prim_func
    def silu_mul(X: T.Tensor([M, 2 * I], dtype), Y: T.Tensor([M, I], dtype)):
        with T.Kernel(T.ceildiv(M, BM), I // BN, threads=threads) as (bm, bn):
            if PDL:  # _pdl.py: wait for the previous kernel, then let the next one launch
                T.pdl_sync()
                T.pdl_trigger()
            g = T.alloc_fragment([BM, BN], dtype)
            u = T.alloc_fragment([BM, BN], dtype)
            y = T.alloc_fragment([BM, BN], dtype)
            T.copy(X[bm * BM : (bm + 1) * BM, bn * BN : (bn + 1) * BN], g)
            T.copy(X[bm * BM : (bm + 1) * BM, I + bn * BN : I + (bn + 1) * BN], u)
            for i, j in T.Parallel(BM, BN):
                gf = T.cast(g[i, j], acc)
                s = T.cast(gf / (1.0 + T.exp(-gf)), dtype)  # torch's silu: fp32, rounded to bf16
                y[i, j] = T.cast(T.cast(s, acc) * T.cast(u[i, j], acc), dtype)
            T.copy(y, Y[bm * BM : (bm + 1) * BM, bn * BN : (bn + 1) * BN])

    return silu_mul


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


@functools.cache
def get_kernel(inter: int, row_variant: bool = False):
    assert tilelang is not None, "tilelang is not installed"
    return _compile(build_silu_mul(inter, bool(row_variant)))


CI_CONFIGS = [(1408, True), (2048, False)]  # V2-Lite MoE experts, row variant (BN 128); V3, tile variant (BN 256)


def ci_compile(configs=None, target=None):
    """Compile representative configurations (sm_90a unless ``target``; no GPU, no cache); see
    tests/kernels_cuda."""

    cfgs = configs or CI_CONFIGS
    funcs = [build_silu_mul(*c) for c in cfgs]  # AST parsing on this thread (ast.parse is not thread-safe)
    with compile_pool(len(funcs)) as ex:
        return list(ex.map(lambda f: _compile(f, target), funcs))


def precompile(configs, num_workers=None):
    """Compile several (I, row_variant) in parallel (nvcc in threads), then fill get_kernel's cache from TileLang's
    (no recompile), so that the first launch finds its kernel."""

    configs = list(dict.fromkeys(configs))
    if not configs:
        return
    funcs = [build_silu_mul(*c) for c in configs]
    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(_compile, funcs))
    for inter, row_variant in configs:
        get_kernel(inter, bool(row_variant))


def silu_and_mul(x, out=None):
    """x [..., 2I] bf16 -> y [..., I] bf16 (one kernel for contiguous x)."""
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i).contiguous()
    y = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device) if out is None else out.view(-1, inter)
    if x2.shape[0]:
        get_kernel(inter, x2.shape[0] <= SMALL_ROWS)(x2, y)
    return y.view(*x.shape[:-1], inter)


# reference (the arithmetic of backends/cpu/linear.py on bf16 CUDA tensors, spelled out in fp32)
def silu_and_mul_ref(x):
    gate, up = x.float().chunk(2, dim=-1)
    s = (gate / (1.0 + torch.exp(-gate))).to(x.dtype)
    return (s.float() * up).to(x.dtype)


def silu_and_mul_torch(x):
    """The reference op itself (F.silu on bf16, then the bf16 product)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def compare(out, ref, max_ulps):
    same_nan = torch.equal(torch.isnan(out), torch.isnan(ref))
    same_inf = torch.equal(torch.isinf(out), torch.isinf(ref))
    d = bf16_ulps(out, ref)
    worst = d.max().item() if d.numel() else 0.0
    stats = dict(max_ulps=worst, n_off=int((d > 0).sum()), exact=worst == 0.0)
    if not (same_nan and same_inf):
        stats["error"] = "NaN/inf positions differ"
    return same_nan and same_inf and worst <= max_ulps, stats


def make_input(rows, inter, seed=0, special=False, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, 2 * inter, generator=g, device=device) * 4
    if rows > 1:
        x[1, :inter] = torch.linspace(-100, 100, inter, device=device)  # exp overflow / underflow of the gate
    x = x.to(torch.bfloat16)
    if special and rows >= 3:
        x[2, 0] = float("nan")
        x[2, 1] = float("inf")  # silu(inf) = inf
        x[2, 2] = float("-inf")  # silu(-inf) = -inf / inf = NaN, as torch
        x[2, inter + 3] = float("inf")  # up = inf
        x[2, 3] = 0.0  # 0 * inf = NaN
    return x


def check_case(rows, inter, seed=0, special=False, verbose=True):
    """<= 1 bf16 ulp against the fp32 reference computed the same way and against the torch op (bit-exact
    expected against both); NaN / inf positions equal; the output poisoned with NaN first."""
    x = make_input(rows, inter, seed, special)
    y = torch.full((rows, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    silu_and_mul(x, out=y)
    torch.cuda.synchronize()
    ok_r, sr = compare(y, silu_and_mul_ref(x), 1)
    ok_t, st = compare(y, silu_and_mul_torch(x), 1)
    ok = ok_r and ok_t
    if verbose:
        print(
            f"check rows={rows} I={inter} special={special}: {'OK' if ok else 'FAIL'} vs fp32 ref {sr}, "
            f"vs torch op {st}",
            flush=True,
        )
    return ok, dict(ref=sr, torch=st)


CHECK_CASES = [
    (1, 1408, False),
    (7, 1408, True),
    (64, 1408, False),
    (384, 1408, False),  # 64 tokens x top-6 (V2-Lite grouped MLP)
    (1000, 2816, True),  # V2-Lite shared experts
    (33, 10944, False),  # V2-Lite dense layer (BN 64)
    (4097, 2048, False),  # V3 experts, rows not a multiple of BM
    (5, 352, True),  # V2-Lite experts over tensor parallel 4 (BN 32)
    (300, 8, False),  # smallest supported I (BN 8, BM 256)
    (3, 24, False),
    (128, 1408, True),  # largest row-variant call
    (129, 1408, False),  # smallest tile-variant call (rows not a multiple of BM)
    (200, 10944, True),
]
BENCH_SHAPES = [(rows, i) for i in (1408, 2048) for rows in (1, 6, 64, 128, 384, 4096, 16384)]


def run_checks(verbose=True):
    return all([check_case(r, i, seed=k, special=s, verbose=verbose)[0] for k, (r, i, s) in enumerate(CHECK_CASES)])


def bench_case(rows, inter, copy_gbps=None):
    from triton.testing import do_bench

    x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
    k = get_kernel(inter, rows <= SMALL_ROWS)

    def timed(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(reps):
                fn()
        return do_bench(gr.replay, warmup=25, rep=200, return_mode="median") / reps

    t = timed(lambda: k(x, y))
    t_ref = timed(lambda: silu_and_mul_torch(x))
    nbytes = rows * inter * 2 * 3
    row = {
        "bench": "silu_mul",
        "hardware": torch.cuda.get_device_name(),
        "rows": rows,
        "inter": inter,
        "us": round(t * 1e3, 2),
        "torch_us": round(t_ref * 1e3, 2),
        "bytes": nbytes,
        "GBps": round(nbytes / (t * 1e-3) / 1e9, 1),
        "timing": "graph",
    }
    if copy_gbps:
        row.update(copy_GBps=round(copy_gbps, 1), frac_of_copy=round(row["GBps"] / copy_gbps, 3))
    return row


def main(argv=None):
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    _bench.exit_without_cuda(args)
    if args.compile_only:
        t = time.time()
        ci_compile()
        print(f"compiled {len(CI_CONFIGS)} configurations in {time.time() - t:.1f}s")
    ok = True
    if args.check or args.bench:
        cfgs = [(i, r <= SMALL_ROWS) for (r, i, _s) in CHECK_CASES] if args.check else []
        cfgs += [(i, r <= SMALL_ROWS) for (r, i) in BENCH_SHAPES] if args.bench else []
        t = time.time()
        precompile(cfgs)
        print(f"compiled {len(set(cfgs))} configurations in {time.time() - t:.1f}s", flush=True)
    if args.check:
        ok = run_checks()
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.bench:
        from mla_decode import copy_bandwidth  # noqa: E402 (same folder when run as a script)

        cb = copy_bandwidth()
        for rows, i in BENCH_SHAPES:
            print(json.dumps(bench_case(rows, i, cb)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
