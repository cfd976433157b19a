"""Rotary position embedding reference op."""

from __future__ import annotations

import torch


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate ``x`` [T, H, R] by the angles of ``positions`` [T].

    ``cos_sin_cache`` [max_pos, R] fp32 holds ``cos`` in the first R/2 columns and ``sin`` in the last R/2
    (already multiplied by the YaRN attention factor). ``interleaved``: frequency i rotates the pair ``(x[2i],
    x[2i+1])`` (DeepSeek's checkpoint layout); otherwise it rotates ``(x[i], x[i + R/2])``. The output keeps
    ``x``'s layout; math is done in fp32.
    """
    half = x.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]  # [T, R]
    cos = cos_sin[:, None, :half]  # [T, 1, R/2], broadcast over heads
    sin = cos_sin[:, None, half:]
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    if interleaved:
        out = torch.stack((r1, r2), dim=-1).flatten(-2)
    else:
        out = torch.cat((r1, r2), dim=-1)
    return out.to(x.dtype)
