"""Dense SwiGLU MLP (dense layers and shared experts) with gate/up merged into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet

from .linear import Linear, empty_param


class DenseMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``. The checkpoint's ``gate_proj`` / ``up_proj`` [I, D] are stacked at
    load into ``gate_up_proj`` [2I, D] so one GEMM feeds ``kernels.silu_and_mul``."""

    remapped_params = ("gate_up_proj",)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        kernels: KernelSet,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.gate_up_proj = empty_param(2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, kernels, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, D] -> [T, D]."""
        return self.kernels.dense_mlp(x, self.gate_up_proj, self.down_proj.weight)

    # ---- checkpoint mapping (see loader.py) ----------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        shape = (self.intermediate_size, self.hidden_size)
        return {"gate_proj.weight": shape, "up_proj.weight": shape}

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        start = 0 if name == "gate_proj.weight" else self.intermediate_size
        self.gate_up_proj.data[start : start + self.intermediate_size].copy_(tensor)
