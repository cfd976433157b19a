"""FP8 codes written by the norm before a projection (``DEEPINFER_FP8_NORM_QUANT=1``): which norms write them, how
the quantised ops take them, and what the warm-up compiles. The kernels' bits are checked on the GPU
(``tests/kernels_cuda/test_rms_norm.py::test_quantised_form_equals_the_norm_then_fp8_quant``), the engine's tokens
in ``tests/cuda/test_fp8_engine.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
from deepinfer_npu.backends.cuda.ops import OpConfig
from deepinfer_npu.backends.cuda.ops.quant import NORM_OFFERS_KEPT

BF16 = torch.bfloat16
FP8_CFG = dict(dtype=BF16, sm90=True, quantization="fp8", hidden_size=2048, q_lora_rank=1536)


class _Quantiser:
    """A stand-in for ``kernels_cuda.fp8_quant``: counts its launches, returns tagged outputs."""

    def __init__(self) -> None:
        self.calls = 0

    def quantize(self, x, gated=False):
        self.calls += 1
        return ("quantised", x), ("scales", gated)


def _offer(ops, rows: int = 4, width: int = 256):
    y = torch.randn(rows, width).to(BF16)
    codes, scales = torch.zeros(rows, width, dtype=torch.float8_e4m3fn), torch.ones(rows, width // 128)
    ops.offer(y, codes, scales)
    return y, codes, scales


@pytest.mark.parametrize("inference_mode", [False, True])
def test_projections_take_the_codes_of_the_norm_that_wrote_their_rows(inference_mode):
    """Also under ``torch.inference_mode()``, where the engine's forwards run (its tensors have no version
    counter)."""
    ks = CudaKernelSet()
    ks.select(OpConfig(**FP8_CFG))
    ops, quantiser = ks.impl("quant"), _Quantiser()
    with torch.inference_mode(inference_mode):
        y, codes, scales = _offer(ops)
        # the output itself, and fp8_linear's reshape of it (a view with its shape and strides)
        for rows in (y, y.reshape(-1, 256)):
            got = ops._quantize(quantiser, rows, gated=False)
            assert got[0] is codes and got[1] is scales
        assert quantiser.calls == 0
        # the gated quantisation (SwiGLU first) is of other values
        assert ops._quantize(quantiser, y, gated=True)[0] == ("quantised", y)
        # another tensor with the same values, a slice of the rows, a transposed view: quantised themselves
        for other in (y.clone(), y[:2], y.t().contiguous().t()):
            assert ops._quantize(quantiser, other, gated=False)[0][0] == "quantised"
        assert quantiser.calls == 4
        # the last NORM_OFFERS_KEPT offers are held (codes read on the second stream outlive the next offers: a
        # layer offers at most three); older ones are dropped, and so are their outputs
        assert NORM_OFFERS_KEPT > 3
        for _ in range(NORM_OFFERS_KEPT - 1):
            _offer(ops)
        assert ops._quantize(quantiser, y, gated=False)[0] is codes
        _offer(ops)
        assert ops._quantize(quantiser, y, gated=False)[0] == ("quantised", y)


def test_the_norms_that_write_codes_are_the_ones_the_warm_up_listed(v2_lite_plan, monkeypatch):
    plan = dataclasses.replace(v2_lite_plan(), quantization="fp8")
    monkeypatch.setenv("DEEPINFER_FP8_NORM_QUANT", "1")
    ks = CudaKernelSet()
    ks.select(OpConfig.from_plan(plan, sm90=True))
    norms = ks.impl("norms")
    monkeypatch.setattr(ks.impl("quant"), "takes_norm_codes", lambda x: True)  # a CUDA bf16 row, on this host
    x = torch.zeros(3, plan.hidden_size, dtype=BF16)
    assert not norms._quantised(x, True, plan.rms_norm_eps)  # nothing listed (built) yet
    ks.warmup_configs(plan, 132)
    eps = plan.rms_norm_eps
    assert norms._quantised(x, True, eps) and norms._quantised(x, False, eps)
    assert not norms._quantised(x, False, eps * 10)  # a drafter's norm with its own eps: not built with codes
    assert not norms._quantised(torch.zeros(3, 1024, dtype=BF16), True, eps)  # another width
    assert not norms._quantised(torch.zeros(2048, plan.hidden_size, dtype=BF16), True, eps)  # prefill-sized
    # the switch is read at selection
    monkeypatch.setenv("DEEPINFER_FP8_NORM_QUANT", "0")
    ks.select(OpConfig.from_plan(plan, sm90=True))
    assert not norms._quantised(x, True, eps)


@pytest.mark.tilelang
def test_warmup_compiles_the_quantised_norms_only_when_asked(v2_lite_plan, monkeypatch):
    base = v2_lite_plan()
    plan = dataclasses.replace(base, quantization="fp8")
    ks = CudaKernelSet()
    monkeypatch.delenv("DEEPINFER_FP8_NORM_QUANT", raising=False)
    ks.select(OpConfig.from_plan(plan, sm90=True))
    plain = ks.warmup_configs(plan, 132)["rms_norm"]
    assert all(len(c) == 3 for c in plain)
    monkeypatch.setenv("DEEPINFER_FP8_NORM_QUANT", "1")
    ks.select(OpConfig.from_plan(plan, sm90=True))
    fused = ks.warmup_configs(plan, 132)["rms_norm"]
    eps = plan.rms_norm_eps
    assert set(fused) - set(plain) == {(plan.hidden_size, False, eps, True), (plan.hidden_size, True, eps, True)}
    # a bf16 model compiles none of them
    ks.select(OpConfig.from_plan(base, sm90=True))
    assert ks.warmup_configs(base, 132)["rms_norm"] == plain
