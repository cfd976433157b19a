"""DeepSeek model runtime: config, layers over the HAL kernels, models (V2/V3 + MTP), weight loading."""

from .attention_metadata import AttentionMetadata, build_attention_metadata
from .kv_cache import allocate_kv_caches
from .loader import CheckpointError, load_weights
from .model_config import ConfigError, DeepseekModelConfig
from .models import (
    DeepseekForCausalLM,
    DeepseekMTP,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    build_model,
    resolve_dtype,
)

__all__ = [
    "AttentionMetadata",
    "CheckpointError",
    "ConfigError",
    "DeepseekForCausalLM",
    "DeepseekMTP",
    "DeepseekModelConfig",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "allocate_kv_caches",
    "build_attention_metadata",
    "build_model",
    "load_weights",
    "resolve_dtype",
]
