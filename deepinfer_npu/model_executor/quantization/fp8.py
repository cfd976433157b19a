"""FP8 (e4m3) block quantisation numerics shared by the loader and the reference ops.

Weights: 128 x 128 tiles, one fp32 scale each, ``scale = amax(tile) / 448`` (DeepSeek-V3's checkpoints and vLLM's
online quantisation), stored as ``weight_scale_inv`` (the multiplier that dequantises). Activations: groups of 1 x 128
along K per token, the same rule (DeepGEMM's fine-grained scaling, vLLM's ``per_token_group_quant_fp8``).
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
BLOCK = 128  # weight tiles are BLOCK x BLOCK, activation groups 1 x BLOCK
# A zero tile would get scale 0 and 0/0 on the way in; DeepGEMM / vLLM clamp amax the same way.
AMAX_EPS = 1e-10


def scale_shape(rows: int, cols: int, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    """Shape of the block-scale grid of a [rows, cols] weight."""
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., out, in] (any float dtype) -> ``(fp8 [..., out, in], scale_inv fp32 [..., ceil(out/b0),
    ceil(in/b1)])`` with ``weight ~= fp8 * scale_inv`` tile by tile; partial edge tiles take their own amax."""
    *lead, out_f, in_f = weight.shape
    nr, nc = scale_shape(out_f, in_f, block)
    w = _pad_to(weight.float(), nr * block[0], nc * block[1])
    tiles = w.reshape(*lead, nr, block[0], nc, block[1])
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(AMAX_EPS)
    scale = amax / FP8_MAX
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, nr * block[0], nc * block[1])[..., :out_f, :in_f]
    return q.contiguous(), scale.reshape(*lead, nr, nc).contiguous()


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
) -> torch.Tensor:
    """``weight`` [..., out, in] float8 with ``scale_inv`` [..., ceil(out/b0), ceil(in/b1)] -> fp32 ``weight *
    scale``, each ``b0 x b1`` tile multiplied by its own scale (DeepSeek-V3's block quantisation)."""
    out_f, in_f = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :out_f, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :in_f]
    return weight.float() * scale


def quantize_per_token_group(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> ``(fp8 [M, K], scales fp32 [M, ceil(K/group)])``: each row's groups of ``group`` values along
    K get ``scale = amax / 448`` (a partial last group its own amax), what the GPU GEMM's fused quantisation does."""
    m, k = x.shape
    groups = math.ceil(k / group)
    xg = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = xg.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_EPS) / FP8_MAX
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, groups * group)[:, :k]
    return q.contiguous(), scale.squeeze(-1)


def dequantize_per_token_group(q: torch.Tensor, scales: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token_group`: fp32 [M, K]."""
    k = q.shape[-1]
    return q.float() * scales.float().repeat_interleave(group, dim=-1)[..., :k]
