"""Skinny GEMM for decode (a few rows x a weight matrix), in TileLang: ``out = a @ w^T`` streamed at HBM speed.

Op: the ``linear`` of docs/interfaces.md §2 for 1-row steps (batch-1 decode; the backend's routing,
``engine_reason``), the gate/up GEMM of ``dense_mlp`` with the SwiGLU fused, and the router's fp32 GEMM on bf16
rows. Its grouped mode (experts) is checked but not routed (``SKINNY_GROUPED_MAX_ROWS = 0`` in the backend).
``a`` [M, K] (bf16 or fp32), ``w`` [N, K] (the checkpoint's ``[out, in]`` layout; bf16, or fp32 for the router)
or, grouped, [E, N, K] with ``a``'s rows sorted by expert and ``moe_gemm.expert_starts``' scan. fp32
accumulation; the output is rounded once to its dtype.
``gated=True`` fuses the SwiGLU activation: ``w`` is [gate | up] = [2I, K] and the output [M, I] is
``silu(bf16(a @ gate^T)) * bf16(a @ up^T)`` with the CPU reference's roundings (``silu_and_mul`` of a bf16 GEMM
result: silu in fp32 rounded to bf16, the product in fp32 rounded to bf16; precise expf, no fast math).

Why: at M = 1 the library GEMM tiles (cuBLAS ``nvjet 64x8``, split-K + reduce for narrow N) streamed the V2-Lite
projections at about half the copy bandwidth on an H200 (1.19 ms of a 3.2 ms batch-1 step for ~0.53 ms of bytes;
profile_decode.py, session 4). Tensor cores buy nothing at M <= 8 (compute is free, bytes are not), so this is a
CUDA-core kernel: each warp owns R output columns, each lane streams 16-byte vectors of those weight rows along K
(U vectors per row in flight before any FMA), multiplies them with the ``a`` rows of its row block (RB rows, read
through L1), and a warp shuffle sums the lanes. A CTA of 4 warps covers 4R columns (R = 1: kv_a's 576 columns are
144 CTAs), so the narrow projections still spread over the SMs without split-K (one launch, no workspace,
deterministic).

Run alone:  python kernels_cuda/skinny_gemm.py --check --bench
"""

import argparse
import sys

import torch

try:
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover
    tilelang = None
    T = None

try:
    from ._pdl import pdl_enabled
except ImportError:  # run as a script: python kernels_cuda/skinny_gemm.py
    from _pdl import pdl_enabled

try:
    from . import _bench
    from ._kernel_cache import KernelCache
except ImportError:  # run as a script: python kernels_cuda/skinny_gemm.py
    import _bench
    from _kernel_cache import KernelCache

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
MAX_ROWS = 8  # row block RB <= 8 (registers: RB * R * G fp32 accumulators a lane)
# What the engine routes here (reason()): one row, K <= DENSE_MAX_K. Measured on an H200 (--bench, session 4):
# at 1 row 1.35-2.4x cuBLAS on the V2-Lite projections, but at 6 rows 2-8x slower (the FMAs, not the bytes,
# then bound a CUDA-core kernel), and at K = 10944 (one CTA walks 43 vectors a lane) slower than cuBLAS' split-K.
DENSE_MAX_ROWS = 1
DENSE_MAX_K = 8192
THREADS = 128
ROWS_PER_WARP = 1  # R: output columns a warp owns  ((1, 4) was the best or within 10 % at 1 row, --bench)
UNROLL = 4  # U: 16-byte weight vectors per row a lane loads before its FMAs
VARIANT_ENV = "DEEPINFER_SKINNY_VARIANT"  # "R,U": overrides (ROWS_PER_WARP, UNROLL) for tuning runs


def default_variant() -> tuple[int, int]:
    """(rows_per_warp, unroll) the launches use: ``DEEPINFER_SKINNY_VARIANT`` ("R,U") or the defaults."""
    import os

    env = os.environ.get(VARIANT_ENV, "").strip()
    if not env:
        return ROWS_PER_WARP, UNROLL
    try:
        r, u = (int(v) for v in env.split(","))
    except ValueError:
        raise ValueError(f"{VARIANT_ENV}={env!r}: expected 'R,U', e.g. '1,8'") from None
    if r not in (1, 2, 4) or u not in (1, 2, 4, 8):
        raise ValueError(f"{VARIANT_ENV}={env!r}: R in 1, 2, 4 and U in 1, 2, 4, 8")
    return r, u
