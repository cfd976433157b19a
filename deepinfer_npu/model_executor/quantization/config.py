"""QuantConfig: which weights run quantised and how, resolved from ``EngineConfig.quantization`` and the
checkpoint's ``quantization_config``.

``quantization=None`` keeps the checkpoint's precision semantics of old: FP8 checkpoints are dequantised at load to
the model dtype. ``"fp8"``: linear weights are held as float8_e4m3fn with 128 x 128 fp32 block scales, kept as
loaded from an FP8 checkpoint or quantised at load from a bf16 / fp32 one. What stays unquantised follows
DeepSeek-V3's FP8 checkpoint (the tensors without ``weight_scale_inv`` there, and vLLM's ``deepseek_v2.py``):
embeddings, norms, ``lm_head``, the MoE router (``mlp.gate``, fp32) and its correction bias, the MTP layer's
``eh_proj`` / ``shared_head``; ``kv_b_proj`` is FP8 in the checkpoint and dequantised at load into the absorbed
``w_uk`` / ``w_uv`` (as vLLM's MLA does), which the attention ops consume in the model dtype. ``"w8a8"``: the same
weights as int8 with per-output-channel scales and per-token dynamic activation quantisation (the INT8 scheme Ascend
runs), quantised at load from a bf16 / fp32 checkpoint (an FP8 one is dequantised first).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fp8 import BLOCK
from .schemes import SCHEMES, WeightScheme

SUPPORTED_METHODS = ("fp8", "w8a8")
SUPPORTED_CHECKPOINT_FORMATS = ("e4m3",)


class QuantizationError(ValueError):
    """A quantisation request the engine or the checkpoint cannot honour; the message names the setting."""


@dataclass(frozen=True)
class QuantConfig:
    """``method`` "fp8"; ``weight_block`` the weight tile (128 x 128, the only one the ops take);
    ``from_checkpoint``: the checkpoint's weights are FP8 already (kept), else they are quantised at load."""

    method: str
    weight_block: tuple[int, int] = (BLOCK, BLOCK)
    from_checkpoint: bool = False

    @property
    def scheme(self) -> WeightScheme:
        return SCHEMES[self.method]


def resolve_quant_config(
    requested: str | None, checkpoint_quant: dict | None, source: str = "config.json"
) -> QuantConfig | None:
    """``requested`` (``EngineConfig.quantization``) against the checkpoint's ``quantization_config`` (None for an
    unquantised checkpoint) -> the config the model is built with, or None (unquantised model)."""
    if requested is None:
        return None
    if requested not in SUPPORTED_METHODS:
        raise QuantizationError(
            f"quantization={requested!r} is not supported; use None or one of {', '.join(map(repr, SUPPORTED_METHODS))}"
        )
    if checkpoint_quant is None:
        return QuantConfig(method=requested)
    method = checkpoint_quant.get("quant_method")
    if requested == "w8a8" and method == "fp8":
        return QuantConfig(method="w8a8")  # the loader dequantises the FP8 tensors, the layers quantise to int8
    if method != "fp8" or requested != "fp8":
        raise QuantizationError(
            f"{source}: quantization_config.quant_method is {method!r}; quantization={requested!r} needs an "
            "unquantised or 'fp8' checkpoint"
        )
    fmt = checkpoint_quant.get("fmt", "e4m3")
    if fmt not in SUPPORTED_CHECKPOINT_FORMATS:
        raise QuantizationError(f"{source}: quantization_config.fmt is {fmt!r}; only 'e4m3' is supported")
    block = checkpoint_quant.get("weight_block_size")
    if block is None or tuple(block) != (BLOCK, BLOCK):
        raise QuantizationError(
            f"{source}: quantization_config.weight_block_size is {block!r}; the FP8 ops take [{BLOCK}, {BLOCK}] "
            "block scales (load with quantization=None to dequantise instead)"
        )
    act = checkpoint_quant.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise QuantizationError(
            f"{source}: quantization_config.activation_scheme is {act!r}; only 'dynamic' (per-token-group "
            "activation scales computed at run time) is supported"
        )
    return QuantConfig(method="fp8", from_checkpoint=True)
