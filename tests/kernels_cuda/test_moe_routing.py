"""kernels_cuda.moe_routing (MoE gating top-k, permute, unpermute, and the fused route) and its use by the CUDA kernel set
(``moe_gating_topk``, ``moe_dispatch``, ``moe_combine``).

Tolerances, against the reference ops (backends/cpu/moe.py) run on the same CUDA tensors:
- gating: ids identical, in the same order (torch.topk(sorted=False)'s CUDA order: picks greater than the k-th value
  by index, then picks equal to it by index); weights within 2 fp32 ulp. Bit-exact is expected (the scores use
  torch's own softmax / sigmoid arithmetic, the normalisation sum torch's reduction tree); 2 ulp allows for a
  different normalisation summation order.
- permute: order, counts (int64) and the gathered rows identical.
- unpermute: within 1 ulp of the output dtype (bit-exact expected: products rounded to fp32, torch's summation
  order, one rounding).
Configurations: V2-Lite (softmax, greedy, 64 experts, top-6), V2 (softmax, group_limited_greedy, 160 experts,
8 groups, 3 kept, top-6, scale 16), V3 (sigmoid, noaux_tc with the correction bias, 256 experts, 8 groups, 4 kept,
top-8, normalised, scale 2.5); T in {1, 7, 64, 256}; ties (integer logits, all-equal rows). The GPU tests skip
without a CUDA device; the selection tests run anywhere.
"""

import zlib

import pytest
import torch

from deepinfer_npu.backends.cpu import moe as ref
from deepinfer_npu.hal.types import DispatchState, GatingParams
from deepinfer_npu.kernels_cuda import _moe_gating as gating_kernel
from deepinfer_npu.kernels_cuda import moe_routing as mr
from deepinfer_npu.kernels_cuda._testing import (
    GATINGS,
    HIDDEN,
    V2,
    V2_LITE,
    V3,
    bf16_ulps,
    expert_starts_ref,
    f32_ulps,
    router_logits,
)

W_ULP = 2  # gating weights, fp32 ulps
OUT_ULP = 1  # unpermute output, ulps of its dtype
ROUTE_CASES = [("v2lite", t, kind) for t in (1, 2, 5, 16) for kind in ("randn", "ties")] + [
    ("v3", t, kind) for t in (1, 3, 16) for kind in ("randn", "ties")] + [
    ("v2lite", 7, "equal"), ("v3", 16, "equal"), ("v3-nobias", 4, "mixed"), ("v2", 9, "ties")]


def bf16_max_ulps(a, b):
    return bf16_ulps(a, b).max().item() if a.numel() else 0


def permute_ref(hidden, ids, num_experts):
    """The CPU reference dispatch as the kernel's outputs: (sorted rows, counts, order)."""
    sorted_hidden, counts, state = ref.moe_dispatch(hidden, ids, num_experts)
    return sorted_hidden, counts, state.order


def unpermute_ref(expert_out, order, weights, num_tokens, top_k):
    return ref.moe_combine(expert_out, DispatchState(order=order, num_tokens=num_tokens, top_k=top_k), weights)


