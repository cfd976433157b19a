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

BF16 = torch.bfloat16


class _Quantiser:
    """A stand-in for ``kernels_cuda.fp8_quant``: counts its launches, returns tagged outputs."""

    def __init__(self) -> None:
        self.calls = 0

    def quantize(self, x, gated=False):
        self.calls += 1
        return ("quantised", x), ("scales", gated)


def _quant_ops():
    ks = CudaKernelSet()
    ks.select(OpConfig(dtype=BF16, sm90=True, quantization="fp8", hidden_size=2048, q_lora_rank=1536))
    return ks, ks.impl("quant")


def test_projections_take_the_codes_of_the_norm_that_wrote_their_rows():
    _ks, ops = _quant_ops()
    quantiser = _Quantiser()
    y = torch.randn(4, 256).to(BF16)
    codes, scales = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2)
    ops.offer(y, codes, scales)
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
    # an in-place write after the norm (any view moves the shared version counter): the codes are stale
    y.reshape(-1, 256).mul_(2)
    assert ops._quantize(quantiser, y, gated=False)[0] == ("quantised", y)
    assert quantiser.calls == 5


def test_the_norms_before_fp8_projections_are_the_hidden_and_q_lora_widths():
    ks, _ops = _quant_ops()
    assert ks.impl("norms").quant_widths == frozenset({2048, 1536})
    ks.select(OpConfig(dtype=BF16, sm90=True, quantization=None, hidden_size=2048, q_lora_rank=1536))
    assert ks.impl("norms").quant_widths == frozenset()
    ks.select(OpConfig(dtype=BF16, sm90=True, quantization="fp8", hidden_size=2048, q_lora_rank=None))
    assert ks.impl("norms").quant_widths == frozenset({2048})


@pytest.mark.tilelang
def test_warmup_compiles_the_quantised_norms_only_when_asked(v2_lite_plan, monkeypatch):
    base = v2_lite_plan()
    plan = dataclasses.replace(base, quantization="fp8")
    ks = CudaKernelSet()
    ks.select(OpConfig.from_plan(plan, sm90=True))
    monkeypatch.delenv("DEEPINFER_FP8_NORM_QUANT", raising=False)
    plain = ks.warmup_configs(plan, 132)["rms_norm"]
    assert all(len(c) == 3 for c in plain)
    monkeypatch.setenv("DEEPINFER_FP8_NORM_QUANT", "1")
    fused = ks.warmup_configs(plan, 132)["rms_norm"]
    eps = plan.rms_norm_eps
    assert set(fused) - set(plain) == {(plan.hidden_size, False, eps, True), (plan.hidden_size, True, eps, True)}
    # a bf16 model compiles none of them
    ks.select(OpConfig.from_plan(base, sm90=True))
    assert ks.warmup_configs(base, 132)["rms_norm"] == plain
