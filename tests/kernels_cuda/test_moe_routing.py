"""kernels_cuda/moe_routing.py (MoE gating top-k, permute, unpermute) and its use by the CUDA kernel set
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

import os
import sys
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

from kernels_cuda import moe_routing as mr  # noqa: E402 (importable without tilelang)

HAS_CUDA = torch.cuda.is_available()


def _has_tilelang():
    try:
        import tilelang  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


gpu = pytest.mark.skipif(
    not (HAS_CUDA and _has_tilelang()), reason="no CUDA device (or no tilelang): GPU numerics run on the H200 only"
)

W_ULP = 2  # gating weights, fp32 ulps
OUT_ULP = 1  # unpermute output, ulps of its dtype


def _gating_params(name):
    from deepinfer_npu.hal.types import GatingParams

    g = mr.GATINGS[name]
    return GatingParams(
        top_k=g.top_k, num_experts=g.num_experts, scoring_func=g.scoring_func, topk_method=g.topk_method,
        n_group=g.n_group, topk_group=g.topk_group, norm_topk_prob=g.norm_topk_prob,
        routed_scaling_factor=g.routed_scaling_factor,
    )


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
    assert _order(mr._sum_last_dim_torch, 8) == "(((0+4)+(2+6))+((1+5)+(3+7)))"
    assert _order(mr._sum_last_dim_torch, 6) == "(((0+4)+2)+((1+5)+3))"
    assert _order(mr._sum_last_dim_torch, 3) == "((0+2)+1)"
    assert _order(mr._sum_last_dim_torch, 1) == "0"
    # torch's strided-dim sum (one thread per output, four interleaved accumulators)
    assert _order(mr._sum_strided_dim_torch, 8) == "((((0+4)+(1+5))+(2+6))+(3+7))"
    assert _order(mr._sum_strided_dim_torch, 6) == "((((0+4)+(1+5))+2)+3)"
    assert _order(mr._sum_strided_dim_torch, 3) == "((0+1)+2)"
    assert _order(mr._sum_sequential, 4) == "(((0+1)+2)+3)"


def test_reasons():
    logits = torch.zeros(4, 64)
    assert mr.gating_reason(logits, None, mr.V2_LITE) is None
    assert mr.gating_reason(torch.zeros(4, 256), None, mr.V3) is None
    assert mr.gating_reason(torch.zeros(4, 160), None, mr.V2) is None
    assert "multiple of 32" in mr.gating_reason(torch.zeros(4, 72), None, mr.Gating(top_k=6, num_experts=72))
    assert "no tokens" in mr.gating_reason(torch.zeros(0, 64), None, mr.V2_LITE)
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
    params = _gating_params("v2lite")
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


# ---- GPU ---------------------------------------------------------------------------------------------------------
GATING_T = [1, 7, 64, 256]


@gpu
@pytest.mark.parametrize("t", GATING_T)
@pytest.mark.parametrize("kind", ["randn", "ties", "mixed"])
@pytest.mark.parametrize("name", ["v2lite", "v3", "v2", "v3-nobias", "v2lite-norm"])
def test_gating_matches_reference_gpu(name, kind, t):
    ok, stats = mr.check_gating(name, t, kind, seed=zlib.crc32(f"{name}-{kind}-{t}".encode()) % 1000, verbose=False)
    assert stats["ids_identical"], stats
    assert stats["w_max_ulp"] <= W_ULP, stats
    assert ok


@gpu
@pytest.mark.parametrize("name", ["v2lite", "v3", "v2"])
def test_gating_all_equal_rows_gpu(name):
    """Every logit equal: all scores tie, the first k experts (of the first groups) win, in index order."""
    ok, stats = mr.check_gating(name, 7, "equal", verbose=False)
    assert ok, stats


@gpu
@pytest.mark.parametrize(
    "case",
    [(1, 6, 64, 2048, "rand"), (7, 6, 64, 2048, "hot"), (64, 6, 64, 2048, "rand"), (256, 6, 64, 2048, "hot"),
     (1, 8, 256, 7168, "rand"), (64, 8, 256, 7168, "hot"), (256, 8, 256, 7168, "rand"), (33, 6, 160, 5120, "rand")],
    ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-D{c[3]}-{c[4]}",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_permute_matches_reference_gpu(case, dtype):
    t, k, e, d, kind = case
    ok, stats = mr.check_permute(t, k, e, d, dtype=dtype, kind=kind, seed=t + k, verbose=False)
    assert ok, stats


@gpu
@pytest.mark.parametrize(
    "case", [(1, 6, 64, 2048), (7, 6, 64, 2048), (64, 6, 64, 2048), (256, 6, 64, 2048), (1, 8, 256, 7168),
             (7, 8, 256, 7168), (64, 8, 256, 7168), (256, 8, 256, 7168)],
    ids=lambda c: f"T{c[0]}-k{c[1]}-D{c[3]}",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_unpermute_matches_reference_gpu(case, dtype):
    t, k, e, d = case
    ok, stats = mr.check_unpermute(t, k, e, d, dtype=dtype, seed=t * k, verbose=False)
    assert stats["ulps"] <= OUT_ULP, stats
    assert ok


@gpu
@pytest.mark.parametrize("case", [(1, 6, 64, 2048), (64, 6, 64, 2048), (5, 8, 256, 7168)],
                         ids=lambda c: f"T{c[0]}-k{c[1]}-D{c[3]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_unpermute_with_addend_is_combine_then_torch_add_gpu(case, dtype):
    """The fused ``+ shared`` variant (moe_combine_add): bit-exact with the reference combine followed by torch's
    add of two tensors of the dtype."""
    t, k, e, d = case
    ok, stats = mr.check_unpermute(t, k, e, d, dtype=dtype, seed=t * k + 1, verbose=False, addend=True)
    assert ok and stats["exact"], stats


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


@gpu
@pytest.mark.parametrize(
    "case", [(1, 6, 64, 2048, "rand"), (64, 6, 64, 2048, "hot"), (7, 8, 256, 7168, "hot"), (33, 6, 160, 5120, "rand"),
             (1, 2, 3, 64, "rand")],
    ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-{c[4]}",
)
def test_permute_with_scan_gpu(case):
    """The permute variant that also writes moe_gemm's expert scan (moe_dispatch_scan): order / counts / rows as
    the plain kernel, and the scan equal to the host reference (scan_ref)."""
    t, k, e, d, kind = case
    ok, stats = mr.check_permute(t, k, e, d, kind=kind, seed=t + e, verbose=False, with_scan=True)
    assert ok, stats


def test_scan_ref_layout():
    """scan_ref: exclusive scan [E + 1], then the experts with rows ascending, -1 padded; the same as moe_gemm's."""
    from kernels_cuda import moe_gemm

    counts = torch.tensor([0, 2, 0, 0, 3, 1])
    assert mr.scan_ref(counts).tolist() == [0, 0, 2, 2, 2, 5, 6, 1, 4, 5, -1, -1, -1]
    assert torch.equal(mr.scan_ref(counts), moe_gemm.expert_starts_ref(counts))
    with pytest.raises(ValueError, match="300 experts; the fused scan handles 1..256"):
        mr.permute(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32), 300, with_scan=True)


