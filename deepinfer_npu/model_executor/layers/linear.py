"""Linear layers: a weight [out, in] (+ optional bias) applied through ``kernels.linear``."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter (weights come from the loader)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight^T (+ bias)``; ``weight`` [out, in]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernels: KernelSet,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., in] -> [..., out]."""
        return self.kernels.linear(x, self.weight, self.bias)
