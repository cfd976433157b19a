"""Dense reference ops: linear and the SwiGLU activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., in] @ ``weight`` [out, in]^T (+ ``bias``) -> [..., out]."""
    return F.linear(x, weight, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., 2I] = [gate | up] -> ``silu(gate) * up`` [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
