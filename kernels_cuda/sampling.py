"""Seeded sampling (``sample``) for Hopper, in TileLang: greedy and temperature rows in two launches.

Op contract: backends/cpu/sampling.py ``sample(logits [B, V] fp32, SamplingTensors) -> SamplerOutput``. Covered: any
mix of greedy rows (``argmax(logits)``, lowest index on ties) and rows sampled with a temperature
(``argmax(logits / T + Gumbel(u))``, ``u`` from the counter-based hash RNG of deepinfer_npu/sampling/rng.py keyed by
the row's (seed, offset), stream ``STREAM_SAMPLE``), without top-k / top-p, logprobs or ``min_tokens`` bans; those
stay on the reference (``backends/cuda/kernels.py`` routes and reports them). Token ids equal the reference's
exactly: the noise is computed bit for bit as the reference computes it on CUDA (uint32 hash, exact uniforms, the
IEEE division by T and the same CUDA ``logf``; no fast math), and the arg-max follows torch's order (NaN largest,
ties to the lowest index).

Kernels: ``row_argmax`` (kernels_cuda/_argmax.py: split over the vocabulary, one 64-bit key per row and split),
then ``reduce_argmax`` (one thread a row: the max key's index). The reference launches ~30 kernels for a sampled
batch, most of them elementwise over [B, V] int64 hash words (the 16-bit-limb multiplies of rng.py) plus two logs.

The worker samples through ``spec_verify`` (its prefill and draft-free decode steps take the same kernels via
kernels_cuda/spec_verify.py); this op serves direct callers of the HAL ``sample`` op.

Verified: the ``--check`` below passed on an H200 (session 3; kernels_cuda/NOTES.md), and the kernel set uses it
by default. CI compiles it for sm_90a and sm_100a.

Run alone:  python kernels_cuda/sampling.py --check --bench
"""

import argparse
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
    from . import _argmax as am
    from . import _bench
    from ._kernel_cache import KernelCache
except ImportError:  # run as a script: python kernels_cuda/sampling.py
    import _argmax as am
    import _bench
    from _kernel_cache import KernelCache

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def _compile(func, target=None):
    return am.compile_func(func, target or SM90_TARGET)


_CACHE = KernelCache({"argmax": am.build_row_argmax, "reduce": am.build_reduce_argmax}, _compile,
                     available=tilelang is not None)
_KERNELS = _CACHE.kernels  # (kind, cfg) -> compiled kernel


def get_kernel(kind: str, *cfg):
    return _CACHE.get(kind, cfg)


def precompile(items):
    """Compile (kind, cfg) pairs in parallel threads (nvcc runs in subprocesses)."""
    _CACHE.precompile(items)


CI_CONFIGS = [("argmax", (129280, True)), ("reduce", ())]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)


# ---- host side -----------------------------------------------------------------------------------------------
def reason(logits, t) -> str | None:
    """None when :func:`sample` reproduces the reference for these arguments (host facts only), else why not."""
    if t.max_num_logprobs is not None:
        return "logprobs requested"
    if t.banned_rows is not None and t.banned_token_ids is not None:
        return "min_tokens bans"
    if not t.all_greedy and (t.need_top_k or t.need_top_p):
        return "top-k / top-p"
    if logits.dim() != 2 or logits.dtype != torch.float32:
        return f"logits {logits.dtype} {tuple(logits.shape)}: kernel reads [B, V] fp32"
    n, v = logits.shape
    if n == 0:
        return "no rows"
    if n != t.num_rows:
        return "rows"
    if not 0 < v < 2**31 - 1:
        return f"vocabulary {v}"
    if n >= 65536:
        return f"{n} rows: grid y is limited to 65535"
    return None


def sample(logits, t, num_sms=None):
    """token_ids [B] int64 like the reference's ``SamplerOutput.token_ids`` (see :func:`reason`)."""
    logits = logits.contiguous()
    n, v = logits.shape
    dev = logits.device
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    s = am.num_splits(n, v, num_sms, not t.all_greedy)
    part = torch.empty(n, s, dtype=torch.int64, device=dev)
    if t.all_greedy:
        get_kernel("argmax", v, False)(logits, part)
    else:
        get_kernel("argmax", v, True)(
            logits, t.temperature.float().contiguous(), t.is_greedy.contiguous().view(torch.uint8),
            t.seeds.to(torch.int64).contiguous(), t.offsets.to(torch.int64).contiguous(), part,
        )
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    get_kernel("reduce")(part, tokens)
    return tokens


# ---- reference and checks ------------------------------------------------------------------------------------
def _ensure_repo_on_path():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


def sample_ref(logits, t):
    """The CPU reference op (backends/cpu/sampling.py) on the same tensors: token ids."""
    _ensure_repo_on_path()
    from deepinfer_npu.backends.cpu.sampling import sample as ref

    return ref(logits, t).token_ids


def make_sampling(n, greedy_frac, temp_range=(0.2, 2.0), seed=0, device="cuda"):
    _ensure_repo_on_path()
    from deepinfer_npu.sampling.metadata import SamplingTensors

    g = torch.Generator().manual_seed(seed)
    greedy = torch.rand(n, generator=g) < greedy_frac
    lo, hi = temp_range
    temp = torch.where(greedy, torch.ones(n), lo + (hi - lo) * torch.rand(n, generator=g))
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) * 2 + 1
    offsets = torch.randint(0, 1 << 36, (n,), generator=g, dtype=torch.int64)
    offsets[::3] = torch.arange(0, n, 3)
    return SamplingTensors(
        temperature=temp.float().to(device), top_k=torch.zeros(n, dtype=torch.int64, device=device),
        top_p=torch.ones(n, device=device), is_greedy=greedy.to(device), seeds=seeds.to(device),
        offsets=offsets.to(device), all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()),
    )


