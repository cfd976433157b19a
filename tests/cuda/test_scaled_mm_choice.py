"""``backends/cuda/ops/scaled_mm.py``: cuBLASLt's block-scaled GEMM serves a prefill-sized FP8 call only after an
eager check of its ``(N, K, M % 4)`` agreed with the tile kernel element by element on random activations (distinct
rows and group scales); a form it refuses or gets wrong is followed by the next (padded weight scales, then padded
rows), a key where every form fails stays on the tile kernel with the reason, an accepted key that later raises goes
back to the tile kernel, and nothing is checked, and no padded scales are made, inside CUDA-graph capture.
Anywhere: ``torch._scaled_mm`` is replaced by stand-ins that model what could go wrong on a device (the real op is
checked against the tile kernel by tests/cuda/test_fp8_quant_ops.py and ``kernels_cuda/bench.py fp8_gemm`` on a
GPU)."""

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


def _tile(w, sw, calls=None):
    def tile(a, s):
        if calls is not None:
            calls.append(a.shape[0])
        return _product(a, s, w, sw)

    return tile


def _stand_in(calls, refuse=(), wrong=(), rows_of_4=False, fail_at=None, aligned_only=False):
    """torch._scaled_mm on dequantised operands. ``refuse`` / ``wrong``: scale layouts ("plain": a view of the
    weight's scales, "padded": of a padded copy) it raises for / answers with a wrong scale; ``rows_of_4``: it reads
    the activations' scales with a leading dimension rounded up to 4 rows (the layout some cuBLASLt users assume):
    rows past the first misread their scales when M % 4 != 0; ``fail_at``: an M it raises for; ``aligned_only``: it
    raises unless N is a multiple of 128, K of 512 and M of 4."""

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        layout = "plain" if scale_b.t().is_contiguous() else "padded"
        m = a.shape[0]
        calls.append((layout, m))
        if layout in refuse or m == fail_at:
            raise RuntimeError(f"Invalid scaling configuration ({layout}, M={m})")
        if aligned_only and (b.shape[1] % 128 or a.shape[1] % 512 or m % 4):
            raise RuntimeError(f"Invalid scaling configuration (M={m}, N={b.shape[1]}, K={a.shape[1]})")
        assert scale_a.stride(0) == 1  # M-major activation scales
        if rows_of_4 and m % 4:
            ld = -(-m // 4) * 4
            flat = torch.cat([scale_a.t().reshape(-1), scale_a.new_ones(ld * scale_a.shape[1])])
            scale_a = flat.as_strided(scale_a.shape, (1, ld))
        product = dequantize_per_token_group(a, scale_a) @ dequantize_fp8_block(b.t(), scale_b.t()).t()
        return (product * (3.0 if layout in wrong else 1.0)).to(out_dtype)

    return scaled_mm


def test_the_first_form_that_agrees_serves_the_key(monkeypatch):
    calls, tiles = [], []
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(calls, refuse=("plain",)))
    ops = sm.ScaledMM()
    aq, sa, w, sw = _operands()
    out, why = ops.gemm(aq, sa, w, sw, _tile(w, sw, tiles))
    assert why is None and torch.equal(out, _product(aq, sa, w, sw))
    assert ops.forms == {(256, 384, 0): sm.Form("padded")}
    assert tiles == [68, 1024]  # the check's own random activations, at every CHECK_ROWS size
    assert calls == [("plain", 68), ("padded", 68), ("padded", 1024), ("padded", 96)]
    out, why = ops.gemm(aq, sa, w, sw, lambda a, s: pytest.fail("checked twice"))
    assert why is None and calls[-1] == ("padded", 96)


def test_each_remainder_of_m_by_4_is_checked_and_padded_rows_serve_an_unaligned_m(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(calls, rows_of_4=True))
    ops = sm.ScaledMM()
    aq, sa, w, sw = _operands(m=97)
    out, why = ops.gemm(aq, sa, w, sw, _tile(w, sw))
    assert why is None and torch.equal(out, _product(aq, sa, w, sw))
    # the scales as they are misread rows at M = 69 and so does the padded-scales form; rows padded to 4 agree
    assert ops.forms == {(256, 384, 1): sm.Form("plain", pad_rows=True)}
    assert calls[-1] == ("plain", 100) and ("plain", 69) in calls and ("padded", 69) in calls
    aq, sa, w, sw = _operands(m=96)
    assert ops.gemm(aq, sa, w, sw, _tile(w, sw))[1] is None and ops.forms[(256, 384, 0)] == sm.Form("plain")


def test_a_scale_read_from_the_wrong_row_is_caught_where_equal_rows_would_hide_it(monkeypatch):
    """The check's rows differ: the stand-in's misread of unaligned rows changes the product (with the call's own
    operands it could have been padding rows, all equal, and agreed)."""
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in([], rows_of_4=True))
    a, s = sm._random_activations(129, 384, 3, "cpu", 0)
    assert len({tuple(r.tolist()) for r in s}) > 100  # distinct rows of scales
    _, _, w, sw = _operands()
    ops = sm.ScaledMM()
    got = ops._run(a, s, *ops._weight(w, sw, sm.Form("plain")), sm.Form("plain"))
    assert "elements off" in sm.disagreement(got, _product(a, s, w, sw))


