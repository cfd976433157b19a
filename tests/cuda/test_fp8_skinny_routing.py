"""Which FP8 calls the CUDA kernel set sends to ``kernels_cuda.fp8_skinny_gemm`` (``DEEPINFER_FP8_SKINNY=1``) and
with which operands, without a GPU: the device checks are stood in for and the kernel module is replaced by the
reference arithmetic it implements (W8A8, the SwiGLU after a gated GEMM), so each routed op must equal
the CPU reference op bit for bit. The kernel itself is checked on a GPU (tests/kernels_cuda/test_fp8_skinny_gemm.py).
"""

from __future__ import annotations

import types

import pytest
import torch

from deepinfer_npu.backends.cpu import quant as ref
from deepinfer_npu.backends.cpu.linear import silu_and_mul
from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
from deepinfer_npu.backends.cuda.ops import OpConfig
from deepinfer_npu.backends.cuda.ops import quant as quant_ops
from deepinfer_npu.kernels_cuda._testing import expert_starts_ref
from deepinfer_npu.model_executor.quantization.fp8 import quantize_fp8_block

BF16 = torch.bfloat16


class SkinnyStandIn:
    """``fp8_skinny_gemm``'s contract on host tensors: the reference W8A8 GEMM (gated: then ``silu_and_mul``).
    Records each call's (rows, N, K, gated)."""

    def __init__(self):
        self.calls: list[tuple] = []

    @staticmethod
    def reason(a, w, w_scale, gated=False):
        return None

    @staticmethod
    def weight_reason(w, w_scale, gated=False):
        return None

    def fp8_skinny_gemm(self, a, w, w_scale, gated=False):
        self.calls.append((a.shape[0], w.shape[0], w.shape[1], gated))
        y = ref.fp8_linear(a, w, w_scale)
        return silu_and_mul(y) if gated else y


@pytest.fixture
def routed(monkeypatch):
    """A kernel set whose FP8 ops see a Hopper GPU's kernels (stand-ins) and the stand-in one-row GEMM."""
    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "1")
    ks = CudaKernelSet()
    ks.select(OpConfig(dtype=BF16, sm90=True))
    q = ks.impl("quant")
    skinny = SkinnyStandIn()
    gemm = types.SimpleNamespace(reason=lambda *a: None, SWAP_MAX_ROWS=64)
    quant = types.SimpleNamespace(supported=lambda k: k % 16 == 0, MULT_K=16)
    monkeypatch.setattr(q, "_modules", lambda x, name: (quant, gemm, None))
    monkeypatch.setattr(q, "_grouped_reason", lambda *a: None)
    monkeypatch.setattr(q, "use", lambda name: (skinny, None) if name == "fp8_skinny_gemm" else (None, "stand-in"))
    return ks, skinny


def _weight(n, k, *lead, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_block(torch.randn(*lead, n, k, generator=g) * k**-0.5)


def test_one_row_linear_and_mlp_take_one_launch_each(routed):
    ks, skinny = routed
    x = torch.randn(1, 1, 256).to(BF16)
    w, s = _weight(192, 256)
    bias = torch.randn(192).to(BF16)
    assert torch.equal(ks.fp8_linear(x, w, s), ref.fp8_linear(x, w, s))
    got = ks.fp8_linear(x, w, s, bias)  # the bias after the GEMM's bf16 output
    assert torch.equal(got, (ref.fp8_linear(x, w, s).float() + bias.float()).to(BF16))
    gu, sgu = _weight(2 * 384, 256, seed=1)
    dn, sdn = _weight(256, 384, seed=2)
    want = ref.fp8_linear(silu_and_mul(ref.fp8_linear(x, gu, sgu)), dn, sdn)
    assert torch.equal(ks.fp8_dense_mlp(x, gu, sgu, dn, sdn), want)
    assert skinny.calls == [(1, 192, 256, False)] * 2 + [(1, 768, 256, True), (1, 256, 384, False)]
    report = ks.op_report()
    assert "fp8_skinny_gemm" in report["fp8_linear"] and "SwiGLU in the gate/up GEMM" in report["silu_and_mul"]


def test_more_rows_large_weights_and_experts_keep_the_two_kernel_path(routed, monkeypatch):
    """Two rows, a weight past SKINNY_MAX_WEIGHTS (alone, or an MLP's gate/up, the larger half), the switch off,
    or one token's experts: no one-row GEMM (the two-kernel paths, stood in for, are taken instead)."""
    ks, skinny = routed
    q = ks.impl("quant")
    two_kernel = []
    monkeypatch.setattr(q, "_linear", lambda quant, gemm, x2d, w, s, gated=False: two_kernel.append(x2d.shape)
                        or ref.fp8_linear(silu_and_mul(x2d) if gated else x2d, w, s))
    w, s = _weight(192, 256)
    ks.fp8_linear(torch.randn(2, 256).to(BF16), w, s)
    monkeypatch.setattr(quant_ops, "SKINNY_MAX_WEIGHTS", 256 * 256)
    wl, sl = _weight(512, 256, seed=1)  # 2 x the limit
    x = torch.randn(1, 256).to(BF16)
    ks.fp8_linear(x, wl, sl)
    ks.fp8_linear(x, *_weight(256, 256, seed=2))  # at the limit: the one-row GEMM
    dn, sdn = _weight(256, 256, seed=3)
    ks.fp8_dense_mlp(x, wl, sl, dn, sdn)  # gate/up past the limit, down within it: the whole MLP stays
    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "0")
    ks.fp8_linear(torch.randn(1, 256).to(BF16), w, s)
    assert skinny.calls == [(1, 256, 256, False)]
    assert two_kernel == [(2, 256), (1, 256), (1, 256), (1, 512), (1, 256)]
    # one token's experts (6 rows, small weights): fp8_quant + fp8_grouped_gemm for w13 and w2, stood in for
    experts, top_k, d, inter = 16, 6, 256, 384
    g = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.randperm(experts, generator=g)[:top_k], minlength=experts)
    hidden = torch.randn(top_k, d, generator=g).to(BF16)
    w13, s13 = _weight(2 * inter, d, experts, seed=4)
    w2, s2 = _weight(d, inter, experts, seed=5)
    grouped_calls = []
    stand_ins = {
        "fp8_quant": types.SimpleNamespace(quantize=lambda x, gated=False: (x, gated)),
        "fp8_grouped_gemm": types.SimpleNamespace(fp8_grouped_gemm=lambda a, gated, w, s, starts: grouped_calls.append(
            (a.shape[0], w.shape[1], gated, starts.tolist())) or torch.zeros(a.shape[0], w.shape[1], dtype=BF16)),
    }
    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "1")
    monkeypatch.setattr(q.modules, "get", lambda name: stand_ins.get(name))
    monkeypatch.setattr(ks.impl("grouped_mlp"), "expert_starts", lambda mg, c: expert_starts_ref(c))
    assert ks.fp8_grouped_mlp(hidden, counts, w13, s13, w2, s2).shape == (top_k, d)
    starts = expert_starts_ref(counts).tolist()
    assert grouped_calls == [(top_k, 2 * inter, False, starts), (top_k, d, True, starts)]
    assert skinny.calls == [(1, 256, 256, False)]
