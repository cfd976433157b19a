"""Linear layers: a weight [out, in] (+ optional bias) applied through ``kernels.linear``, or, quantised, an FP8
weight with 128 x 128 block scales applied through ``kernels.fp8_linear``."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet

from ..quantization import QuantConfig
from ..quantization.params import add_fp8_param, store_quantized


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


class Fp8Linear(nn.Module):
    """``y = fp8_linear(x, weight, weight_scale_inv) (+ bias)``: ``weight`` [out, in] float8_e4m3fn,
    ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] fp32; the bias stays in the model dtype. Loads an FP8
    checkpoint's pair as is, or quantises a high-precision ``weight`` at load."""

    remapped_params = ("weight", "weight_scale_inv")
    fp8_checkpoint_tensors = ("weight",)

    def __init__(self, in_features: int, out_features: int, kernels: KernelSet, *, bias: bool = False,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.kernels = kernels
        add_fp8_param(self, "weight", out_features, in_features, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)

    # ---- checkpoint mapping (see loader.py) ----------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        return {"weight": tuple(self.weight.shape)}

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        store_quantized(self.weight.data, self.weight_scale_inv.data, tensor)

    def load_checkpoint_fp8(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.weight.data.copy_(weight)
        self.weight_scale_inv.data.copy_(scale_inv)


def make_linear(in_features: int, out_features: int, kernels: KernelSet, *, quant: QuantConfig | None = None,
                **kw) -> Linear | Fp8Linear:
    """A :class:`Linear`, or an :class:`Fp8Linear` when ``quant`` is set."""
    cls = Fp8Linear if quant is not None else Linear
    return cls(in_features, out_features, kernels, **kw)
