"""``backends/cuda/ops/scaled_mm.py``: cuBLASLt's block-scaled GEMM serves a prefill-sized FP8 shape only after its
first call agreed with the tile kernel on the device; a layout it refuses is retried in the other, a shape where
both fail or disagree stays on the tile kernel with the reason, and nothing is checked inside CUDA-graph capture.
Anywhere: ``torch._scaled_mm`` is replaced by stand-ins (the real one is timed and checked against the tile kernel
by ``kernels_cuda/bench.py fp8_gemm`` and, through ``fp8_linear``, by tests/cuda/test_fp8_quant_ops.py on a GPU)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.backends.cuda.ops import scaled_mm as sm
from deepinfer_npu.model_executor.quantization.fp8 import (
    dequantize_fp8_block,
    dequantize_per_token_group,
    quantize_fp8_block,
    quantize_per_token_group,
)


def _operands(m=96, n=256, k=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    aq, sa = quantize_per_token_group(torch.randn(m, k, generator=g))
    w, sw = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.05)
    return aq, sa, w, sw


def _product(aq, sa, w, sw):
    return (dequantize_per_token_group(aq, sa) @ dequantize_fp8_block(w, sw).t()).to(torch.bfloat16)


def _stand_in(calls, refuse=(), wrong=()):
    """torch._scaled_mm on dequantised operands; ``refuse`` / ``wrong``: layouts ("plain": scale_b a view of the
    weight's scales, "padded": of a padded copy) it raises for / answers with a wrong scale."""

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        layout = "plain" if scale_b.t().is_contiguous() else "padded"
        calls.append(layout)
        if layout in refuse:
            raise RuntimeError(f"Invalid scaling configuration ({layout})")
        assert scale_a.stride(0) == 1  # M-major activation scales
        product = (dequantize_per_token_group(a, scale_a) @ dequantize_fp8_block(b.t(), scale_b.t()).t())
        return (product * (3.0 if layout in wrong else 1.0)).to(out_dtype)

    return scaled_mm


def test_the_first_layout_that_agrees_serves_the_shape(monkeypatch):
    calls, tiles = [], []
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(calls, refuse=("plain",)))
    ops = sm.ScaledMM()
    aq, sa, w, sw = _operands()

    def tile():
        tiles.append(1)
        return _product(aq, sa, w, sw)

    out, why = ops.gemm(aq, sa, w, sw, tile)
    assert why is None and torch.equal(out, _product(aq, sa, w, sw))
    assert calls == ["plain", "padded"] and tiles == [1] and ops.layouts == {(256, 384): "padded"}
    out, why = ops.gemm(aq, sa, w, sw, tile)  # checked once: no tile GEMM, no retry
    assert why is None and calls == ["plain", "padded", "padded"] and tiles == [1]


def test_a_shape_that_disagrees_stays_on_the_tile_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(calls, refuse=("plain",), wrong=("padded",)))
    ops = sm.ScaledMM()
    aq, sa, w, sw = _operands()
    out, why = ops.gemm(aq, sa, w, sw, lambda: _product(aq, sa, w, sw))
    assert out is None and "N=256, K=384" in why and "Invalid scaling configuration" in why and "cosine" in why
    assert ops.gemm(aq, sa, w, sw, lambda: pytest.fail("checked twice")) == (None, why) and len(calls) == 2


def test_nothing_is_checked_under_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("called under capture"))
    aq, sa, w, sw = _operands()
    out, why = sm.ScaledMM().gemm(aq, sa, w, sw, lambda: pytest.fail("tile run by the check"))
    assert out is None and "capture" in why


def test_disagreement_names_what_is_off():
    want = torch.randn(8, 16).bfloat16()
    assert sm.disagreement(want.clone(), want) is None
    assert sm.disagreement((want.float() * (1 + 2**-9)).bfloat16(), want) is None  # a rounding apart
    assert "cosine" in sm.disagreement(-want, want)
    assert "relative error" in sm.disagreement(want * 1.1, want)
    assert "non-finite" in sm.disagreement(torch.full_like(want, float("nan")), want)
    assert "expected" in sm.disagreement(want[:4], want)
