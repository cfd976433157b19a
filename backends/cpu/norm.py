"""RMSNorm reference ops (same arithmetic as DeepSeek / Hugging Face: fp32 statistics, cast, then scale)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` [..., N], ``weight`` [N] -> ``weight * (x / rms(x))`` in ``x``'s dtype; statistics in fp32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Cast before scaling, as the reference models do, so bf16 results round identically.
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then norm: returns ``(rms_norm(x + residual), x + residual)``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