_BYTES = {"bfloat16": 2, "float32": 4}


def vec_for(w_dtype: str) -> int:
    return 16 // _BYTES[w_dtype]


def rows_block(m: int) -> int:
    """RB for M rows: the next power of two >= M, at most MAX_ROWS (more rows: ceil(M / RB) row blocks)."""
    return min(MAX_ROWS, 1 << max(0, (int(m) - 1).bit_length()))


def build_skinny_gemm(k: int, rb: int, gated: bool = False, grouped: bool = False, a_dtype: str = "bfloat16",
                      w_dtype: str = "bfloat16", out_dtype: str = "bfloat16", rows_per_warp: int = ROWS_PER_WARP,
                      unroll: int = UNROLL, threads: int = THREADS, col_iters: int = 1):
    """PrimFunc for K = ``k`` (compile-time) and row block ``rb``; M, N (and E) are dynamic. ``col_iters``: column
    groups a CTA handles in turn (tuning; 1 in the engine). Dense:
    (A [M, K], W [N, K], Out [M, NO]); grouped: (A, W [E, N, K], Scan [2E + 1] i32, Out). NO = N, or N / 2 gated
    (the host checks N == 2 * NO)."""
    assert tilelang is not None, "tilelang is not installed"
    PDL = pdl_enabled()
    # dense: the weights do not depend on earlier kernels, so each lane issues its first U weight vectors before
    # it waits for the previous kernel (_pdl.py): those loads overlap that kernel's tail. Grouped: the expert comes
    # from the scan, a previous kernel's output, so it waits at the start.
    EARLY_WEIGHTS = PDL and not grouped
    VEC = vec_for(w_dtype)
    assert k % VEC == 0 and 1 <= rb <= MAX_ROWS and threads % 32 == 0
    assert not gated or out_dtype == "bfloat16"
    K, RB, R, G = k, rb, rows_per_warp, 2 if gated else 1
    KV = K // VEC  # 16-byte weight vectors a row
    ITER = (KV + 31) // 32  # vectors a lane
    U = min(unroll, ITER)
    OUTER = (ITER + U - 1) // U
    NW = threads // 32
    RC = NW * R  # output columns a CTA (per column group)
    C = col_iters
    NACC = RB * R * G
    f32, i32, bf16 = T.float32, T.int32, T.bfloat16
    M = T.dynamic("num_rows")
    N = T.dynamic("weight_rows")
    NO = T.dynamic("out_cols")
    E = T.dynamic("num_experts")
    S = T.dynamic("scan_len")

    @T.macro
    def tile(A, W, Out, e, row0, cnt, mb, n0, lane, acc, w, x):
        # one row block ``mb`` of ``cnt`` rows against this warp's R columns from ``n0``
        for i in T.unroll(NACC, explicit=True):
            acc[i] = T.float32(0)
        for o in T.serial(OUTER):
            for u in T.unroll(U, explicit=True):  # loads first: U * R * G vectors in flight a lane
                if (o * U + u) * 32 + lane < KV:  # provably true (dropped) when KV % (32 U) == 0
                    for r in T.unroll(R, explicit=True):
                        for g in T.unroll(G, explicit=True):
                            if n0 + r < NO:
                                for v in T.vectorized(VEC):
                                    if grouped:
                                        w[((u * R + r) * G + g) * VEC + v] = W[
                                            e, g * NO + n0 + r, ((o * U + u) * 32 + lane) * VEC + v]
                                    else:
                                        w[((u * R + r) * G + g) * VEC + v] = W[
                                            g * NO + n0 + r, ((o * U + u) * 32 + lane) * VEC + v]
            if EARLY_WEIGHTS:  # the wait before the first read of A (cheap once it has returned)
                T.pdl_sync()
                T.pdl_trigger()
            for u in T.unroll(U, explicit=True):
                if (o * U + u) * 32 + lane < KV:  # provably true (dropped) when KV % (32 U) == 0
                    for m in T.unroll(RB, explicit=True):
                        if mb * RB + m < cnt:
                            for v in T.vectorized(VEC):
                                x[v] = A[row0 + mb * RB + m, ((o * U + u) * 32 + lane) * VEC + v]
                            for r in T.unroll(R, explicit=True):
                                for g in T.unroll(G, explicit=True):
                                    for v in T.unroll(VEC, explicit=True):
                                        acc[(m * R + r) * G + g] = acc[(m * R + r) * G + g] + T.Cast(
                                            f32, x[v]) * T.Cast(f32, w[((u * R + r) * G + g) * VEC + v])
        for i in T.unroll(NACC, explicit=True):
            acc[i] = T.warp_reduce_sum(acc[i])
        if lane == 0:
            for m in T.unroll(RB, explicit=True):
                for r in T.unroll(R, explicit=True):
                    if (mb * RB + m < cnt) & (n0 + r < NO):
                        if gated:  # the reference's roundings: bf16 GEMM outputs, bf16 silu, bf16 product
                            gv = T.Cast(f32, T.Cast(bf16, acc[(m * R + r) * G]))
                            s = T.Cast(bf16, gv / (T.float32(1) + T.exp(-gv)))
                            Out[row0 + mb * RB + m, n0 + r] = T.Cast(
                                bf16, T.Cast(f32, s) * T.Cast(f32, T.Cast(bf16, acc[(m * R + r) * G + 1])))
                        else:
                            Out[row0 + mb * RB + m, n0 + r] = T.Cast(out_dtype, acc[m * R + r])

    @T.macro
    def body(A, W, Out, e, row0, cnt, bx):
        tid = T.get_thread_binding()
        lane = tid % 32
        acc = T.alloc_local([NACC], f32)
        w = T.alloc_local([U * R * G * VEC], w_dtype)
        x = T.alloc_local([VEC], a_dtype)
        if C == 1:
            for mb in T.serial(T.ceildiv(cnt, RB)):
                tile(A, W, Out, e, row0, cnt, mb, bx * RC + (tid // 32) * R, lane, acc, w, x)
        else:  # C column groups a CTA in turn: the scan / row reads before the first load are paid once
            for cm in T.serial(C * T.ceildiv(cnt, RB)):
                tile(A, W, Out, e, row0, cnt, cm % T.ceildiv(cnt, RB),
                     (bx * C + cm // T.ceildiv(cnt, RB)) * RC + (tid // 32) * R, lane, acc, w, x)

    if grouped:

        @T.prim_func
        def skinny_gemm_grouped(
            A: T.Tensor([M, K], a_dtype),
            W: T.Tensor([E, N, K], w_dtype),
            Scan: T.Tensor([S], i32),  # moe_gemm.expert_starts: row starts [E + 1], then the hit experts
            Out: T.Tensor([M, NO], out_dtype),
        ):
            with T.Kernel(T.ceildiv(NO, RC * C), T.min(E, M), threads=threads) as (bx, slot):
                if PDL:  # _pdl.py: wait for the previous kernel, then let the next one launch
                    T.pdl_sync()
                    T.pdl_trigger()
                hit = Scan[E + 1 + slot]
                e = T.max(hit, 0)  # a slot past the hit experts does no row
                body(A, W, Out, e, Scan[e], T.if_then_else(hit >= 0, Scan[e + 1] - Scan[e], 0), bx)

        return skinny_gemm_grouped

    @T.prim_func
    def skinny_gemm(
        A: T.Tensor([M, K], a_dtype),
        W: T.Tensor([N, K], w_dtype),
        Out: T.Tensor([M, NO], out_dtype),
    ):
        with T.Kernel(T.ceildiv(NO, RC * C), T.ceildiv(M, RB * 8), threads=threads) as (bx, by):
            # a CTA takes up to 8 row blocks (64 rows) in turn; the weight tile stays in L1/L2 between them
            body(A, W, Out, 0, by * RB * 8, T.min(M - by * RB * 8, RB * 8), bx)

    return skinny_gemm


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


def _builder(k, rb, gated, grouped, a_dtype, w_dtype, out_dtype, rows_per_warp=ROWS_PER_WARP, unroll=UNROLL,
             col_iters=1):
    return build_skinny_gemm(k, rb, gated, grouped, a_dtype, w_dtype, out_dtype, rows_per_warp, unroll,
                             col_iters=col_iters)


_CACHE = KernelCache({"skinny": _builder}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels


def config_for(k: int, m: int, gated: bool, grouped: bool, a_dtype, w_dtype, out_dtype) -> tuple:
    """The cache key of the kernel :func:`skinny_gemm` launches (dtypes as torch dtypes or names)."""
    name = lambda d: d if isinstance(d, str) else str(d).removeprefix("torch.")  # noqa: E731
    return (int(k), rows_block(m), bool(gated), bool(grouped), name(a_dtype), name(w_dtype), name(out_dtype),
            *default_variant())


def get_kernel(*cfg):
    return _CACHE.get("skinny", tuple(cfg))


def precompile(configs):
    """Compile ``config_for`` tuples in parallel threads (nvcc subprocesses)."""
    _CACHE.precompile(("skinny", tuple(c)) for c in configs)


CI_CONFIGS = [
    ("skinny", (2048, 1, False, False, "bfloat16", "bfloat16", "bfloat16")),  # V2-Lite q/kv_a/o_proj, batch 1
    ("skinny", (2816, 8, True, False, "bfloat16", "bfloat16", "bfloat16")),  # shared experts' gate_up, gated
    ("skinny", (2048, 2, True, True, "bfloat16", "bfloat16", "bfloat16")),  # expert w13, grouped + gated
    ("skinny", (2048, 4, False, False, "float32", "float32", "float32")),  # router logits (fp32)
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)


_SUPPORTED = {("bfloat16", "bfloat16"), ("float32", "float32"), ("bfloat16", "float32")}  # (a, w); fp32 w: fp32 out


def reason(a: torch.Tensor, w: torch.Tensor, gated: bool = False, grouped: bool = False) -> str | None:
    """None when :func:`skinny_gemm` takes these operands, else why not (for the backend's op report)."""
    names = tuple(str(t.dtype).removeprefix("torch.") for t in (a, w))
    if not (a.is_cuda and w.is_cuda):
        return "tensor not on a CUDA device"
    if a.dim() != 2 or w.dim() != (3 if grouped else 2):
        return f"a {list(a.shape)}, w {list(w.shape)}: 2-D rows x {'[E, N, K]' if grouped else '[N, K]'} weights"
    if names not in _SUPPORTED or (gated and names[1] != "bfloat16"):
        return f"a {a.dtype}, w {w.dtype}: skinny_gemm takes bf16 x bf16, fp32 x fp32 (gated: bf16)"
    k = w.shape[-1]
    if a.shape[1] != k:
        return f"a has K={a.shape[1]}, w has K={k}"
    if k % vec_for(names[1]) or not w.is_contiguous():
        return f"K={k}, contiguous={w.is_contiguous()}: 16-byte weight rows needed"
    if w.data_ptr() % 16 or (a.is_contiguous() and a.data_ptr() % 16):  # a non-contiguous a is copied (aligned)
        return "operand not 16-byte aligned (vector loads)"
    if gated and w.shape[-2] % 2:
        return f"gated: weight rows {w.shape[-2]} are not [gate | up]"
    if not grouped and a.shape[0] > MAX_ROWS * 8:
        return f"{a.shape[0]} rows > {MAX_ROWS * 8} (8 row blocks a CTA)"
    return None


def engine_reason(a: torch.Tensor, w: torch.Tensor, gated: bool = False) -> str | None:
    """:func:`reason` plus where the kernel is faster than the library GEMM (the backend's routing, dense only):
    one row, K <= DENSE_MAX_K."""
    why = reason(a, w, gated)
    if why is None and a.shape[0] > DENSE_MAX_ROWS:
        why = f"{a.shape[0]} rows > {DENSE_MAX_ROWS}: the library GEMM is faster there"
    if why is None and w.shape[-1] > DENSE_MAX_K:
        why = f"K={w.shape[-1]} > {DENSE_MAX_K}: the library's split-K GEMM is faster there"
    return why


def skinny_gemm(a: torch.Tensor, w: torch.Tensor, gated: bool = False, scan: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``a`` [M, K] x ``w`` [N, K] (or [E, N, K] with ``scan``) -> [M, N] (gated: [M, N / 2]); no host sync."""
    grouped = scan is not None
    why = reason(a, w, gated, grouped)
    if why is not None:
        raise ValueError(f"skinny_gemm: {why}")
    m, k = a.shape
    n_out = w.shape[-2] // 2 if gated else w.shape[-2]
    out_dtype = torch.bfloat16 if gated else (torch.float32 if w.dtype == torch.float32 else a.dtype)
    if grouped:
        e = w.shape[0]
        if scan.dtype != torch.int32 or scan.shape[0] != 2 * e + 1:
            raise ValueError(f"skinny_gemm: scan must be expert_starts' int32 [2E+1] = [{2 * e + 1}], got "
                             f"{scan.dtype} {list(scan.shape)}")
    if out is None:
        out = torch.empty(m, n_out, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    # grouped: the row block serves one expert's rows (1 at batch 1, ~k * B / E beyond); dense: all M rows
    rb_rows = min(m, 2) if grouped else m
    kern = get_kernel(*config_for(k, rb_rows, gated, grouped, a.dtype, w.dtype, out_dtype))
    if grouped:
        kern(a.contiguous(), w, scan, out)
    else:
        kern(a.contiguous(), w, out)
    return out


# ---- reference, check, benchmark ------------------------------------------------------------------------------
def skinny_gemm_ref(a, w, gated=False, tokens_per_expert=None) -> torch.Tensor:
    """The CPU reference's arithmetic on the same device: F.linear (and silu_and_mul) per expert, in the output
    dtype (bf16 GEMM outputs are rounded, as the unfused path rounds them)."""
    import torch.nn.functional as F

    def one(x, wt):
        y = F.linear(x.float(), wt.float())
        if gated:
            g, u = y.to(torch.bfloat16).chunk(2, dim=-1)
            return F.silu(g) * u
        return y.to(torch.float32 if wt.dtype == torch.float32 else x.dtype)

    if tokens_per_expert is None:
        return one(a, w)
    outs, start = [], 0
    for e, c in enumerate(tokens_per_expert.tolist()):
        outs.append(one(a[start : start + c], w[e]))
        start += c
    return torch.cat(outs)


def _moe_gemm():
    try:
        from . import moe_gemm
    except ImportError:  # run as a script
        import moe_gemm
    return moe_gemm


def _problem(m, n, k, e=0, dtype=torch.bfloat16, w_dtype=torch.bfloat16, seed=0, top_k=6):
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = None
    if e:
        tokens = max(1, m // top_k)
        ids = torch.stack([torch.randperm(e, generator=g, device="cuda")[:top_k] for _ in range(tokens)])
        counts = torch.bincount(ids.flatten(), minlength=e)
        m = tokens * top_k
    a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    shape = (e, n, k) if e else (n, k)
    w = (torch.randn(*shape, generator=g, device="cuda") * k**-0.5).to(w_dtype)
    return a, w, counts


def _tolerance(ref: torch.Tensor, gated: bool, bf16_out: bool) -> torch.Tensor:
    """bf16 output: one rounding can flip (2 ulp of |ref|), gated two more (4); fp32 output: the sum order only."""
    if bf16_out:
        return (4 if gated else 2) * 2.0**-8 * ref.abs() + 1e-2
    return 1e-5 * ref.abs() + 1e-5


def check() -> bool:
    """Against the fp32 GEMM rounded like the reference (fp32 sums in another order): bf16 outputs within 2 bf16 ulp
    of |ref| + 1e-2 (gated: 4, the gate/up roundings can flip too), fp32 outputs within 1e-5 relative + 1e-5;
    NaN positions equal; cosine > 0.99999."""
    expert_starts = _moe_gemm().expert_starts

    ok = True
    cases = [  # (rows, N, K, experts, gated, a dtype, w dtype)
        (1, 3072, 2048, 0, False, "bfloat16", "bfloat16"), (1, 576, 2048, 0, False, "bfloat16", "bfloat16"),
        (3, 2048, 2816, 0, False, "bfloat16", "bfloat16"), (8, 5632, 2048, 0, True, "bfloat16", "bfloat16"),
        (6, 1000, 968, 0, False, "bfloat16", "bfloat16"), (5, 64, 2048, 0, False, "float32", "float32"),
        (2, 64, 2048, 0, False, "bfloat16", "float32"), (1, 21888, 2048, 0, True, "bfloat16", "bfloat16"),
        (6, 2816, 2048, 64, True, "bfloat16", "bfloat16"), (6, 2048, 1408, 64, False, "bfloat16", "bfloat16"),
        (96, 2816, 2048, 64, True, "bfloat16", "bfloat16"), (384, 2048, 1408, 64, False, "bfloat16", "bfloat16"),
    ]
    tuning = [(1, 3072, 2048, 0, False), (6, 2816, 2048, 64, True)]  # col_iters = 4 (bench variants), checked too

    def tuned(m, k, e, g):
        return ("skinny", config_for(k, min(m, 2) if e else m, g, e > 0, "bfloat16", "bfloat16", "bfloat16")[:7]
                + (1, 4, 4))

    # compile every case's kernel first, nvcc in parallel threads (one at a time took ~150 s on the H200 host)
    _CACHE.precompile([("skinny", config_for(k, min(m, 2) if e else m, g, e > 0, ad, wd, "float32" if wd == "float32"
                                             else "bfloat16")) for m, n, k, e, g, ad, wd in cases]
                      + [tuned(m, k, e, g) for m, _n, k, e, g in tuning])
    for m, n, k, e, gated, ad, wd in cases:
        a, w, counts = _problem(m, n, k, e, getattr(torch, ad), getattr(torch, wd))
        scan = expert_starts(counts) if e else None
        got = skinny_gemm(a, w, gated=gated, scan=scan).float()
        ref = skinny_gemm_ref(a, w, gated, counts).float()
        tol = _tolerance(ref, gated, bf16_out=(ad, wd) == ("bfloat16", "bfloat16"))
        err = (got - ref).abs()
        bad = int((err > tol).sum())
        nan_ok = bool(torch.equal(torch.isnan(got), torch.isnan(ref)))
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        good = bad == 0 and nan_ok and cos > 0.99999
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} rows={a.shape[0]} N={n} K={k} E={e} gated={gated} a={ad} w={wd}: "
              f"max err {err.max().item():.3e}, {bad} beyond tol, cos {cos:.7f}")
    for m, n, k, e, gated in tuning:
        a, w, counts = _problem(m, n, k, e)
        out = torch.empty(a.shape[0], n // 2 if gated else n, dtype=torch.bfloat16, device="cuda")
        kern = _CACHE.get(*tuned(m, k, e, gated))
        kern(a, w, expert_starts(counts), out) if e else kern(a, w, out)
        ref = skinny_gemm_ref(a, w, gated, counts).float()
        good = bool(((out.float() - ref).abs() <= _tolerance(ref, gated, bf16_out=True)).all())
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} col_iters=4 rows={a.shape[0]} N={n} K={k} E={e} gated={gated}")
    return ok


def bench(out=None):
    """Bytes / time vs the copy bandwidth measured here and vs the library path (F.linear [+ silu_and_mul], or
    moe_gemm for grouped) on the V2-Lite decode shapes (JSON lines)."""
    import json

    import torch.nn.functional as F
    expert_starts, moe_gemm = _moe_gemm().expert_starts, _moe_gemm().moe_gemm

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t_copy, _ = _bench.time_us(lambda: dst.copy_(src), graph=False)
    copy_bw = 2 * src.numel() * 2 / (t_copy * 1e-6)  # bytes read + written per second
    src = dst = None
    shapes = [("q_proj", 3072, 2048, False), ("kv_a", 576, 2048, False), ("o_proj", 2048, 2048, False),
              ("shared_gate_up", 5632, 2048, True), ("shared_down", 2048, 2816, False),
              ("dense_gate_up", 21888, 2048, True), ("dense_down", 2048, 10944, False),
              ("lm_head", 102400, 2048, False)]
    rows = []
    hw = torch.cuda.get_device_name()

    def emit(row):
        row.update(hardware=hw, copy_GBps=round(copy_bw / 1e9, 1))
        rows.append(row)
        print(json.dumps(row), flush=True)

    variants = ((2, 4), (1, 8), (2, 8), (1, 4), (1, 4, 4))  # (rows_per_warp, unroll[, col_iters])
    grouped_variants = ((1, 4), (1, 8), (1, 4, 4), (1, 4, 8), (2, 4, 4))
    row_counts = (1, 6, 16)

    def cfg(k, m, g, grouped, v):
        return ("skinny", config_for(k, m, g, grouped, "bfloat16", "bfloat16", "bfloat16")[:7] + v)

    todo = [cfg(k, m, g, False, v) for m in row_counts if m <= MAX_ROWS for _name, _n, k, g in shapes
            for v in variants]
    todo += [cfg(k, r, g, True, v) for r in (1, 2) for k, g in ((2048, True), (1408, False))
             for v in grouped_variants]
    _CACHE.precompile(todo)  # nvcc in parallel threads
    for m in row_counts:
        for name, n, k, gated in shapes:
            a, w, _ = _problem(m, n, k)
            nbytes = w.numel() * 2 + a.numel() * 2 + m * (n // 2 if gated else n) * 2

            def lib(a=a, w=w, g=gated):
                h = F.linear(a, w)
                return F.silu(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2 :] if g else h

            t_lib, _ = _bench.time_us(lib)
            if m > MAX_ROWS:
                emit({"bench": "skinny_gemm", "shape": name, "rows": m, "N": n, "K": k, "library_us": round(t_lib, 2),
                      "library_frac_of_copy": round(nbytes / (t_lib * 1e-6) / copy_bw, 4)})
                continue
            for v in variants:
                rpw, unr = v[:2]
                o = torch.empty(m, n // 2 if gated else n, dtype=torch.bfloat16, device="cuda")
                kern = _CACHE.get(*cfg(k, m, gated, False, v))
                t, _ = _bench.time_us(lambda kern=kern, a=a, w=w, o=o: kern(a, w, o))
                emit({"bench": "skinny_gemm", "shape": name, "rows": m, "N": n, "K": k, "gated": gated,
                      "rows_per_warp": rpw, "unroll": unr, "col_iters": v[2] if len(v) > 2 else 1, "us": round(t, 2),
                      "frac_of_copy": round(nbytes / (t * 1e-6) / copy_bw, 4), "library_us": round(t_lib, 2),
                      "speedup_vs_library": round(t_lib / t, 3)})
    for tokens in (1, 2, 4):
        for name, n, k, gated in (("expert_w13", 2816, 2048, True), ("expert_w2", 2048, 1408, False)):
            a, w, counts = _problem(tokens * 6, n, k, e=64)
            scan = expert_starts(counts)
            hit = int((counts > 0).sum())
            nbytes = hit * n * k * 2 + a.numel() * 2 + a.shape[0] * (n // 2 if gated else n) * 2
            t_mg, _ = _bench.time_us(lambda a=a, w=w, c=counts, s=scan: moe_gemm(a, w, c, starts=s))
            for v in grouped_variants:
                kern = _CACHE.get(*cfg(k, min(a.shape[0], 2), gated, True, v))
                o = torch.empty(a.shape[0], n // 2 if gated else n, dtype=torch.bfloat16, device="cuda")
                t, _ = _bench.time_us(lambda kern=kern, a=a, w=w, s=scan, o=o: kern(a, w, s, o))
                emit({"bench": "skinny_gemm", "shape": name, "tokens": tokens, "rows": a.shape[0],
                      "experts_hit": hit, "N": n, "K": k, "gated": gated, "rows_per_warp": v[0], "unroll": v[1],
                      "col_iters": v[2] if len(v) > 2 else 1,
                      "us": round(t, 2), "frac_of_copy": round(nbytes / (t * 1e-6) / copy_bw, 4),
                      "moe_gemm_us": round(t_mg, 2), "speedup_vs_moe_gemm": round(t_mg / t, 3)})
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
    _bench.exit_without_cuda(args)
    status = 0
    if args.check:
        status |= 0 if check() else 1
    if args.bench:
        bench(args.out)
    sys.exit(status)
