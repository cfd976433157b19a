"""Fused MLA prolog tail for Hopper, in TileLang: kv_a_layernorm + RoPE of q and k + paged latent-cache write.

Op contract: the tail of docs/interfaces.md §2 ``mla_prolog`` (backends/cuda/kernels.py ``mla_prolog``), after
the q and kv_a projections:
  kv           [T, 512 + 64] bf16   output of kv_a_proj: c_kv ‖ k_pe
  weight       [512] bf16           kv_a_layernorm
  q            [T, H, QD] bf16      the projected q, contiguous; its rope part is q[:, :, q_off : q_off + 64]
  positions    [T] int64
  cos_sin_cache[max_pos, 64] fp32   [cos | sin] rows (YaRN factor folded in), see backends/cpu/rope.py
  kv_cache     [num_blocks, 64, 576] bf16 (contiguous), slot_mapping [T] int64 (negative: padding, no write)
  -> q_rope [T, H, 64] bf16, and kv_cache[slot] = cat(rms_norm(c_kv), rope(k_pe)) for each slot >= 0.

Semantics follow the CPU reference ops exactly (backends/cpu/norm.py, backends/cpu/rope.py):
  rms_norm: ms = mean(float(x)^2); y = bf16(float(weight) * float(bf16(float(x) * rsqrt(ms + eps))))
  rope (fp32): r1 = fl(fl(x1 * cos) - fl(x2 * sin)), r2 = fl(fl(x2 * cos) + fl(x1 * sin)), then bf16; pairs
  (x[2i], x[2i+1]) when ``interleaved`` (DeepSeek), else (x[i], x[i + 32]). The products and the sum use
  IEEE round-to-nearest intrinsics (__fmul_rn / __fadd_rn), so nvcc cannot contract them into an FMA: the
  rope outputs are bit-exact to torch's eager arithmetic; the norm can differ by one bf16 rounding at most
  (summation order of the mean square).

Kernel: one launch, grid (T, H / HB + 1), 128 threads. CTAs y < H / HB rotate HB = min(H, 16) heads of one
token (q tile [HB, 64] and the token's cos/sin row staged in shared memory, 8 outputs a thread); the last CTA
of a token normalises c_kv (one 512-wide row in registers, 4 values a thread, a block all-reduce for the mean
square), rotates k_pe and stores both into the token's cache slot, or does nothing when the slot is negative.
No host reads: CUDA-graph capturable. Latency-bound at decode sizes (it replaces ~20 small kernels).

Run alone:  python kernels_cuda/mla_rope_cache.py --check --bench
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
except ImportError:  # run as a script: python kernels_cuda/mla_rope_cache.py
    import _bench
    from _check import bf16_ulps
    from _pdl import pdl_enabled

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}

KV_LORA = 512
ROPE = 64
HALF = ROPE // 2
PAGE = 64
HEAD_DIM = KV_LORA + ROPE  # 576
THREADS = 128


def heads_per_cta(heads: int) -> int:
    """Heads rotated by one CTA (16, or all of them when fewer)."""
    return min(heads, 16)


def supported_heads(heads: int) -> bool:
    """H a multiple of 16, or 1, 2, 4, 8 (q tile [HB, 64] spread evenly over 128 threads)."""
    return heads > 0 and (heads % 16 == 0 or heads in (1, 2, 4, 8))


def build_mla_rope_cache(heads: int, q_dim: int, q_off: int, interleaved: bool, eps: float, threads: int = THREADS):
    """PrimFunc for H = ``heads`` query heads of ``q_dim`` values with the rope part at ``q_off`` (compile-time);
    tokens, cos/sin rows and cache slots are dynamic."""
    assert tilelang is not None, "tilelang is not installed"
    PDL = pdl_enabled()
    assert supported_heads(heads), f"heads={heads}: need a multiple of 16 or 1/2/4/8"
    assert 0 <= q_off and q_off + ROPE <= q_dim
    H, HB = heads, heads_per_cta(heads)
    NHB = H // HB
    L, R = KV_LORA, ROPE
    dtype, acc = T.bfloat16, T.float32
    Tn = T.dynamic("num_tokens")
    P = T.dynamic("max_positions")
    S = T.dynamic("num_slots")
    inv_n = 1.0 / L

    def rotate(x, xp, cs, j):
        """One rope output: x = this element, xp = its pair partner, j = its index in the 64 rope values."""
        if interleaved:  # pair (2k, 2k+1): even j is the first of its pair
            k = j // 2
            sgn = T.if_then_else(j % 2 == 0, -1.0, 1.0)
        else:  # pair (k, k + 32)
            k = j % HALF
            sgn = T.if_then_else(j < HALF, -1.0, 1.0)
        # first: x*cos - xp*sin; second: x*cos + xp*sin (sgn * sin is exact); no FMA contraction
        return T.cast(
            T.ieee_add(T.ieee_mul(T.cast(x, acc), cs[k]), T.ieee_mul(T.cast(xp, acc), cs[HALF + k] * sgn)), dtype
        )

    def partner(j):
        return j + 1 - 2 * (j % 2) if interleaved else (j + HALF) % R

    @T.prim_func
    def mla_rope_cache(
        KV: T.Tensor([Tn, L + R], dtype),
        W: T.Tensor([L], dtype),
        Q: T.Tensor([Tn, H, q_dim], dtype),
        Pos: T.Tensor([Tn], T.int64),
        CS: T.Tensor([P, R], acc),
        Slots: T.Tensor([Tn], T.int64),
        Cache: T.Tensor([S, L + R], dtype),
        QR: T.Tensor([Tn, H, R], dtype),
    ):
        with T.Kernel(Tn, NHB + 1, threads=threads) as (t, hb):
            if PDL:  # _pdl.py: wait for the previous kernel, then let the next one launch
                T.pdl_sync()
                T.pdl_trigger()
            cs = T.alloc_shared([R], acc)
            qs = T.alloc_shared([HB, R], dtype)
            ks = T.alloc_shared([R], dtype)
            x = T.alloc_fragment([1, L], dtype)
            sq = T.alloc_fragment([1, L], acc)
            y = T.alloc_fragment([1, L], dtype)
            ss = T.alloc_fragment([1], acc)
            pos = Pos[t]
            if hb < NHB:  # q rope: heads hb*HB .. hb*HB + HB - 1 of token t
                T.copy(CS[pos, :], cs)
                T.copy(Q[t, hb * HB : (hb + 1) * HB, q_off : q_off + R], qs)
                for i, j in T.Parallel(HB, R):
                    QR[t, hb * HB + i, j] = rotate(qs[i, j], qs[i, partner(j)], cs, j)
            else:  # the token's latent: rms_norm(c_kv) ‖ rope(k_pe) into its cache slot
                slot = Slots[t]
                if slot >= 0:
                    T.copy(CS[pos, :], cs)
                    T.copy(KV[t, L : L + R], ks)
                    T.copy(KV[t : t + 1, 0:L], x)
                    for i, j in T.Parallel(1, L):
                        sq[i, j] = T.cast(x[i, j], acc) * T.cast(x[i, j], acc)
                    T.reduce_sum(sq, ss, dim=1)
                    for i in T.Parallel(1):
                        ss[i] = T.rsqrt(ss[i] * inv_n + eps)
                    for i, j in T.Parallel(1, L):
                        y[i, j] = T.cast(
                            T.cast(T.cast(T.cast(x[i, j], acc) * ss[i], dtype), acc) * T.cast(W[j], acc), dtype
                        )
                    T.copy(y, Cache[slot : slot + 1, 0:L])
                    for j in T.Parallel(R):
                        Cache[slot, L + j] = rotate(ks[j], ks[partner(j)], cs, j)

    return mla_rope_cache


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


@functools.cache
def get_kernel(heads: int, q_dim: int, q_off: int, interleaved: bool, eps: float):
    assert tilelang is not None, "tilelang is not installed"
    return _compile(build_mla_rope_cache(heads, q_dim, q_off, bool(interleaved), float(eps)))


# (heads, q_dim, q_off, interleaved, eps): V2-Lite (H=16), V3 (H=128) with the non-interleaved variant
CI_CONFIGS = [(16, 192, 128, True, 1e-6), (128, 192, 128, False, 1e-6)]


def ci_compile(configs=None, target=None):
    """Compile representative configurations (sm_90a unless ``target``; no GPU, no cache); see
    tests/kernels_cuda."""

    cfgs = configs or CI_CONFIGS
    funcs = [build_mla_rope_cache(*c) for c in cfgs]  # AST parsing on this thread (ast.parse is not thread-safe)
    with compile_pool(len(funcs)) as ex:
        return list(ex.map(lambda f: _compile(f, target), funcs))


def precompile(configs, num_workers=None):
    """Compile several (heads, q_dim, q_off, interleaved, eps) in parallel (nvcc in threads), then fill get_kernel's
    cache from TileLang's (no recompile), so that the first launch finds its kernel."""

    configs = list(dict.fromkeys(configs))
    if not configs:
        return
    funcs = [build_mla_rope_cache(*c) for c in configs]
    with compile_pool(num_workers or min(len(funcs), 16)) as ex:
        list(ex.map(_compile, funcs))
    for heads, q_dim, q_off, interleaved, eps in configs:  # the launcher's key types
        get_kernel(heads, q_dim, int(q_off), bool(interleaved), float(eps))


