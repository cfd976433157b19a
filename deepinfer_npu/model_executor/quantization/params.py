"""Quantised parameters of the layers: a weight in the scheme's dtype with its fp32 scales next to it
(``<name>`` and ``<name>_scale_inv`` for FP8 blocks, the checkpoint's spelling; ``<name>_scale`` for INT8
channels), and the two ways they are filled at load: copied from an FP8 checkpoint, or quantised from a
high-precision tensor."""

from __future__ import annotations

import torch
from torch import nn

from .schemes import SCHEMES, WeightScheme

SCALE_SUFFIXES = tuple(sorted({s.scale_suffix for s in SCHEMES.values()}))


def add_quant_param(module: nn.Module, name: str, *shape: int, scheme: WeightScheme, device) -> None:
    """Register ``name`` [*shape] in ``scheme.weight_dtype`` and its fp32 scales ``name + scheme.scale_suffix`` on
    ``module`` (uninitialised, frozen; the loader or the dummy initialiser fills both)."""
    *lead, rows, cols = shape
    weight = torch.empty(*shape, dtype=scheme.weight_dtype, device=device)
    scale = torch.empty(*lead, *scheme.scale_shape(rows, cols), dtype=torch.float32, device=device)
    module.register_parameter(name, nn.Parameter(weight, requires_grad=False))
    getattr(module, name).quant_scheme = scheme.method  # dummy initialisation finds the scheme from the weight
    module.register_parameter(name + scheme.scale_suffix, nn.Parameter(scale, requires_grad=False))


def scheme_of(param: torch.Tensor) -> WeightScheme | None:
    """The scheme of a parameter made by :func:`add_quant_param`, else None."""
    method = getattr(param, "quant_scheme", None)
    return SCHEMES[method] if method is not None else None


def store_quantized(scheme: WeightScheme, weight: torch.Tensor, scale: torch.Tensor, value: torch.Tensor) -> None:
    """Quantise ``value`` (same shape as ``weight``, any float dtype) into ``weight`` and its ``scale``."""
    q, s = scheme.quantize(value)
    weight.copy_(q)
    scale.copy_(s)


def store_fp8_rows(
    weight: torch.Tensor, scale: torch.Tensor, row0: int, q: torch.Tensor, s: torch.Tensor, block: int
) -> None:
    """Copy an FP8 checkpoint part (``q`` [rows, cols], its block scales ``s``) into rows ``row0:`` of ``weight`` and
    the matching scale rows. Parts must start on a ``block``-row boundary (stacked gate / up projections): their
    tiles then are tiles of the stacked weight."""
    rows = q.shape[0]
    if row0 % block or (rows % block and row0 + rows != weight.shape[0]):
        raise ValueError(
            f"FP8 checkpoint part of {rows} rows at row {row0} is not aligned to the {block}-row weight blocks of "
            f"the stacked tensor ({weight.shape[0]} rows); load with quantization=None to dequantise"
        )
    weight[row0 : row0 + rows].copy_(q)
    scale[row0 // block : row0 // block + s.shape[0]].copy_(s)
