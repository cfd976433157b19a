"""Quantised weights: FP8 block-scaled (e4m3, 128 x 128 fp32 scales) and INT8 per-channel (W8A8) numerics, the
weight schemes the layers hold, config resolution and the parameter helpers."""

from .config import QuantConfig, QuantizationError, resolve_quant_config
from .int8 import dequantize_int8_rows, quantize_int8_rows
from .schemes import SCHEMES, WeightScheme
from .fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_per_token_group,
    quantize_fp8_block,
    quantize_per_token_group,
    scale_shape,
)

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "QuantConfig",
    "QuantizationError",
    "SCHEMES",
    "WeightScheme",
    "dequantize_int8_rows",
    "quantize_int8_rows",
    "dequantize_fp8_block",
    "dequantize_per_token_group",
    "quantize_fp8_block",
    "quantize_per_token_group",
    "resolve_quant_config",
    "scale_shape",
]