# ----------------------------------------------------------------------------------------------------
# launch wrapper (the backend's op)
# ----------------------------------------------------------------------------------------------------
def mla_rope_cache(kv, weight, eps, q, q_off, positions, cos_sin_cache, interleaved, kv_cache, slot_mapping,
                   out=None):
    """q_rope [T, H, 64] bf16; writes cat(rms_norm(c_kv), rope(k_pe)) into ``kv_cache`` at each slot >= 0.

    ``q`` [T, H, QD] is the whole projected q (its rope part at ``q_off``), ``kv`` [T, 576] the kv_a output.
    Launches exactly one kernel when the inputs are already contiguous int64 / fp32 / bf16 (the backend's case).
    """
    num_tokens, heads, q_dim = q.shape
    assert kv.shape == (num_tokens, HEAD_DIM) and kv_cache.shape[1:] == (PAGE, HEAD_DIM)
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[-1] == ROPE
    assert kv_cache.is_contiguous(), "the cache is written through a flat [slots, 576] view"
    if out is None:
        out = torch.empty(num_tokens, heads, ROPE, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    kern = get_kernel(heads, q_dim, int(q_off), bool(interleaved), float(eps))
    kern(
        kv.contiguous(),
        weight.contiguous(),
        q.contiguous(),
        positions.to(torch.int64).contiguous(),
        cos_sin_cache.contiguous(),
        slot_mapping.to(torch.int64).contiguous(),
        kv_cache.view(-1, HEAD_DIM),
        out,
    )
    return out


# ----------------------------------------------------------------------------------------------------
# reference (the CPU reference ops' arithmetic: backends/cpu/norm.py, backends/cpu/rope.py, mla.py)
# ----------------------------------------------------------------------------------------------------
def rms_norm_ref(x, weight, eps):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_ref(x, positions, cos_sin_cache, interleaved):
    half = x.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :half], xf[..., half:])
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    out = torch.stack((r1, r2), dim=-1).flatten(-2) if interleaved else torch.cat((r1, r2), dim=-1)
    return out.to(x.dtype)


