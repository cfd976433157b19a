"""Dense SwiGLU MLP (dense layers and shared experts) with gate/up merged into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet

from ..quantization import QuantConfig
from ..quantization.params import add_quant_param, store_fp8_rows, store_quantized
from .linear import Linear, QuantLinear, empty_param


class DenseMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``. The checkpoint's ``gate_proj`` / ``up_proj`` [I, D] are stacked at
    load into ``gate_up_proj`` [2I, D] so one GEMM feeds ``kernels.silu_and_mul``.

    With ``quant`` both GEMMs are quantised (FP8: ``gate_up_proj`` + ``gate_up_proj_scale_inv`` [ceil(2I/128),
    ceil(D/128)]; W8A8: int8 + ``gate_up_proj_scale`` [2I]): an FP8 checkpoint's parts are copied in (I a multiple
    of 128, as in DeepSeek-V3), a high-precision checkpoint's parts are stacked first and the stacked weight is
    quantised, so FP8 tiles may straddle the gate / up boundary when I is not a multiple of 128."""

    remapped_params = ("gate_up_proj",)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        kernels: KernelSet,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.quant = quant
        if quant is None:
            self.gate_up_proj = empty_param(2 * intermediate_size, hidden_size, dtype=dtype, device=device)
            self.down_proj = Linear(intermediate_size, hidden_size, kernels, dtype=dtype, device=device)
        else:
            self.scheme = quant.scheme
            self.scale_name = "gate_up_proj" + self.scheme.scale_suffix
            self.remapped_params = ("gate_up_proj", self.scale_name)
            self.fp8_checkpoint_tensors = ("gate_proj.weight", "up_proj.weight") if quant.method == "fp8" else ()
            add_quant_param(self, "gate_up_proj", 2 * intermediate_size, hidden_size, scheme=self.scheme,
                            device=device)
            self.down_proj = QuantLinear(intermediate_size, hidden_size, kernels, quant=quant, dtype=dtype,
                                         device=device)
            self._pending: dict[str, torch.Tensor] = {}  # high-precision parts waiting for their partner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, D] -> [T, D]."""
        k = self.kernels
        if self.quant is None:
            return k.dense_mlp(x, self.gate_up_proj, self.down_proj.weight)
        return self.scheme.dense_mlp(k, x, self.gate_up_proj, getattr(self, self.scale_name), self.down_proj.weight,
                                     self.down_proj.scales)

    # ---- checkpoint mapping (see loader.py) ----------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        shape = (self.intermediate_size, self.hidden_size)
        return {"gate_proj.weight": shape, "up_proj.weight": shape}

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        start = 0 if name == "gate_proj.weight" else self.intermediate_size
        if self.quant is None:
            self.gate_up_proj.data[start : start + self.intermediate_size].copy_(tensor)
            return
        self._pending[name] = tensor.float()
        if len(self._pending) == 2:
            stacked = torch.cat((self._pending.pop("gate_proj.weight"), self._pending.pop("up_proj.weight")))
            store_quantized(self.scheme, self.gate_up_proj.data, getattr(self, self.scale_name).data, stacked)

    def load_checkpoint_fp8(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        start = 0 if name == "gate_proj.weight" else self.intermediate_size
        store_fp8_rows(self.gate_up_proj.data, getattr(self, self.scale_name).data, start, weight, scale_inv,
                       self.scheme.part_alignment)
