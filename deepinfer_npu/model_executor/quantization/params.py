"""FP8 parameters of the layers: a float8_e4m3fn weight with its fp32 block scales next to it (``<name>`` and
``<name>_scale_inv``, the checkpoint's spelling), and the two ways they are filled at load: copied from an FP8
checkpoint, or quantised from a high-precision tensor."""

from __future__ import annotations

import torch
from torch import nn

from .fp8 import BLOCK, FP8_DTYPE, quantize_fp8_block, scale_shape

SCALE_SUFFIX = "_scale_inv"


def add_fp8_param(module: nn.Module, name: str, *shape: int, device) -> None:
    """Register ``name`` [*shape] float8_e4m3fn and ``name + "_scale_inv"`` [*lead, ceil(rows/128), ceil(cols/128)]
    fp32 on ``module`` (uninitialised, frozen; the loader or the dummy initialiser fills both)."""
    *lead, rows, cols = shape
    weight = torch.empty(*shape, dtype=FP8_DTYPE, device=device)
    scale = torch.empty(*lead, *scale_shape(rows, cols), dtype=torch.float32, device=device)
    module.register_parameter(name, nn.Parameter(weight, requires_grad=False))
    module.register_parameter(name + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))


def is_fp8(param: torch.Tensor) -> bool:
    return param.dtype == FP8_DTYPE


def store_quantized(weight: torch.Tensor, scale: torch.Tensor, value: torch.Tensor) -> None:
    """Quantise ``value`` (same shape as ``weight``, any float dtype) into ``weight`` and its block ``scale``."""
    q, s = quantize_fp8_block(value)
    weight.copy_(q)
    scale.copy_(s)


def store_fp8_rows(
    weight: torch.Tensor, scale: torch.Tensor, row0: int, q: torch.Tensor, s: torch.Tensor, what: str
) -> None:
    """Copy an FP8 checkpoint part (``q`` [rows, cols], its scales ``s``) into rows ``row0:`` of ``weight`` and the
    matching scale rows. Parts must start on a 128-row boundary (stacked gate / up projections): their tiles then
    are tiles of the stacked weight."""
    rows = q.shape[0]
    if row0 % BLOCK or (rows % BLOCK and row0 + rows != weight.shape[0]):
        raise ValueError(
            f"{what}: FP8 checkpoint part of {rows} rows at row {row0} is not aligned to the {BLOCK}-row weight "
            f"blocks of the stacked tensor ({weight.shape[0]} rows); load with quantization=None to dequantise"
        )
    weight[row0 : row0 + rows].copy_(q)
    scale[row0 // BLOCK : row0 // BLOCK + s.shape[0]].copy_(s)