def mla_rope_cache_ref(kv, weight, eps, q_pe, positions, cos_sin_cache, interleaved):
    """(q_rope [T, H, 64], latents [T, 576]) computed as the composed path does."""
    c_kv, k_pe = kv.split([KV_LORA, ROPE], dim=-1)
    q_rope = rope_ref(q_pe, positions, cos_sin_cache, interleaved)
    k_rot = rope_ref(k_pe.unsqueeze(1), positions, cos_sin_cache, interleaved).squeeze(1)
    return q_rope, torch.cat((rms_norm_ref(c_kv, weight, eps), k_rot), dim=-1)


def write_cache_ref(kv_cache, latents, slot_mapping):
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    flat[slot_mapping[valid]] = latents[valid].to(kv_cache.dtype)


def make_cos_sin_cache(max_pos, device="cuda", base=10000.0, attention_factor=0.7071):
    """[cos | sin] fp32 rows as model_executor/layers/rope.py builds them (plain RoPE, a YaRN-like factor)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1).to(device)


# ----------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------
def compare(out, ref, max_ulps):
    """(ok, stats): NaN and inf positions equal, every element within max_ulps bf16 ulps."""
    same_nan = torch.equal(torch.isnan(out), torch.isnan(ref))
    same_inf = torch.equal(torch.isinf(out), torch.isinf(ref))
    if out.numel() == 0:
        return same_nan and same_inf, dict(max_ulps=0.0, exact=True)
    d = bf16_ulps(out, ref)
    worst = d.max().item()
    stats = dict(max_ulps=worst, n_off=int((d > 0).sum()), exact=worst == 0.0)
    if not (same_nan and same_inf):
        stats["error"] = "NaN/inf positions differ"
    return same_nan and same_inf and worst <= max_ulps, stats


def make_inputs(num_tokens, heads, max_pos=8192, pad_every=0, num_blocks=None, q_dim=192, seed=0, special=False,
                device="cuda"):
    """Random problem: distinct slots spread over shuffled blocks (block 0 never used), every ``pad_every``-th
    row a padding row (slot -1), positions in [0, max_pos) including both ends. ``special``: a NaN in q, an inf
    in k_pe and in c_kv, a row whose squares overflow fp32, an all-zero c_kv row."""
    g = torch.Generator(device=device).manual_seed(seed)
    gc = torch.Generator().manual_seed(seed)
    T_ = num_tokens
    kv = torch.randn(T_, HEAD_DIM, generator=g, device=device) * 2
    kv[:, KV_LORA:] *= 4
    if T_ > 2:  # rows of very different scale: the norm must not depend on it
        kv[1] *= 1e-3
        kv[2] *= 300.0
    kv = kv.to(torch.bfloat16)
    weight = (torch.rand(KV_LORA, generator=g, device=device) + 0.5).to(torch.bfloat16)
    q = (torch.randn(T_, heads, q_dim, generator=g, device=device) * 3).to(torch.bfloat16)
    positions = torch.randint(0, max_pos, (T_,), generator=gc)
    positions[0] = max_pos - 1
    if T_ > 1:
        positions[1] = 0
    need = T_ + 2 * PAGE
    num_blocks = num_blocks or (need // PAGE + 2)
    slot_pool = torch.randperm((num_blocks - 1) * PAGE, generator=gc)[:T_] + PAGE  # block 0 stays untouched
    slots = slot_pool.clone()
    if pad_every:
        slots[pad_every - 1 :: pad_every] = -1
    if special and T_ >= 6:
        q[0, 0, q_dim - ROPE + 3] = float("nan")
        kv[3, KV_LORA + 5] = float("inf")
        kv[4, 7] = float("-inf")
        kv[5, :KV_LORA] = 3e38  # squares overflow: mean square inf, rsqrt 0
        if T_ > 6:
            kv[6, :KV_LORA] = 0.0
    cache = torch.randn(num_blocks, PAGE, HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    return dict(
        kv=kv,
        weight=weight,
        eps=1e-6,
        q=q,
        q_off=q_dim - ROPE,
        positions=positions.to(device),
        cos_sin_cache=make_cos_sin_cache(max_pos, device),
        kv_cache=cache,
        slot_mapping=slots.to(device),
    )


def _ref_from_inputs(inp, interleaved):
    q_pe = inp["q"][:, :, inp["q_off"] : inp["q_off"] + ROPE]
    q_ref, lat = mla_rope_cache_ref(
        inp["kv"], inp["weight"], inp["eps"], q_pe, inp["positions"], inp["cos_sin_cache"], interleaved
    )
    cache_ref = inp["kv_cache"].clone()
    write_cache_ref(cache_ref, lat, inp["slot_mapping"])
    return q_ref, cache_ref


def _compare_all(inp, interleaved, q_out, cache_out, cache_before):
    """q_rope <= 1 ulp (bit-exact expected), written c_kv <= 1 ulp, written k_pe <= 1 ulp (bit-exact expected),
    every other cache row untouched (bit-exact)."""
    q_ref, cache_ref = _ref_from_inputs(inp, interleaved)
    slots = inp["slot_mapping"]
    valid = slots[slots >= 0]
    flat_o, flat_r = cache_out.view(-1, HEAD_DIM), cache_ref.view(-1, HEAD_DIM)
    ok_q, sq_ = compare(q_out, q_ref, 1)
    ok_c, sc = compare(flat_o[valid, :KV_LORA], flat_r[valid, :KV_LORA], 1)
    ok_k, sk = compare(flat_o[valid, KV_LORA:], flat_r[valid, KV_LORA:], 1)
    untouched = torch.ones(flat_o.shape[0], dtype=torch.bool, device=flat_o.device)
    untouched[valid] = False
    before = cache_before.view(-1, HEAD_DIM)
    ok_u = torch.equal(flat_o[untouched].view(torch.int16), before[untouched].view(torch.int16))
    return ok_q and ok_c and ok_k and ok_u, dict(q_rope=sq_, c_kv=sc, k_pe=sk, rest_untouched=ok_u)


def check_case(num_tokens, heads, interleaved, pad_every=0, max_pos=8192, seed=0, special=False, verbose=True):
    inp = make_inputs(num_tokens, heads, max_pos, pad_every, seed=seed, special=special)
    before = inp["kv_cache"].clone()
    out = torch.full((num_tokens, heads, ROPE), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_rope_cache(**inp, interleaved=interleaved, out=out)
    torch.cuda.synchronize()
    ok, stats = _compare_all(inp, interleaved, out, inp["kv_cache"], before)
    if verbose:
        print(
            f"check T={num_tokens} H={heads} interleaved={interleaved} pad_every={pad_every} max_pos={max_pos} "
            f"special={special}: {'OK' if ok else 'FAIL'} {stats}",
            flush=True,
        )
    return ok, stats


def check_graph(num_tokens=64, heads=16, interleaved=True, seed=0, verbose=True):
    """Capture one launch in a CUDA graph, then replay it on new inputs copied into the static buffers (new
    positions, new slots with padding rows): proves there is no host read and the slot test is on the device."""
    a = make_inputs(num_tokens, heads, seed=seed, pad_every=5)
    b = make_inputs(num_tokens, heads, seed=seed + 1, pad_every=3, num_blocks=a["kv_cache"].shape[0])
    out = torch.full((num_tokens, heads, ROPE), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn = lambda: mla_rope_cache(**a, interleaved=interleaved, out=out)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    for k in ("kv", "weight", "q", "positions", "slot_mapping", "kv_cache"):
        a[k].copy_(b[k])
    before = a["kv_cache"].clone()
    out.fill_(float("nan"))
    gr.replay()
    torch.cuda.synchronize()
    ok, stats = _compare_all(a, interleaved, out, a["kv_cache"], before)
    if verbose:
        print(f"check graph replay T={num_tokens} H={heads}: {'OK' if ok else 'FAIL'} {stats}", flush=True)
    return ok, stats


# (num_tokens, heads, interleaved, pad_every, max_pos, special)
CHECK_CASES = [
    (1, 16, True, 0, 8192, False),
    (7, 16, True, 3, 8192, True),
    (64, 16, True, 5, 8192, False),
    (130, 16, False, 4, 8192, False),
    (1, 128, True, 0, 8192, False),
    (33, 128, True, 2, 8192, True),
    (256, 128, False, 7, 8192, False),
    (64, 128, True, 0, 163840, False),  # long-context table (V3's max_position_embeddings)
    (2000, 16, True, 9, 8192, False),  # prefill-sized
    (5, 8, True, 2, 8192, True),  # H < 16 (tensor parallel shard)
    (5, 32, False, 0, 8192, False),
]


def run_checks(verbose=True):
    ok = True
    for i, (t_, h, il, pad, mp, sp) in enumerate(CHECK_CASES):
        ok &= check_case(t_, h, il, pad, mp, seed=i, special=sp, verbose=verbose)[0]
    ok &= check_graph(verbose=verbose)[0]
    ok &= check_graph(48, 128, False, seed=5, verbose=verbose)[0]
    return ok


# ----------------------------------------------------------------------------------------------------
# benchmark: the fused kernel vs the composed path it replaces
# ----------------------------------------------------------------------------------------------------
def composed(inp, interleaved, norm=None):
    """The backend's composed tail: norm (kernels_cuda.rms_norm when given) + 2 reference ropes + cat + the
    sync-free cache write."""
    q, off, kv = inp["q"], inp["q_off"], inp["kv"]
    q_pe = q[:, :, off : off + ROPE]
    c_kv, k_pe = kv.split([KV_LORA, ROPE], dim=-1)
    q_rope = rope_ref(q_pe, inp["positions"], inp["cos_sin_cache"], interleaved)
    c = norm(c_kv.contiguous(), inp["weight"], inp["eps"]) if norm else rms_norm_ref(c_kv, inp["weight"], inp["eps"])
    k_rot = rope_ref(k_pe.unsqueeze(1), inp["positions"], inp["cos_sin_cache"], interleaved).squeeze(1)
    lat = torch.cat((c, k_rot), dim=-1)
    flat = inp["kv_cache"].view(-1, HEAD_DIM)
    slots = inp["slot_mapping"]
    valid = slots >= 0
    idx = torch.where(valid, slots, torch.zeros_like(slots))
    flat.index_copy_(0, idx, torch.where(valid.unsqueeze(-1), lat, flat[0].unsqueeze(0)))
    return q_rope


def _time_graph(fn, reps=20):
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(reps):
            fn()
    return do_bench(gr.replay, warmup=25, rep=200, return_mode="median") / reps


BENCH_SHAPES = [(t_, h) for h in (16, 128) for t_ in (1, 16, 64, 128, 256, 4096)]


def bench_case(num_tokens, heads, interleaved=True, norm=None):
    inp = make_inputs(num_tokens, heads, pad_every=0, seed=123)
    out = torch.empty(num_tokens, heads, ROPE, dtype=torch.bfloat16, device="cuda")
    t_f = _time_graph(lambda: mla_rope_cache(**inp, interleaved=interleaved, out=out))
    t_c = _time_graph(lambda: composed(inp, interleaved, norm))
    nbytes = num_tokens * (HEAD_DIM * 2 * 2 + heads * ROPE * 2 * 2 + ROPE * 4 + 16) + KV_LORA * 2
    return {
        "bench": "mla_rope_cache",
        "hardware": torch.cuda.get_device_name(),
        "tokens": num_tokens,
        "heads": heads,
        "us": round(t_f * 1e3, 2),
        "composed_us": round(t_c * 1e3, 2),
        "speedup": round(t_c / t_f, 2),
        "bytes": nbytes,
        "GBps": round(nbytes / (t_f * 1e-3) / 1e9, 1),
        "timing": "graph",
    }


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
        cfgs = [(h, 192, 128, il, 1e-6) for (_t, h, il, *_r) in CHECK_CASES] if args.check else []
        cfgs += [(h, 192, 128, True, 1e-6) for (_t, h) in BENCH_SHAPES] if args.bench else []
        cfgs += [(16, 192, 128, True, 1e-6), (128, 192, 128, False, 1e-6)] if args.check else []  # graph checks
        t = time.time()
        precompile(cfgs)
        print(f"compiled {len(set(cfgs))} configurations in {time.time() - t:.1f}s", flush=True)
    if args.check:
        ok = run_checks()
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.bench:
        try:
            from rms_norm import rms_norm as norm  # noqa: E402 (same folder when run as a script)
        except Exception:  # noqa: BLE001
            norm = None
        for t_, h in BENCH_SHAPES:
            print(json.dumps(bench_case(t_, h, norm=norm)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
