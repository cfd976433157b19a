"""FP8 block quantisation numerics against plain tile-by-tile / group-by-group loops."""

from __future__ import annotations

import math

import torch

from deepinfer_npu.model_executor.quantization import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_per_token_group,
    quantize_fp8_block,
    quantize_per_token_group,
)


def _loop_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The obviously-correct version: one tile at a time, scale = amax / 448."""
    rows, cols = math.ceil(w.shape[0] / block), math.ceil(w.shape[1] / block)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    for i in range(rows):
        for j in range(cols):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            scale[i, j] = w[r, c].abs().max().clamp(min=1e-10) / 448.0
            q[r, c] = (w[r, c] / scale[i, j]).to(FP8_DTYPE)
    return q, scale


def test_block_quantisation_matches_tile_loop_with_partial_tiles():
    torch.manual_seed(0)
    w = torch.randn(300, 260) * torch.logspace(-3, 1, 260)  # tiles of very different magnitude
    q, s = quantize_fp8_block(w)
    q_ref, s_ref = _loop_quantize(w)
    assert q.dtype == FP8_DTYPE and s.shape == (3, 3) and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # every tile's largest value maps to +-448 exactly
    assert q.float().abs().max() == 448.0


def test_round_trip_error_is_within_e4m3_precision():
    torch.manual_seed(1)
    w = torch.randn(4, 256, 384)  # stacked (experts) weights quantise per matrix
    q, s = quantize_fp8_block(w)
    assert s.shape == (4, 2, 3)
    back = dequantize_fp8_block(q, s)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normal values, plus the subnormal floor
    # (2^-9 of the tile scale * 448) for values far below the tile's amax.
    bound = back.abs() * 2**-4 + s.repeat_interleave(128, 1).repeat_interleave(128, 2) * 2**-9
    assert ((back - w).abs() <= bound + 1e-12).all()
    # quantising the dequantised weight again is exact (amax tiles map to 448 again)
    q2, s2 = quantize_fp8_block(back)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


def test_zero_tile_gets_a_finite_scale():
    q, s = quantize_fp8_block(torch.zeros(128, 128))
    assert torch.isfinite(s).all() and (q.float() == 0).all()


def test_per_token_group_quantisation_matches_group_loop():
    torch.manual_seed(2)
    x = torch.randn(5, 300) * 3
    q, s = quantize_per_token_group(x)
    assert q.shape == (5, 300) and s.shape == (5, 3)
    for m in range(5):
        for g in range(3):
            seg = x[m, g * 128 : (g + 1) * 128]
            scale = seg.abs().max() / 448.0
            assert s[m, g] == scale
            want = (seg / scale).to(FP8_DTYPE).view(torch.uint8)
            assert torch.equal(q[m, g * 128 : (g + 1) * 128].view(torch.uint8), want)
    back = dequantize_per_token_group(q, s)
    assert ((back - x).abs() <= back.abs() * 2**-4 + s.repeat_interleave(128, 1)[:, :300] * 2**-9).all()