def check_case(n, v, greedy_frac, kind="randn", temp_range=(0.2, 2.0), seed=0, verbose=True):
    try:
        from .spec_verify import make_logits
    except ImportError:
        from spec_verify import make_logits

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = make_logits(n, v, kind, g)
    t = make_sampling(n, greedy_frac, temp_range, seed=seed)
    why = reason(logits, t)
    assert why is None, why
    out = sample(logits, t)
    ref = sample_ref(logits, t)
    torch.cuda.synchronize()
    ok = bool(torch.equal(out, ref) and out.dtype == ref.dtype)
    if verbose:
        bad = (out != ref).nonzero().flatten()
        print(f"check sample B={n:5d} V={v:6d} greedy={greedy_frac:.1f} {kind:7s} T in {temp_range}: "
              f"{'OK' if ok else 'FAIL'} ({len(bad)} rows differ)", flush=True)
        if len(bad):
            print(f"   rows {bad[:4].tolist()}: kernel {out[bad[:4]].tolist()} ref {ref[bad[:4]].tolist()}")
    return ok


# (rows, V, greedy fraction, logits kind, temperature range)
CHECK_CASES = [
    (1, 129280, 1.0, "randn", (0.2, 2.0)),
    (1, 129280, 0.0, "randn", (0.2, 2.0)),
    (8, 129280, 0.0, "randn", (0.5, 1.5)),
    (64, 102400, 0.5, "randn", (0.2, 2.0)),
    (256, 129280, 0.0, "randn", (0.01, 0.1)),  # near-greedy temperatures (large scaled logits)
    (256, 4096, 0.0, "randn", (5.0, 100.0)),  # hot temperatures: the noise dominates
    (1024, 129280, 0.3, "randn", (0.2, 2.0)),
    (1024, 4096, 1.0, "ties", (1.0, 1.0)),
    (64, 4096, 0.0, "ties", (1.0, 1.0)),  # temperature 1: integer logits + noise
    (64, 4096, 0.5, "special", (0.3, 3.0)),  # NaN / inf / -inf rows / +-0 / denormals
    (7, 1001, 0.0, "randn", (0.2, 2.0)),  # V % 4 != 0
    (3, 5, 0.0, "randn", (0.2, 2.0)),
]


def run_checks(verbose=True):
    t0 = time.time()
    items = [("reduce", ())] + [("argmax", (v, gf < 1.0)) for _n, v, gf, _k, _t in CHECK_CASES]
    precompile(items)
    print(f"compiled {len(_KERNELS)} configurations in {time.time() - t0:.1f}s", flush=True)
    ok = True
    for i, c in enumerate(CHECK_CASES):
        ok &= check_case(*c, seed=30 + i, verbose=verbose)
    ok &= check_graph(verbose)
    return ok


def check_graph(verbose=True):
    n, v = 32, 102400
    logits = torch.randn(n, v, device="cuda")
    t = make_sampling(n, 0.25, seed=4)
    sample(logits, t)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = sample(logits, t)
    logits.copy_(torch.randn(n, v, device="cuda"))
    t.offsets.add_(1)
    gr.replay()
    ref = sample_ref(logits, t)
    torch.cuda.synchronize()
    ok = torch.equal(out, ref)
    if verbose:
        print(f"check graph capture + replay (new logits and offsets): {'OK' if ok else 'FAIL'}", flush=True)
    return ok


# ---- benchmark -------------------------------------------------------------------------------------------------


def bench_case(n, v, greedy_frac, copy_gbps=None):
    logits = torch.randn(n, v, device="cuda")
    t = make_sampling(n, greedy_frac, seed=1)
    tk, how = _bench.time_us(lambda: sample(logits, t))
    tr, how_r = _bench.time_us(lambda: sample_ref(logits, t))
    nbytes = n * v * 4
    row = {"bench": "sample", "hardware": torch.cuda.get_device_name(), "rows": n, "V": v,
           "greedy_frac": greedy_frac, "kernel_us": round(tk, 2), "reference_us": round(tr, 2),
           "speedup": round(tr / tk, 2), "GBps": round(nbytes / (tk * 1e-6) / 1e9, 1), "timing": how,
           "timing_ref": how_r}
    if copy_gbps:
        row.update(copy_GBps=round(copy_gbps, 1), frac_of_copy=round(row["GBps"] / copy_gbps, 3))
    return row


BENCH_SHAPES = [(n, v, gf) for v in (102400, 129280) for gf in (1.0, 0.0) for n in (1, 16, 64, 256, 1024)]


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
    if args.check:
        ok = run_checks()
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.bench:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from mla_decode import copy_bandwidth  # noqa: E402 (same folder)

        precompile([("reduce", ())] + [("argmax", (v, gf < 1.0)) for _n, v, gf in BENCH_SHAPES])
        cb = copy_bandwidth()
        for c in BENCH_SHAPES:
            print(json.dumps(bench_case(*c, copy_gbps=cb)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
