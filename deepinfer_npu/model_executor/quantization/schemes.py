"""Weight schemes: how a quantised weight is stored, quantised and multiplied, so that the layers hold one scheme
object instead of branching per format.

``fp8``: float8_e4m3fn with 128 x 128 fp32 block scales ``<name>_scale_inv`` (DeepSeek-V3), run by ``fp8_linear`` /
``fp8_grouped_mlp``. ``w8a8``: int8 with one fp32 scale per output channel ``<name>_scale``, run by ``w8a8_linear``
/ ``w8a8_grouped_mlp`` (activations quantised per token at run time).
"""

from __future__ import annotations

import torch

from . import fp8, int8


class WeightScheme:
    """Storage and kernels of one quantised weight format."""

    method: str
    weight_dtype: torch.dtype
    scale_suffix: str
    #: rows a stacked checkpoint part must start on to be copied without requantising (None: no FP8 checkpoints)
    part_alignment: int | None = None

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        raise NotImplementedError

    def quantize(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``value`` [..., N, K] -> (weight, scale)."""
        raise NotImplementedError

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, kernels, x, weight, scale, bias=None):
        raise NotImplementedError

    def grouped_mlp(self, kernels, sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale):
        raise NotImplementedError

    def dense_mlp(self, kernels, x, w13, w13_scale, w2, w2_scale):
        """The dense SwiGLU MLP: ``linear(silu_and_mul(linear(x, w13)), w2)`` in this scheme."""
        return self.linear(kernels, kernels.silu_and_mul(self.linear(kernels, x, w13, w13_scale)), w2, w2_scale)


class Fp8BlockScheme(WeightScheme):
    method, weight_dtype, scale_suffix, part_alignment = "fp8", fp8.FP8_DTYPE, "_scale_inv", fp8.BLOCK

    def scale_shape(self, rows, cols):
        return fp8.scale_shape(rows, cols)

    def quantize(self, value):
        return fp8.quantize_fp8_block(value)

    def dequantize(self, weight, scale):
        return fp8.dequantize_fp8_block(weight, scale)

    def linear(self, kernels, x, weight, scale, bias=None):
        return kernels.fp8_linear(x, weight, scale, bias)

    def grouped_mlp(self, kernels, sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale):
        return kernels.fp8_grouped_mlp(sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale)

    def dense_mlp(self, kernels, x, w13, w13_scale, w2, w2_scale):
        return kernels.fp8_dense_mlp(x, w13, w13_scale, w2, w2_scale)


class Int8ChannelScheme(WeightScheme):
    method, weight_dtype, scale_suffix = "w8a8", torch.int8, "_scale"

    def scale_shape(self, rows, cols):
        return (rows,)

    def quantize(self, value):
        return int8.quantize_int8_rows(value)

    def dequantize(self, weight, scale):
        return int8.dequantize_int8_rows(weight, scale)

    def linear(self, kernels, x, weight, scale, bias=None):
        return kernels.w8a8_linear(x, weight, scale, bias)

    def grouped_mlp(self, kernels, sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale):
        return kernels.w8a8_grouped_mlp(sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale)


SCHEMES: dict[str, WeightScheme] = {"fp8": Fp8BlockScheme(), "w8a8": Int8ChannelScheme()}
