"""RMSNorm layer over ``kernels.rms_norm`` / ``kernels.add_rms_norm``."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet

from .linear import empty_param


class RMSNorm(nn.Module):
    """RMSNorm with weight [N]; ``forward(x, residual=None)`` fuses the residual add when one is given."""

    def __init__(
        self, size: int, eps: float, kernels: KernelSet, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` [T, N] -> normed [T, N]; with ``residual`` -> ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