def test_a_key_that_disagrees_in_every_form_stays_on_the_tile_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(calls, refuse=("plain",), wrong=("padded",)))
    ops = sm.ScaledMM()
    aq, sa, w, sw = _operands(m=98)
    out, why = ops.gemm(aq, sa, w, sw, _tile(w, sw))
    assert out is None and "N=256, K=384, M % 4 = 2" in why and "Invalid scaling configuration" in why
    assert "elements off" in why and "rows padded" in why
    n = len(calls)
    assert ops.gemm(aq, sa, w, sw, lambda a, s: pytest.fail("checked twice")) == (None, why) and len(calls) == n


def test_an_accepted_key_that_raises_later_goes_back_to_the_tile_kernel(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in([], fail_at=4096))
    ops = sm.ScaledMM()
    _, _, w, sw = _operands()
    aq, sa = quantize_per_token_group(torch.randn(4096, 384))
    out, why = ops.gemm(aq, sa, w, sw, _tile(w, sw))
    assert out is None and "M=4096" in why and "after its check passed" in why and why in ops.errors.values()
    assert ops.forms[(256, 384, 0)] is None


def test_nothing_is_checked_under_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("called under capture"))
    aq, sa, w, sw = _operands()
    out, why = sm.ScaledMM().gemm(aq, sa, w, sw, lambda a, s: pytest.fail("tile run by the check"))
    assert out is None and "capture" in why


def test_padded_scales_are_not_first_made_inside_a_capture(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(calls, refuse=("plain",)))
    ops = sm.ScaledMM()
    aq, sa, w, sw = _operands()
    assert ops.gemm(aq, sa, w, sw, _tile(w, sw))[1] is None  # checked eagerly: the padded form
    other_w, other_sw = _operands(seed=1)[2:]  # another layer of the same shape, first seen inside a capture
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    out, why = ops.gemm(aq, sa, other_w, other_sw, lambda a, s: pytest.fail("no check"))
    assert out is None and "padded scales" in why
    out, why = ops.gemm(aq, sa, w, sw, lambda a, s: pytest.fail("no check"))  # made before the capture: served
    assert why is None and torch.equal(out, _product(aq, sa, w, sw))


def test_disagreement_names_what_is_off():
    want = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert sm.disagreement(want.clone(), want) is None
    assert sm.disagreement((want.float() * (1 + 2**-9)).bfloat16(), want) is None  # a rounding apart
    assert "elements off" in sm.disagreement(-want, want)
    one = want.clone()
    one[3, 5] = one[3, 5] + 1
    assert "1 of 128 elements off" in sm.disagreement(one, want) and "[3, 5]" in sm.disagreement(one, want)
    assert "non-finite" in sm.disagreement(torch.full_like(want, float("nan")), want)
    assert "expected" in sm.disagreement(want[:4], want)


def test_running_out_of_memory_in_the_check_is_no_verdict(monkeypatch):
    def oom(*a, **k):
        raise sm.OUT_OF_MEMORY("CUDA out of memory (the check's operands)")

    monkeypatch.setattr(torch, "_scaled_mm", oom)
    ops = sm.ScaledMM()
    aq, sa, w, sw = _operands()
    out, why = ops.gemm(aq, sa, w, sw, _tile(w, sw))
    assert out is None and "out of device memory" in why and ops.forms == {} and ops.errors == {}
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in([]))  # memory again: the key is checked now
    assert ops.gemm(aq, sa, w, sw, _tile(w, sw))[1] is None and ops.forms == {(256, 384, 0): sm.Form("plain")}


def test_padded_scales_follow_the_weight_not_its_address():
    ops = sm.ScaledMM()
    _, _, _, sw = _operands()
    first = ops._scale_b(sw, "padded")
    assert torch.equal(first.t(), sw) and ops._scale_b(sw, "padded").data_ptr() == first.data_ptr()  # cached
    other = sw * 2
    ops._padded[(other.data_ptr(), tuple(other.shape))] = ops._padded.pop((sw.data_ptr(), tuple(sw.shape)))
    assert torch.equal(ops._scale_b(other, "padded").t(), other)  # an entry at its address for another tensor


def test_unaligned_n_and_k_are_served_zero_padded(monkeypatch):
    """kv_a's N = 576 and a K of 11 groups, where cuBLASLt takes only aligned operands: the weight padded once (zeros,
    scales of one), the activations' K and rows per call, the output's columns sliced back; the product is the
    unpadded one."""
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(calls, aligned_only=True))
    ops = sm.ScaledMM()
    aq, sa, w, sw = _operands(m=71, n=576, k=1408)
    out, why = ops.gemm(aq, sa, w, sw, _tile(w, sw))
    assert why is None and out.shape == (71, 576) and out.is_contiguous()
    assert torch.equal(out, _product(aq, sa, w, sw))
    assert ops.forms == {(576, 1408, 3): sm.Form("plain", pad_nk=True)}
    assert calls[-1] == ("plain", 72)
    wp, swp = ops._padded_nk[id(w)][1:]
    assert wp.shape == (640, 1536) and swp.shape == (5, 12) and not wp[576:].float().any()
    out, why = ops.gemm(aq, sa, w, sw, lambda a, s: pytest.fail("checked twice"))
    assert why is None and ops._padded_nk[id(w)][1] is wp  # padded once
    # another weight of the key, first seen inside a capture: its padded copy is not made there
    other_w, other_sw = _operands(n=576, k=1408, seed=1)[2:]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    out, why = ops.gemm(aq, sa, other_w, other_sw, lambda a, s: pytest.fail("no check"))
    assert out is None and "not made yet" in why
