"""Linear layers: a weight [out, in] (+ optional bias) applied through ``kernels.linear``, or, quantised, an FP8 /
INT8 weight with its scales applied through the scheme's op (``kernels.fp8_linear`` / ``kernels.w8a8_linear``)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet

from ..quantization import QuantConfig
from ..quantization.params import add_quant_param, store_quantized


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


class QuantLinear(nn.Module):
    """``y = scheme.linear(x, weight, scale) (+ bias)``: ``weight`` [out, in] in the scheme's dtype with its fp32
    scales (FP8: ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] through ``kernels.fp8_linear``; W8A8:
    ``weight_scale`` [out] through ``kernels.w8a8_linear``); the bias stays in the model dtype. Loads an FP8
    checkpoint's pair as is (FP8 scheme), or quantises a high-precision ``weight`` at load."""

    def __init__(self, in_features: int, out_features: int, kernels: KernelSet, *, quant: QuantConfig,
                 bias: bool = False, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.kernels = kernels
        self.scheme = quant.scheme
        add_quant_param(self, "weight", out_features, in_features, scheme=self.scheme, device=device)
        self.scale_name = "weight" + self.scheme.scale_suffix
        self.remapped_params = ("weight", self.scale_name)
        self.fp8_checkpoint_tensors = ("weight",) if self.scheme.method == "fp8" else ()
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    @property
    def scales(self) -> torch.Tensor:
        """The weight's fp32 scales (``weight_scale_inv`` or ``weight_scale``, by scheme)."""
        return getattr(self, self.scale_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scheme.linear(self.kernels, x, self.weight, self.scales, self.bias)

    # ---- checkpoint mapping (see loader.py) ----------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        return {"weight": tuple(self.weight.shape)}

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        store_quantized(self.scheme, self.weight.data, self.scales.data, tensor)

    def load_checkpoint_fp8(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.weight.data.copy_(weight)
        self.scales.data.copy_(scale_inv)


def make_linear(in_features: int, out_features: int, kernels: KernelSet, *, quant: QuantConfig | None = None,
                **kw) -> Linear | QuantLinear:
    """A :class:`Linear`, or a :class:`QuantLinear` when ``quant`` is set."""
    if quant is None:
        return Linear(in_features, out_features, kernels, **kw)
    return QuantLinear(in_features, out_features, kernels, quant=quant, **kw)
