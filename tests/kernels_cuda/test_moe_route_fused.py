"""kernels_cuda/moe_routing.py's fused route (gating top-k + permute with moe_gemm's expert scan, one launch for
decode batches, T <= MAX_ROUTE_TOKENS) and the gating refactor it rests on.

- Anywhere: ``route_reason``'s limits and messages; the route kind in the kernel cache / CI configs; and (nvcc, no
  GPU) the standalone gating kernel, whose per-token body is now ``_gating_macro``, still generates the same CUDA
  source byte for byte as the pre-refactor prim_func (kept verbatim below as ``_legacy_gating_topk``).
- GPU (skipped without a CUDA device): ``check_route``: every output bit-identical to ``gating_topk`` followed by
  ``permute(with_scan=True)``, and ids / order / counts / rows / scan identical to the torch references (weights
  within 2 fp32 ulp, bit-exact expected); V2-Lite T in 1, 2, 5, 16, V3 (sigmoid, noaux_tc, bias, 8 groups) T in
  1, 3, 16, tie-heavy and all-equal logits, V2 (160 experts, 256 threads), no bias, a CUDA-graph replay.
"""

import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

from kernels_cuda import moe_routing as mr  # noqa: E402 (importable without tilelang)


def _has_tilelang():
    try:
        import tilelang  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


def _has_nvcc():
    if shutil.which("nvcc"):
        return True
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.path.exists(os.path.join(home, "bin", "nvcc"))


gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and _has_tilelang()),
    reason="no CUDA device (or no tilelang): the fused route's numerics run on the H200 only",
)
compiles = pytest.mark.skipif(not (_has_tilelang() and _has_nvcc()), reason="tilelang / nvcc not available")


# ---- anywhere ----------------------------------------------------------------------------------------------------
class _FakeCuda:
    """Stands in for a CUDA tensor in route_reason (host facts only: shape, dtype, device, layout)."""

    def __init__(self, t, device="cuda:0"):
        self.t, self.device, self.is_cuda = t, torch.device(device), True
        self.shape, self.dtype = t.shape, t.dtype

    def __getattr__(self, name):
        return getattr(self.t, name)

    def dim(self):
        return self.t.dim()

    def numel(self):
        return self.t.numel()

    def is_floating_point(self):
        return self.t.is_floating_point()

    def element_size(self):
        return self.t.element_size()

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return 0


def _args(t=1, e=64, params=mr.V2_LITE, d=2048, hidden_dtype=torch.bfloat16, fake=True):
    logits = torch.zeros(t, e)
    hidden = torch.zeros(t, d, dtype=hidden_dtype)
    if fake:
        logits, hidden = _FakeCuda(logits), _FakeCuda(hidden)
    return logits, None, params, hidden, e


def test_route_reason_accepts_decode_batches():
    assert mr.MAX_ROUTE_TOKENS == 16
    for t in (1, 5, 16):
        assert mr.route_reason(*_args(t)) is None
    assert mr.route_reason(*_args(16, 256, mr.V3, 7168)) is None
    assert mr.route_reason(*_args(3, 160, mr.V2, 5120)) is None


def test_route_reason_limits():
    why = mr.route_reason(*_args(17))
    assert why is not None and "17 tokens" in why and "MAX_ROUTE_TOKENS 16" in why
    why = mr.route_reason(*_args(2, 288, mr.Gating(top_k=8, num_experts=288)))
    assert why is not None and "288 experts" in why and f"MAX_SCAN_EXPERTS {mr.MAX_SCAN_EXPERTS}" in why
    why = mr.route_reason(*_args(2, 64, mr.V3))
    assert why is not None and "64" in why and "256" in why  # num_experts vs the gating's
    why = mr.route_reason(*_args(2, hidden_dtype=torch.float16))
    assert why is not None and "float16" in why and "bf16 / fp32" in why
    logits, bias, params, hidden, e = _args(2)
    why = mr.route_reason(_FakeCuda(torch.zeros(2, 64, dtype=torch.int32)), bias, params, hidden, e)
    assert why is not None and "int32" in why and "floating-point" in why
    why = mr.route_reason(*_args(2, d=2044))  # the permute's row vector width
    assert why is not None and "multiple of 8" in why
    why = mr.route_reason(*_args(2, 72, mr.Gating(top_k=6, num_experts=72)))
    assert why is not None and "multiple of 32" in why  # the gating's own limit
    why = mr.route_reason(torch.zeros(2, 64), None, mr.V2_LITE, _FakeCuda(torch.zeros(2, 2048)), 64)
    assert why is not None and "not on a CUDA device" in why
    why = mr.route_reason(*_args(2, fake=False))  # host tensors
    assert why is not None and "not on a CUDA device" in why
    why = mr.route_reason(_FakeCuda(torch.zeros(2, 64)), None, mr.V2_LITE,
                          _FakeCuda(torch.zeros(3, 2048, dtype=torch.bfloat16)), 64)
    assert why is not None and "T=2" in why and "(3, 2048)" in why  # hidden's tokens != the logits'
    with pytest.raises(ValueError, match="17 tokens > MAX_ROUTE_TOKENS 16"):
        mr.route(torch.zeros(17, 64), None, mr.V2_LITE, torch.zeros(17, 2048, dtype=torch.bfloat16), 64)


