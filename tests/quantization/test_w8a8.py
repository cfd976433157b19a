"""INT8 W8A8 (per-channel weights, per-token dynamic activations): numerics, the reference ops, and the reference
model quantised at load."""

from __future__ import annotations

import json

import torch

from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.config import REFERENCE_MODEL_DIR as REF
from deepinfer_npu.hal import get_backend
from deepinfer_npu.model_executor import DeepseekModelConfig, build_model, load_weights
from deepinfer_npu.model_executor.quantization import dequantize_int8_rows, quantize_int8_rows
from tests.quantization.test_reference_fp8 import _slice_loss

K = CpuKernelSet()


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_int8_rows_match_a_row_loop():
    torch.manual_seed(0)
    w = torch.randn(3, 40, 70) * torch.logspace(-2, 1, 40)[:, None]
    q, s = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and s.shape == (3, 40)
    for e in range(3):
        for r in range(40):
            scale = w[e, r].abs().max() / 127.0
            assert s[e, r] == scale and torch.equal(q[e, r], torch.round(w[e, r] / scale).to(torch.int8))
    assert ((dequantize_int8_rows(q, s) - w).abs() <= s.unsqueeze(-1) / 2 + 1e-7).all()  # half a step


def test_w8a8_linear_is_the_exact_int_product_scaled():
    torch.manual_seed(1)
    x, w, bias = torch.randn(2, 5, 300), torch.randn(96, 300) * 0.05, torch.randn(96)
    wq, ws = quantize_int8_rows(w)
    got = K.w8a8_linear(x, wq, ws, bias)
    xq, xs = quantize_int8_rows(x.reshape(-1, 300))
    want = (xq.double() @ wq.double().t()) * xs.double()[:, None] * ws.double() + bias.double()
    # tolerance: the fp32 scaling of an exact int32 sum
    torch.testing.assert_close(got, want.float().view(2, 5, 96), rtol=1e-6, atol=1e-5)
    assert _rel(got, x @ w.t() + bias) < 0.02


def test_w8a8_grouped_mlp_matches_per_expert_composition():
    torch.manual_seed(2)
    w13, w2 = torch.randn(3, 64, 48) * 0.1, torch.randn(3, 48, 32) * 0.1
    (q13, s13), (q2, s2) = quantize_int8_rows(w13), quantize_int8_rows(w2)
    counts, x = torch.tensor([2, 3, 0]), torch.randn(5, 48)
    got = K.w8a8_grouped_mlp(x, counts, q13, s13, q2, s2)
    want = torch.cat([K.w8a8_linear(K.silu_and_mul(K.w8a8_linear(r, q13[e], s13[e])), q2[e], s2[e])
                      for e, r in ((0, x[:2]), (1, x[2:]))])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _rel(got, K.grouped_mlp(x, counts, w13, w2)) < 0.03


def test_reference_model_w8a8_at_load_keeps_heldout_loss_within_1_percent():
    check = json.loads((REF / "heldout_check.json").read_text())
    model = build_model(DeepseekModelConfig.from_pretrained(REF), get_backend("cpu"), torch.float32,
                        quantization="w8a8")
    load_weights(model, REF)
    experts = model.model.layers[1].mlp.experts
    assert experts.w13.dtype == torch.int8 and experts.w13_scale.shape == (8, 64)
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.int8
    loss = _slice_loss(model, check["token_ids"])
    assert abs(loss - check["expected_loss"]) / check["expected_loss"] < 0.01, loss


def test_dummy_w8a8_weights_are_the_quantised_dummy_weights():
    cfg = DeepseekModelConfig.from_pretrained(REF)
    ref = build_model(cfg, get_backend("cpu"), torch.float32)
    load_weights(ref, load_format="dummy")
    q = build_model(cfg, get_backend("cpu"), torch.float32, quantization="w8a8")
    load_weights(q, load_format="dummy")
    want = quantize_int8_rows(ref.model.layers[2].mlp.experts.w2)
    got = q.model.layers[2].mlp.experts
    assert torch.equal(got.w2, want[0]) and torch.equal(got.w2_scale, want[1])
