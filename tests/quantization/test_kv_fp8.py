"""FP8 latent cache rows (FlashMLA's 656-byte layout for DeepSeek-V3): byte layout, round trip, capacity."""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.model_executor.quantization.kv_fp8 import (
    fp8_latent_row_bytes,
    latent_bytes_per_token,
    pack_fp8_latents,
    unpack_fp8_latents,
)


def test_v3_rows_are_656_bytes_in_flashmla_order():
    torch.manual_seed(0)
    latents = torch.randn(3, 576, dtype=torch.bfloat16)
    rows = pack_fp8_latents(latents, 512)
    assert fp8_latent_row_bytes(512, 64) == 656 and rows.shape == (3, 656) and rows.dtype == torch.uint8
    scales = rows[:, 512:528].contiguous().view(torch.float32)  # 4 fp32 scales, one per 128 latent values
    want = latents[:, :512].float().view(3, 4, 128).abs().amax(-1) / 448.0
    torch.testing.assert_close(scales, want, rtol=0, atol=0)
    rope = rows[:, 528:].contiguous().view(torch.bfloat16)  # RoPE part kept exactly in bf16
    assert torch.equal(rope, latents[:, 512:])
    back = unpack_fp8_latents(rows.view(3, 1, 656), 512, 64)
    assert back.shape == (3, 1, 576)
    err = (back[:, 0, :512] - latents[:, :512].float()).abs()
    assert (err <= latents[:, :512].float().abs() * 2**-4 + scales.repeat_interleave(128, 1) * 2**-9).all()


def test_partial_group_and_capacity():
    torch.manual_seed(1)
    latents = torch.randn(5, 96)  # the reference model: L = 64 (one partial group), R = 32
    back = unpack_fp8_latents(pack_fp8_latents(latents, 64), 64, 32)
    assert ((back - latents).norm() / latents.norm()).item() < 0.05
    assert latent_bytes_per_token(64, 32, "fp8", torch.float32) == 64 + 4 + 64
    bf16, fp8 = latent_bytes_per_token(512, 64, "auto", torch.bfloat16), latent_bytes_per_token(512, 64, "fp8", None)
    assert (bf16, fp8) == (1152, 656)  # 1.76x the tokens per GiB
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or 'fp8', got 'int8'"):
        latent_bytes_per_token(512, 64, "int8", torch.bfloat16)