def test_route_kind_is_cached_and_ci_compiled():
    assert "route" in mr._CACHE.builders
    ci = [cfg for kind, cfg in mr.CI_CONFIGS if kind == "route"]
    assert ci and all(len(cfg) == 12 for cfg in ci)
    assert mr._route_cfg(mr.V3, 7168, "bfloat16", True) in ci
    assert mr._route_cfg(mr.V2_LITE, 2048, "bfloat16", False) in ci
    assert any(kind == "route" for kind, _cfg in mr.check_configs())


# ---- compile (nvcc, no GPU) --------------------------------------------------------------------------------------
def _legacy_gating_topk(num_experts, top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
                        routed_scaling_factor, norm_order, has_bias):
    """build_gating_topk as it was before its body became ``_gating_macro`` (verbatim prim_func), the reference
    for the generated-source identity test."""
    import tilelang.language as T

    _radix_key = mr._radix_key
    PDL = mr.pdl_enabled()
    E, K, G, TG = num_experts, top_k, n_group, topk_group
    grouped = topk_method != "greedy"
    VPT, PG = E // 32, E // max(G, 1)
    rsf = float(routed_scaling_factor)
    sum_fn = mr.SUM_ORDERS[norm_order]
    f32, u32, u64, i32 = T.float32, T.uint32, T.uint64, T.int32
    M = T.dynamic("num_tokens")
    softmax, noaux = scoring_func == "softmax", topk_method == "noaux_tc"

    @T.prim_func
    def gating_topk(
        L: T.Tensor([M, E], f32),
        Bias: T.Tensor([E], f32),
        W: T.Tensor([M, K], f32),
        Ids: T.Tensor([M, K], i32),
    ):
        with T.Kernel(M, threads=32) as bx:
            if PDL:  # _pdl.py: wait for the previous kernel, then let the next one launch
                T.pdl_sync()
                T.pdl_trigger()
            lane = T.get_thread_binding()
            x = T.alloc_local([VPT], f32)  # scores
            c = T.alloc_local([VPT], f32)  # selection values (biased / group-masked)
            key = T.alloc_local([VPT], u64)
            pk = T.alloc_local([K], u32)  # picks: radix key, expert index, output slot
            pi = T.alloc_local([K], i32)
            pos = T.alloc_local([K], i32)
            wo = T.alloc_local([K], f32)  # outputs in torch's order
            io = T.alloc_local([K], i32)
            s_c = T.alloc_shared([E], f32)
            s_w = T.alloc_shared([E], f32)
            s_g = T.alloc_shared([32], u32)
            s_sel = T.alloc_shared([32], i32)
            mx = T.alloc_var(f32)
            sm = T.alloc_var(f32)
            best = T.alloc_var(u64)
            m1 = T.alloc_var(f32)
            m2 = T.alloc_var(f32)
            rank = T.alloc_var(i32)
            tot = T.alloc_var(f32)

            for i in T.unroll(VPT, explicit=True):
                x[i] = L[bx, i * 32 + lane]
            if softmax:  # torch softmax_warp_forward, bit for bit
                mx = x[0]
                for i in T.unroll(1, VPT, explicit=True):
                    mx = T.if_then_else(mx > x[i], mx, x[i])
                for o in T.unroll(5, explicit=True):
                    other = T.shfl_xor(mx, 16 >> o)
                    mx = T.if_then_else(mx > other, mx, other)
                sm = T.float32(0)
                for i in T.unroll(VPT, explicit=True):
                    x[i] = T.exp(x[i] - mx)
                    sm = sm + x[i]
                for o in T.unroll(5, explicit=True):
                    sm = sm + T.shfl_xor(sm, 16 >> o)
                for i in T.unroll(VPT, explicit=True):
                    x[i] = x[i] / sm
            else:
                for i in T.unroll(VPT, explicit=True):
                    x[i] = T.float32(1) / (T.float32(1) + T.exp(-x[i]))
            for i in T.unroll(VPT, explicit=True):
                if noaux and has_bias:
                    c[i] = x[i] + Bias[i * 32 + lane]
                else:
                    c[i] = x[i]

            if grouped:
                for i in T.unroll(VPT, explicit=True):
                    s_c[i * 32 + lane] = c[i]
                T.sync_threads()
                if lane < G:  # group score: max (V2) or sum of the top-2 (V3)
                    m1 = -T.infinity(f32)
                    m2 = -T.infinity(f32)
                    for e in T.serial(PG):
                        v = s_c[lane * PG + e]
                        if v > m1:
                            m2 = m1
                            m1 = v
                        elif v > m2:
                            m2 = v
                    if noaux:
                        s_g[lane] = _radix_key(m1 + m2)
                    else:
                        s_g[lane] = _radix_key(m1)
                T.sync_threads()
                if lane < G:  # keep the topk_group best groups, ties to the lower group index
                    rank = 0
                    for h in T.serial(G):
                        rank = rank + T.if_then_else(
                            (s_g[h] > s_g[lane]) | ((s_g[h] == s_g[lane]) & (h < lane)), 1, 0
                        )
                    s_sel[lane] = T.if_then_else(rank < TG, 1, 0)
                T.sync_threads()
                for i in T.unroll(VPT, explicit=True):
                    if s_sel[(i * 32 + lane) // PG] == 0:
                        if noaux:
                            c[i] = -T.infinity(f32)
                        else:
                            c[i] = T.float32(0)

            for i in T.unroll(VPT, explicit=True):
                if noaux:  # the bias only steers the choice; the weights are the raw scores
                    s_w[i * 32 + lane] = x[i]
                else:
                    s_w[i * 32 + lane] = c[i]
                key[i] = (T.Cast(u64, _radix_key(c[i])) << T.uint64(32)) | T.Cast(
                    u64, T.int32(0x7FFFFFFF) - (i * 32 + lane)
                )
            # k rounds of warp arg-max: value descending, ties to the lowest expert index
            for p in T.unroll(K, explicit=True):
                best = key[0]
                for i in T.unroll(1, VPT, explicit=True):
                    best = T.max(best, key[i])
                for o in T.unroll(5, explicit=True):
                    best = T.max(best, T.shfl_xor(best, 16 >> o))
                pk[p] = T.Cast(u32, best >> T.uint64(32))
                pi[p] = T.int32(0x7FFFFFFF) - T.Cast(i32, best & T.uint64(0xFFFFFFFF))
                for i in T.unroll(VPT, explicit=True):
                    if i * 32 + lane == pi[p]:
                        key[i] = T.uint64(0)
            T.sync_threads()
            # torch.topk(sorted=False) on CUDA: picks > k-th value by index, then picks == k-th value by index
            for p in T.unroll(K, explicit=True):
                pos[p] = 0
                for q in T.unroll(K, explicit=True):
                    if q != p:
                        pos[p] = pos[p] + T.if_then_else(
                            ((pk[q] != pk[K - 1]) & (pk[p] == pk[K - 1]))
                            | (((pk[q] == pk[K - 1]) == (pk[p] == pk[K - 1])) & (pi[q] < pi[p])),
                            1,
                            0,
                        )
            for j in T.unroll(K, explicit=True):
                io[j] = 0
                for p in T.unroll(K, explicit=True):
                    if pos[p] == j:
                        io[j] = pi[p]
                wo[j] = s_w[io[j]]
            if norm_topk_prob:
                tot = sum_fn([wo[j] for j in range(K)]) + T.float32(1e-20)
                for j in T.unroll(K, explicit=True):
                    wo[j] = wo[j] / tot
            if rsf != 1.0:
                for j in T.unroll(K, explicit=True):
                    wo[j] = wo[j] * T.float32(rsf)
            if lane == 0:
                for j in T.unroll(K, explicit=True):
                    W[bx, j] = wo[j]
                    Ids[bx, j] = io[j]

    return gating_topk


GATING_IDENTITY_CFGS = {
    "v3": (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, "torch_last", True),  # sigmoid, bias, groups, norm
    "v2lite": (64, 6, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False),
}


@compiles
@pytest.mark.parametrize("name", list(GATING_IDENTITY_CFGS))
def test_gating_macro_refactor_keeps_the_generated_source(name, monkeypatch, tmp_path):
    """The standalone gating kernel (now ``_gating_macro`` called once) generates exactly the CUDA source of the
    pre-refactor prim_func."""
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    cfg = GATING_IDENTITY_CFGS[name]
    new = mr._compile(mr.build_gating_topk(*cfg)).get_kernel_source()
    old = mr._compile(_legacy_gating_topk(*cfg)).get_kernel_source()
    assert "__global__" in new and new == old


# ---- GPU ---------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("case", mr.ROUTE_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{c[2]}")
def test_route_matches_gating_then_permute_gpu(case):
    name, t, kind = case
    ok, stats = mr.check_route(name, t, kind, seed=1000 + t, verbose=False)
    assert ok, stats


@gpu
def test_route_fp32_hidden_gpu():
    ok, stats = mr.check_route("v2lite", 5, "ties", seed=3, verbose=False, dtype=torch.float32)
    assert ok, stats


@gpu
def test_route_graph_replay_gpu():
    ok, stats = mr.check_route("v3", 7, "randn", seed=11, verbose=False, graph=True)
    assert ok, stats