def check_gating(name, t, kind, seed=0, norm_order="torch_last"):
    """ids identical (order too) to the reference on CUDA; weights within 2 fp32 ulp (0 when the sum orders
    match torch's). Returns (ok, stats)."""
    params = GATINGS[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = router_logits(t, params.num_experts, kind, g)
    bias = None
    if params.topk_method == "noaux_tc" and name != "v3-nobias":
        bias = torch.randn(params.num_experts, generator=g, device="cuda") * 0.1
        if kind != "randn":  # bias ties too
            bias = torch.round(bias * 10) / 10
    w, ids = mr.gating_topk(logits, bias, params, norm_order=norm_order)
    rw, rids = ref.moe_gating_topk(logits, bias, params)
    same_ids = torch.equal(ids, rids)
    same_sets = torch.equal(ids.sort(-1).values, rids.sort(-1).values)
    ulps = f32_ulps(w, rw) if same_ids else float("inf")
    ok = same_ids and ulps <= 2
    stats = dict(ids_identical=same_ids, sets_identical=same_sets, w_max_ulp=ulps,
                 w_bitexact=bool(same_ids and torch.equal(w, rw)))
    return ok, stats


def check_permute(t, k, e, d, dtype=torch.bfloat16, kind="rand", seed=0, with_scan=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(t, d, generator=g, device="cuda").to(dtype)
    if kind == "rand":  # distinct experts per token, as top-k gives
        ids = torch.rand(t, e, generator=g, device="cuda").argsort(-1)[:, :k].to(torch.int32)
    else:  # 'hot': most tokens pick the same few experts (long runs of equal ids)
        ids = (torch.arange(k, device="cuda").repeat(t, 1) + (torch.rand(t, 1, generator=g, device="cuda") < 0.2)
               * torch.randint(0, e - k, (t, 1), generator=g, device="cuda")).to(torch.int32)
    sh, counts, order, *scan = mr.permute(hidden, ids, e, with_scan=with_scan)
    rsh, rcounts, rorder = permute_ref(hidden, ids, e)
    ok_o, ok_c, ok_h = torch.equal(order, rorder), torch.equal(counts, rcounts), torch.equal(sh, rsh)
    ok_s = not with_scan or torch.equal(scan[0].cpu(), expert_starts_ref(rcounts))
    ok = ok_o and ok_c and ok_h and ok_s and order.dtype == rorder.dtype and counts.dtype == rcounts.dtype
    return ok, dict(order=ok_o, counts=ok_c, rows=ok_h, scan=ok_s)


def check_route(name, t, kind="randn", seed=0, dtype=torch.bfloat16, graph=False):
    """The fused route against gating_topk + permute(with_scan=True) (every output bit-identical: weights, ids,
    rows, counts, order, scan) and against the torch references (ids / order / counts / rows / scan identical,
    weights within 2 fp32 ulp, bit-exact expected). ``graph``: the fused launch captured in a CUDA graph and
    replayed on new logits. Returns (ok, stats)."""
    params = GATINGS[name]
    e, d = params.num_experts, HIDDEN[name.split("-")[0]]
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = router_logits(t, e, kind, g)
    bias = None
    if params.topk_method == "noaux_tc" and name != "v3-nobias":
        bias = torch.randn(e, generator=g, device="cuda") * 0.1
        if kind != "randn":  # bias ties too
            bias = torch.round(bias * 10) / 10
    hidden = torch.randn(t, d, generator=g, device="cuda").to(dtype)
    assert mr.route_reason(logits, bias, params, hidden, e) is None, mr.route_reason(logits, bias, params, hidden, e)
    if graph:
        mr.route(logits, bias, params, hidden, e)  # compile outside the capture
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            got = mr.route(logits, bias, params, hidden, e)
        logits.copy_(router_logits(t, e, kind, g))
        gr.replay()
    else:
        got = mr.route(logits, bias, params, hidden, e)
    w, ids = mr.gating_topk(logits, bias, params)
    sep = (w, ids, *mr.permute(hidden, ids, e, with_scan=True))
    rw, rids = ref.moe_gating_topk(logits, bias, params)
    rsh, rcounts, rorder = permute_ref(hidden, rids, e)
    names = ("weights", "ids", "rows", "counts", "order", "scan")
    st = {f"{n}_vs_kernels": bool(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
          for n, a, b in zip(names, got, sep)}
    want = dict(ids=rids, rows=rsh, counts=rcounts, order=rorder)
    for n, a in zip(names, got):
        if n in want:
            st[f"{n}_vs_ref"] = bool(a.dtype == want[n].dtype and torch.equal(a, want[n]))
    st["scan_vs_ref"] = torch.equal(got[5].cpu(), expert_starts_ref(rcounts))
    st["w_max_ulp_vs_ref"] = f32_ulps(got[0], rw) if st["ids_vs_ref"] else float("inf")
    ok = all(v for key, v in st.items() if key != "w_max_ulp_vs_ref") and st["w_max_ulp_vs_ref"] <= 2
    return ok, st


def check_unpermute(t, k, e, d, dtype=torch.bfloat16, seed=0, sum_order="torch_strided", addend=False,
                    by_position=False):
    """Exact (0 ulp) when the summation order matches torch's; must be within 1 ulp of the output dtype.
    ``addend``: the fused ``+ shared`` variant against the reference combine followed by torch's add;
    ``by_position``: the variant reading the order's inverse (prefill sizes)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, e, generator=g, device="cuda").argsort(-1)[:, :k]
    order = torch.argsort(ids.reshape(-1), stable=True)
    expert_out = (torch.randn(t * k, d, generator=g, device="cuda") * 3).to(dtype)
    weights = torch.rand(t, k, generator=g, device="cuda") * 2
    add = (torch.randn(t, d, generator=g, device="cuda") * 2).to(dtype) if addend else None
    out = mr.unpermute(expert_out, order, weights, t, k, sum_order=sum_order, addend=add, by_position=by_position)
    want = unpermute_ref(expert_out, order, weights, t, k)
    if addend:
        want = want + add
    ulps = bf16_max_ulps(out, want) if dtype == torch.bfloat16 else f32_ulps(out, want)
    exact = torch.equal(out, want)
    ok = ulps <= 1
    return ok, dict(ulps=ulps, exact=exact)


def check_graph():
    """The three kernels captured in one CUDA graph (no host reads), replayed on new inputs."""
    params, d = V3, 1024
    t, k, e = 64, params.top_k, params.num_experts
    logits = torch.randn(t, e, device="cuda")
    bias = torch.randn(e, device="cuda") * 0.1
    hidden = torch.randn(t, d, device="cuda").to(torch.bfloat16)
    mr.gating_topk(logits, bias, params)  # compile outside the capture
    w, ids = mr.gating_topk(logits, bias, params)
    sh, counts, order = mr.permute(hidden, ids, e)
    mr.unpermute(sh, order, w, t, k)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        w, ids = mr.gating_topk(logits, bias, params)
        sh, counts, order = mr.permute(hidden, ids, e)
        out = mr.unpermute(sh, order, w, t, k)
    logits.copy_(torch.randn(t, e, device="cuda"))
    hidden.copy_(torch.randn(t, d, device="cuda").to(torch.bfloat16))
    gr.replay()
    rw, rids = ref.moe_gating_topk(logits, bias, params)
    rsh, rcounts, rorder = permute_ref(hidden, rids, e)
    rout = unpermute_ref(rsh, rorder, rw, t, k)
    ok = torch.equal(ids, rids) and torch.equal(order, rorder) and torch.equal(counts, rcounts)
    ok = ok and bf16_max_ulps(out, rout) <= 1
    return ok


# ---- anywhere ----------------------------------------------------------------------------------------------------
class _Sym:
    """Records the association of a sum: str(_Sym) is the fully parenthesised expression."""

    def __init__(self, s):
        self.s = s

    def __add__(self, other):
        return _Sym(f"({self.s}+{other.s})")


def _order(fn, k):
    return fn([_Sym(str(i)) for i in range(k)]).s


def test_summation_orders():
    # torch's last-dim sum (block.x = last_pow2(k) threads, then a shfl_down tree, offsets decreasing)
    assert _order(gating_kernel._sum_last_dim_torch, 8) == "(((0+4)+(2+6))+((1+5)+(3+7)))"
    assert _order(gating_kernel._sum_last_dim_torch, 6) == "(((0+4)+2)+((1+5)+3))"
    assert _order(gating_kernel._sum_last_dim_torch, 3) == "((0+2)+1)"
    assert _order(gating_kernel._sum_last_dim_torch, 1) == "0"
    # torch's strided-dim sum (one thread per output, four interleaved accumulators)
    assert _order(gating_kernel._sum_strided_dim_torch, 8) == "((((0+4)+(1+5))+(2+6))+(3+7))"
    assert _order(gating_kernel._sum_strided_dim_torch, 6) == "((((0+4)+(1+5))+2)+3)"
    assert _order(gating_kernel._sum_strided_dim_torch, 3) == "((0+1)+2)"
    assert _order(gating_kernel._sum_sequential, 4) == "(((0+1)+2)+3)"


def test_reasons():
    logits = torch.zeros(4, 64)
    assert mr.gating_reason(logits, None, V2_LITE) is None
    assert mr.gating_reason(torch.zeros(4, 256), None, V3) is None
    assert mr.gating_reason(torch.zeros(4, 160), None, V2) is None
    assert "multiple of 32" in mr.gating_reason(torch.zeros(4, 72), None, GatingParams(top_k=6, num_experts=72))
    assert "no tokens" in mr.gating_reason(torch.zeros(0, 64), None, V2_LITE)
    hidden, ids = torch.zeros(4, 2048, dtype=torch.bfloat16), torch.zeros(4, 6, dtype=torch.int32)
    assert mr.permute_reason(hidden, ids, 64) is None
    assert "bf16 / fp32" in mr.permute_reason(hidden.half(), ids, 64)
    big = torch.zeros(mr.MAX_ASSIGN // 8 + 1, 8, dtype=torch.int32)
    assert "assignments" in mr.permute_reason(torch.zeros(big.shape[0], 64, dtype=torch.bfloat16), big, 64)
    order = torch.arange(24)
    assert mr.unpermute_reason(torch.zeros(24, 2048, dtype=torch.bfloat16), order, torch.zeros(4, 6), 4, 6) is None
    assert "order" in mr.unpermute_reason(torch.zeros(24, 64, dtype=torch.bfloat16), order.int(), torch.zeros(4, 6),
                                          4, 6)


def test_host_tensors_take_the_reference_with_a_reason():
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    rep = ks.op_report()
    for op in ("moe_gating_topk", "moe_dispatch", "moe_combine"):
        assert rep[op].startswith("pending (kernels_cuda.moe_routing"), rep[op]
    params = GATINGS["v2lite"]
    logits = torch.randn(5, 64)
    w, ids = ks.moe_gating_topk(logits, None, params)
    rw, rids = ref_moe.moe_gating_topk(logits, None, params)
    assert torch.equal(w, rw) and torch.equal(ids, rids)
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    sh, counts, state = ks.moe_dispatch(hidden, ids, 64)
    rsh, rcounts, rstate = ref_moe.moe_dispatch(hidden, ids, 64)
    assert torch.equal(sh, rsh) and torch.equal(counts, rcounts) and torch.equal(state.order, rstate.order)
    assert torch.equal(ks.moe_combine(sh, state, w), ref_moe.moe_combine(rsh, rstate, rw))
    rep = ks.op_report()
    assert rep["moe_gating_topk"] == "fallback (reference (tensor not on a CUDA device))", rep["moe_gating_topk"]
    assert "(tensor not on a CUDA device)" in rep["moe_dispatch"], rep["moe_dispatch"]
    assert "(tensor not on a CUDA device)" in rep["moe_combine"], rep["moe_combine"]


@pytest.mark.parametrize("experts", [8, 64, 255, 256, 384, 40000])
def test_composed_dispatch_sorts_narrow_keys_into_the_reference_order(experts):
    """The composed dispatch (past the permute kernel's limits) sorts the expert ids as the narrowest integer that
    holds them (fewer radix passes on CUDA): the stable order, counts and rows are the reference's, a sink slot
    (id == E) and heavy ties included."""
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.backends.cuda.ops.moe_routing import sort_key_dtype

    assert sort_key_dtype(experts) == (torch.uint8 if experts <= 255 else torch.int16 if experts <= 32767
                                       else torch.int32)
    g = torch.Generator().manual_seed(experts)
    t, k = 1500, 6
    ids = torch.randint(0, min(experts, 12), (t, k), generator=g)  # few distinct ids: long runs of ties
    ids[::7, 0] = experts  # the bound itself (a sink slot)
    ids[1::5, 1] = experts - 1
    hidden = torch.randn(t, 16, generator=g).to(torch.bfloat16)
    sh, counts, state = CudaKernelSet().moe_dispatch(hidden, ids, experts + 1)
    rsh, rcounts, rstate = ref_moe.moe_dispatch(hidden, ids, experts + 1)
    assert torch.equal(state.order, rstate.order) and torch.equal(counts, rcounts) and torch.equal(sh, rsh)


# ---- the fused route (gating + permute with the expert scan, decode batches) --------------------------------------
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


def _args(t=1, e=64, params=V2_LITE, d=2048, hidden_dtype=torch.bfloat16, fake=True):
    logits = torch.zeros(t, e)
    hidden = torch.zeros(t, d, dtype=hidden_dtype)
    if fake:
        logits, hidden = _FakeCuda(logits), _FakeCuda(hidden)
    return logits, None, params, hidden, e


def test_route_reason_accepts_decode_batches():
    assert mr.MAX_ROUTE_TOKENS == 16
    for t in (1, 5, 16):
        assert mr.route_reason(*_args(t)) is None
    assert mr.route_reason(*_args(16, 256, V3, 7168)) is None
    assert mr.route_reason(*_args(3, 160, V2, 5120)) is None


def test_route_reason_limits():
    why = mr.route_reason(*_args(17))
    assert why is not None and "17 tokens" in why and "MAX_ROUTE_TOKENS 16" in why
    why = mr.route_reason(*_args(2, 288, GatingParams(top_k=8, num_experts=288)))
    assert why is not None and "288 experts" in why and f"MAX_SCAN_EXPERTS {mr.MAX_SCAN_EXPERTS}" in why
    why = mr.route_reason(*_args(2, 64, V3))
    assert why is not None and "64" in why and "256" in why  # num_experts vs the gating's
    why = mr.route_reason(*_args(2, hidden_dtype=torch.float16))
    assert why is not None and "float16" in why and "bf16 / fp32" in why
    logits, bias, params, hidden, e = _args(2)
    why = mr.route_reason(_FakeCuda(torch.zeros(2, 64, dtype=torch.int32)), bias, params, hidden, e)
    assert why is not None and "int32" in why and "floating-point" in why
    why = mr.route_reason(*_args(2, d=2044))  # the permute's row vector width
    assert why is not None and "multiple of 8" in why
    why = mr.route_reason(*_args(2, 72, GatingParams(top_k=6, num_experts=72)))
    assert why is not None and "multiple of 32" in why  # the gating's own limit
    why = mr.route_reason(torch.zeros(2, 64), None, V2_LITE, _FakeCuda(torch.zeros(2, 2048)), 64)
    assert why is not None and "not on a CUDA device" in why
    why = mr.route_reason(*_args(2, fake=False))  # host tensors
    assert why is not None and "not on a CUDA device" in why
    why = mr.route_reason(_FakeCuda(torch.zeros(2, 64)), None, V2_LITE,
                          _FakeCuda(torch.zeros(3, 2048, dtype=torch.bfloat16)), 64)
    assert why is not None and "T=2" in why and "(3, 2048)" in why  # hidden's tokens != the logits'
    with pytest.raises(ValueError, match="17 tokens > MAX_ROUTE_TOKENS 16"):
        mr.route(torch.zeros(17, 64), None, V2_LITE, torch.zeros(17, 2048, dtype=torch.bfloat16), 64)


def test_route_kind_is_cached_and_ci_compiled():
    assert "route" in mr._CACHE.builders
    ci = [cfg for kind, cfg in mr.CI_CONFIGS if kind == "route"]
    assert ci and all(len(cfg) == 12 for cfg in ci)
    assert mr._route_cfg(V3, 7168, "bfloat16", True) in ci
    assert mr._route_cfg(V2_LITE, 2048, "bfloat16", False) in ci


# ---- GPU ---------------------------------------------------------------------------------------------------------
GATING_T = [1, 7, 64, 256]


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("t", GATING_T)
@pytest.mark.parametrize("kind", ["randn", "ties", "mixed"])
@pytest.mark.parametrize("name", ["v2lite", "v3", "v2", "v3-nobias", "v2lite-norm"])
def test_gating_matches_reference_gpu(name, kind, t):
    ok, stats = check_gating(name, t, kind, seed=zlib.crc32(f"{name}-{kind}-{t}".encode()) % 1000)
    assert stats["ids_identical"], stats
    assert stats["w_max_ulp"] <= W_ULP, stats
    assert ok


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("name", ["v2lite", "v3", "v2"])
def test_gating_all_equal_rows_gpu(name):
    """Every logit equal: all scores tie, the first k experts (of the first groups) win, in index order."""
    ok, stats = check_gating(name, 7, "equal")
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize(
    "case",
    [(1, 6, 64, 2048, "rand"), (7, 6, 64, 2048, "hot"), (64, 6, 64, 2048, "rand"), (256, 6, 64, 2048, "hot"),
     (1, 8, 256, 7168, "rand"), (64, 8, 256, 7168, "hot"), (256, 8, 256, 7168, "rand"), (33, 6, 160, 5120, "rand")],
    ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-D{c[3]}-{c[4]}",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_permute_matches_reference_gpu(case, dtype):
    t, k, e, d, kind = case
    ok, stats = check_permute(t, k, e, d, dtype=dtype, kind=kind, seed=t + k)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize(
    "case", [(1, 6, 64, 2048), (7, 6, 64, 2048), (64, 6, 64, 2048), (256, 6, 64, 2048), (1, 8, 256, 7168),
             (7, 8, 256, 7168), (64, 8, 256, 7168), (256, 8, 256, 7168)],
    ids=lambda c: f"T{c[0]}-k{c[1]}-D{c[3]}",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_unpermute_matches_reference_gpu(case, dtype):
    t, k, e, d = case
    ok, stats = check_unpermute(t, k, e, d, dtype=dtype, seed=t * k)
    assert stats["ulps"] <= OUT_ULP, stats
    assert ok


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", [(1, 6, 64, 2048), (64, 6, 64, 2048), (5, 8, 256, 7168)],
                         ids=lambda c: f"T{c[0]}-k{c[1]}-D{c[3]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_unpermute_with_addend_is_combine_then_torch_add_gpu(case, dtype):
    """The fused ``+ shared`` variant (moe_combine_add): bit-exact with the reference combine followed by torch's
    add of two tensors of the dtype."""
    t, k, e, d = case
    ok, stats = check_unpermute(t, k, e, d, dtype=dtype, seed=t * k + 1, addend=True)
    assert ok and stats["exact"], stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", [(5, 6, 64, 2048), (1366, 6, 64, 2048), (4096, 6, 64, 2048), (1100, 8, 256, 7168)],
                         ids=lambda c: f"T{c[0]}-k{c[1]}-D{c[3]}")
@pytest.mark.parametrize("addend", [False, True], ids=["plain", "addend"])
def test_unpermute_by_position_matches_reference_gpu(case, addend):
    """The variant reading the order's inverse (prefill steps, T*k above MAX_ASSIGN included): bit-exact with the
    reference combine (and torch's add)."""
    t, k, e, d = case
    ok, stats = check_unpermute(t, k, e, d, seed=t + k, addend=addend, by_position=True)
    assert ok and stats["exact"], stats


@pytest.mark.gpu
@pytest.mark.tilelang
def test_kernel_set_combine_at_prefill_sizes_gpu():
    """A 2048-token V2-Lite step (12288 assignments > MAX_ASSIGN): dispatch composed in torch (the reference's
    order from a sort of uint8 keys), the combine (with and without the shared experts' addend) on the kernel by
    position, bit-exact with the reference."""
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    params, t = GATINGS["v2lite"], 2048
    e, d = params.num_experts, HIDDEN["v2lite"]
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(t, e, generator=g, device="cuda")
    hidden = torch.randn(t, d, generator=g, device="cuda").to(torch.bfloat16)
    w, ids = ks.moe_gating_topk(logits, None, params)
    sh, counts, state = ks.moe_dispatch(hidden, ids, e)
    assert state.order.numel() > mr.MAX_ASSIGN
    _rsh, rcounts, rstate = ref_moe.moe_dispatch(hidden.cpu(), ids.cpu(), e)  # the sort on uint8 keys on CUDA
    assert torch.equal(state.order.cpu(), rstate.order) and torch.equal(counts.cpu(), rcounts)
    expert_out = (sh.float() * 1.5 + 0.25).to(torch.bfloat16)
    ref = ref_moe.moe_combine(expert_out, state, w)
    assert torch.equal(ks.moe_combine(expert_out, state, w), ref)
    assert "by position" in ks.op_report()["moe_combine"]
    shared = torch.randn(t, d, generator=g, device="cuda").to(torch.bfloat16)
    assert torch.equal(ks.moe_combine_add(expert_out, state, w, shared), ref + shared)
    assert "addend" in ks.op_report()["moe_combine"] and "by position" in ks.op_report()["moe_combine"]


def test_unpermute_reason_by_position_lifts_the_assignment_limit():
    t = mr.MAX_ASSIGN // 6 + 1
    n = 6 * t
    args = (torch.zeros(n, 2048, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.int64), torch.zeros(t, 6), t, 6)
    assert "assignments" in mr.unpermute_reason(*args)
    assert mr.unpermute_reason(*args, by_position=True) is None
    assert mr.unpermute_cfg(2048, 6, "bfloat16", by_position=True) == (2048, 6, "bfloat16", "torch_strided", 128,
                                                                      False, True)
    assert mr.unpermute_cfg(2048, 6, "bfloat16") == (2048, 6, "bfloat16", "torch_strided")


def test_moe_combine_add_on_host_tensors_is_combine_plus_add():
    """Off the device (and while the fused kernel is gated) the composite is the combine, then the add."""
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(4)]).int()
    w = torch.rand(4, 6, generator=g)
    sh, _counts, state = ref_moe.moe_dispatch(torch.randn(4, 64, generator=g).to(torch.bfloat16), ids, 64)
    shared = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    got = ks.moe_combine_add(sh, state, w, shared)
    assert torch.equal(got, ref_moe.moe_combine(sh, state, w) + shared)
    with pytest.raises(AssertionError):  # the control: a different rounding must not pass the comparison
        ref = (ref_moe.moe_combine(sh, state, w).float() + shared.float() * 1.001).to(torch.bfloat16)
        assert torch.equal(got, ref)
    wrong = mr.addend_reason(sh, shared[:3], 4)
    assert wrong is not None and "[3, 64]" in wrong and "[4, 64]" in wrong


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize(
    "case", [(1, 6, 64, 2048, "rand"), (64, 6, 64, 2048, "hot"), (7, 8, 256, 7168, "hot"), (33, 6, 160, 5120, "rand"),
             (1, 2, 3, 64, "rand")],
    ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-{c[4]}",
)
def test_permute_with_scan_gpu(case):
    """The permute variant that also writes moe_gemm's expert scan (moe_dispatch_scan): order / counts / rows as
    the plain kernel, and the scan equal to the host reference (scan_ref)."""
    t, k, e, d, kind = case
    ok, stats = check_permute(t, k, e, d, kind=kind, seed=t + e, with_scan=True)
    assert ok, stats


def test_scan_ref_layout():
    """The fused scan's reference: exclusive scan [E + 1], then the experts with rows ascending, -1 padded."""
    counts = torch.tensor([0, 2, 0, 0, 3, 1])
    assert expert_starts_ref(counts).tolist() == [0, 0, 2, 2, 2, 5, 6, 1, 4, 5, -1, -1, -1]
    with pytest.raises(ValueError, match="300 experts; the fused scan handles 1..256"):
        mr.permute(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32), 300, with_scan=True)


@pytest.mark.gpu
@pytest.mark.tilelang
def test_graph_capture_gpu():
    assert check_graph()


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("name", ["v2lite", "v3"])
@pytest.mark.parametrize("t", GATING_T)
def test_kernel_set_moe_path_gpu(name, t):
    """CudaKernelSet: gating -> dispatch -> combine on the kernels, same results as the reference ops, and the
    op report names the kernels."""
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    params = GATINGS[name]
    e, d = params.num_experts, HIDDEN[name]
    g = torch.Generator(device="cuda").manual_seed(t)
    logits = torch.randn(t, e, generator=g, device="cuda")
    bias = torch.randn(e, generator=g, device="cuda") * 0.1 if params.topk_method == "noaux_tc" else None
    hidden = torch.randn(t, d, generator=g, device="cuda").to(torch.bfloat16)
    w, ids = ks.moe_gating_topk(logits, bias, params)
    rw, rids = ref_moe.moe_gating_topk(logits, bias, params)
    assert torch.equal(ids, rids) and ids.dtype == torch.int32
    assert f32_ulps(w, rw) <= W_ULP
    sh, counts, state = ks.moe_dispatch(hidden, ids, e)
    rsh, rcounts, rstate = ref_moe.moe_dispatch(hidden, rids, e)
    assert torch.equal(sh, rsh) and torch.equal(counts, rcounts) and counts.dtype == torch.int64
    assert torch.equal(state.order, rstate.order) and state.order.dtype == torch.int64
    assert (state.num_tokens, state.top_k) == (rstate.num_tokens, rstate.top_k)
    expert_out = (sh.float() * 1.5 + 0.25).to(torch.bfloat16)  # stands in for grouped_mlp
    out = ks.moe_combine(expert_out, state, w)
    ref = ref_moe.moe_combine(expert_out, rstate, w)
    assert bf16_max_ulps(out, ref) <= OUT_ULP
    rep = ks.op_report()
    for op in ("moe_gating_topk", "moe_dispatch", "moe_combine"):
        assert rep[op].startswith("native (kernels_cuda.moe_routing"), rep[op]


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{c[2]}")
def test_route_matches_gating_then_permute_gpu(case):
    name, t, kind = case
    ok, stats = check_route(name, t, kind, seed=1000 + t)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
def test_route_fp32_hidden_gpu():
    ok, stats = check_route("v2lite", 5, "ties", seed=3, dtype=torch.float32)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
def test_route_graph_replay_gpu():
    ok, stats = check_route("v3", 7, "randn", seed=11, graph=True)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
def test_sequential_sums_differ_from_torch_orders_gpu():
    """The control for the bit-exact results: the sequential sum instead of torch's orders shows ulp differences,
    so the exact matches above do tell the summation orders apart."""
    assert check_gating("v3", 256, "randn", seed=7, norm_order="seq")[1]["w_max_ulp"] > 0
    assert check_unpermute(256, 8, 256, 7168, seed=7, sum_order="seq")[1]["ulps"] > 0
