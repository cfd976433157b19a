"""Model implementations and ``build_model``."""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_npu.hal.backend import Backend

from ..model_config import DeepseekModelConfig
from ..quantization import resolve_quant_config
from .deepseek import DeepseekForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from .mtp import DeepseekMTP

_MODEL_CLASSES: dict[str, type[DeepseekForCausalLM]] = {
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: torch.dtype | str, cfg: DeepseekModelConfig) -> torch.dtype:
    """``torch.float32`` / ``torch.bfloat16`` or their names; ``"auto"`` = the checkpoint's dtype when it is
    one of those, else bfloat16 (fp8 and fp16 checkpoints compute in bf16)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"unsupported dtype {dtype}; use float32 or bfloat16")
        return dtype
    if dtype == "auto":
        return _DTYPES.get(str(cfg.torch_dtype), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto', 'float32' or 'bfloat16'")
    return _DTYPES[dtype]


def build_model(
    cfg: DeepseekModelConfig,
    backend: Backend,
    dtype: torch.dtype | str = torch.float32,
    quantization: str | None = None,
) -> DeepseekForCausalLM:
    """Construct the model for ``cfg.model_type`` on ``backend.device`` with uninitialised weights (call
    ``load_weights`` next). ``quantization`` (``EngineConfig.quantization``): None builds the unquantised model
    (an FP8 checkpoint is dequantised at load); ``"fp8"`` builds FP8 linear / expert weights, which keep an FP8
    checkpoint's tensors or are quantised at load (``model.config.quant`` says which)."""
    if quantization is not None:
        cfg = dataclasses.replace(cfg, quant=resolve_quant_config(quantization, cfg.quantization_config, cfg.source))
    model_cls = _MODEL_CLASSES[cfg.model_type]
    with torch.device(backend.device):
        model = model_cls(cfg, backend, resolve_dtype(dtype, cfg))
    return model.eval()


__all__ = [
    "DeepseekForCausalLM",
    "DeepseekMTP",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "build_model",
    "resolve_dtype",
]