@gpu
def test_graph_capture_gpu():
    assert mr.check_graph(verbose=False)


@gpu
@pytest.mark.parametrize("name", ["v2lite", "v3"])
@pytest.mark.parametrize("t", GATING_T)
def test_kernel_set_moe_path_gpu(name, t):
    """CudaKernelSet: gating -> dispatch -> combine on the kernels, same results as the reference ops, and the
    op report names the kernels."""
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    params = _gating_params(name)
    e, d = params.num_experts, mr.HIDDEN[name]
    g = torch.Generator(device="cuda").manual_seed(t)
    logits = torch.randn(t, e, generator=g, device="cuda")
    bias = torch.randn(e, generator=g, device="cuda") * 0.1 if params.topk_method == "noaux_tc" else None
    hidden = torch.randn(t, d, generator=g, device="cuda").to(torch.bfloat16)
    w, ids = ks.moe_gating_topk(logits, bias, params)
    rw, rids = ref_moe.moe_gating_topk(logits, bias, params)
    assert torch.equal(ids, rids) and ids.dtype == torch.int32
    assert mr._ulps_f32(w, rw) <= W_ULP
    sh, counts, state = ks.moe_dispatch(hidden, ids, e)
    rsh, rcounts, rstate = ref_moe.moe_dispatch(hidden, rids, e)
    assert torch.equal(sh, rsh) and torch.equal(counts, rcounts) and counts.dtype == torch.int64
    assert torch.equal(state.order, rstate.order) and state.order.dtype == torch.int64
    assert (state.num_tokens, state.top_k) == (rstate.num_tokens, rstate.top_k)
    expert_out = (sh.float() * 1.5 + 0.25).to(torch.bfloat16)  # stands in for grouped_mlp
    out = ks.moe_combine(expert_out, state, w)
    ref = ref_moe.moe_combine(expert_out, rstate, w)
    assert mr._ulps_bf16(out, ref) <= OUT_ULP
    rep = ks.op_report()
    for op in ("moe_gating_topk", "moe_dispatch", "moe_combine"):
        assert rep[op].startswith("native (kernels_cuda.moe_routing"), rep[op]
