"""Quantised weights: FP8 block-scaled (e4m3, 128 x 128 fp32 scales) numerics, config resolution and the
parameter helpers the layers use."""

from .config import QuantConfig, QuantizationError, resolve_quant_config
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
    "dequantize_fp8_block",
    "dequantize_per_token_group",
    "quantize_fp8_block",
    "quantize_per_token_group",
    "resolve_quant_config",
    "scale_shape",
]
