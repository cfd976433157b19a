"""The HAL composite ``moe_route`` (gating top-k, then the dispatch) and the CUDA kernel set's choice for it: the
default is exactly ``moe_gating_topk`` + ``moe_dispatch``; where the fused kernel is selected and its module accepts
the step, one launch whose expert scan is handed to ``grouped_mlp`` (once) and whose path both ops report. Runs
without a GPU (a stand-in module for the kernel); the kernel itself: tests/kernels_cuda/test_moe_route_fused.py.
"""

from types import SimpleNamespace

import pytest
import torch
from deepinfer_npu.backends.cpu import moe as ref_moe
from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
from deepinfer_npu.backends.cuda.ops import OpConfig
from deepinfer_npu.hal.types import GatingParams

PARAMS = GatingParams(num_experts=8, top_k=2, scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                      norm_topk_prob=False, routed_scaling_factor=1.0)


def _inputs(t=3, e=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, e, generator=g), torch.randn(t, d, generator=g)


def test_default_moe_route_is_gating_then_dispatch():
    logits, hidden = _inputs()
    for ks in (CpuKernelSet(), CudaKernelSet()):  # CUDA on host tensors: its fallbacks, the same arithmetic
        w, ids, sh, counts, state = ks.moe_route(logits, None, PARAMS, hidden, 8)
        w2, ids2 = ref_moe.moe_gating_topk(logits, None, PARAMS)
        sh2, counts2, state2 = ref_moe.moe_dispatch(hidden, ids2, 8)
        assert torch.equal(w, w2) and torch.equal(ids, ids2) and torch.equal(sh, sh2)
        assert torch.equal(counts, counts2) and torch.equal(state.order, state2.order)
        assert (state.num_tokens, state.top_k) == (3, 2)


def test_cuda_fused_route_where_selected(monkeypatch):
    logits, hidden = _inputs()
    w, ids = ref_moe.moe_gating_topk(logits, None, PARAMS)
    sh, counts, state = ref_moe.moe_dispatch(hidden, ids, 8)
    scan = torch.arange(17, dtype=torch.int32)
    calls = []

    def route(*args):
        calls.append(args)
        return w, ids, sh, counts, state.order, scan

    fake = SimpleNamespace(route=route, route_reason=lambda *a: None)
    ks = CudaKernelSet()
    ks.modules.loaded["moe_routing"] = fake  # the stand-in module for every use of kernels_cuda.moe_routing
    cuda_like = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(ks, "moe_gating_topk", lambda *a: (_ for _ in ()).throw(AssertionError("not fused")))
    # left out of the selection: the two ops (here: the stand-in gating raises, so the unfused path is visible)
    ks.select(OpConfig(skip=frozenset({"moe_route"})))
    with pytest.raises(AssertionError, match="not fused"):
        ks.moe_route(logits, None, PARAMS, cuda_like, 8)
    ks.select(OpConfig())
    out = ks.moe_route(logits, None, PARAMS, cuda_like, 8)
    assert len(calls) == 1 and out[0] is w and out[1] is ids and out[2] is sh and out[3] is counts
    assert out[4].order is state.order and (out[4].num_tokens, out[4].top_k) == (3, 2)
    assert ks.dispatch_scan == (counts, scan)
    grouped = ks.impl("grouped_mlp")
    assert grouped.expert_starts(None, counts) is scan and ks.dispatch_scan is None  # grouped_mlp takes it, once
    rep = ks.op_report()
    assert rep["moe_gating_topk"].startswith("native (kernels_cuda.moe_routing route")
    assert rep["moe_dispatch"] == rep["moe_gating_topk"]
    ks.modules.loaded["moe_routing"] = SimpleNamespace(route_reason=lambda *a: None)  # without the kernel: two ops
    with pytest.raises(AssertionError, match="not fused"):
        ks.moe_route(logits, None, PARAMS, cuda_like, 8)
    ks.modules.loaded["moe_routing"] = fake
    fake.route_reason = lambda *a: "17 tokens > 16"  # the kernel refuses: the two ops again
    with pytest.raises(AssertionError, match="not fused"):
        ks.moe_route(logits, None, PARAMS, cuda_like, 8)
