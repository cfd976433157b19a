"""DeepseekModelConfig: the model hyper-parameters, read and validated from a Hugging Face ``config.json``.

Both spellings in the wild are accepted: official DeepSeek checkpoints (``rope_theta`` + ``rope_scaling`` with
``"type"``, ``topk_method`` / ``scoring_func``, ``quantization_config``) and configs written by current
transformers (``rope_parameters`` holding ``rope_theta`` and ``rope_type``). Missing optional fields take the
Hugging Face defaults of the model type; every error names the field and the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from .quantization.config import QuantConfig


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model; the message names the field and the file."""


SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# Hugging Face defaults per model type for fields a config.json may omit (transformers' DeepseekV2Config /
# DeepseekV3Config), plus DeepSeek's own topk_method / scoring_func / moe_layer_freq, which HF lacks.
# fmt: off
_COMMON_DEFAULTS: dict[str, Any] = dict(
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    moe_layer_freq=1, rms_norm_eps=1e-6, rope_theta=10000.0, rope_interleave=True, hidden_act="silu",
    attention_bias=False, tie_word_embeddings=False,
)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(
        _COMMON_DEFAULTS, vocab_size=102400, hidden_size=4096, intermediate_size=11008,
        moe_intermediate_size=1407, num_hidden_layers=32, num_attention_heads=32, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=None, first_k_dense_replace=0, topk_method="greedy",
        scoring_func="softmax", n_group=None, topk_group=None, norm_topk_prob=False,
        routed_scaling_factor=1.0, max_position_embeddings=2048, num_nextn_predict_layers=0, bos_token_id=1,
        eos_token_id=2,
    ),
    "deepseek_v3": dict(
        _COMMON_DEFAULTS, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, topk_method="noaux_tc",
        scoring_func="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=4096, num_nextn_predict_layers=1, bos_token_id=0,
        eos_token_id=1,
    ),
}
# fmt: on

_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_SCORING_FUNCS = ("softmax", "sigmoid")
_ROPE_TYPES = ("default", "yarn")


@dataclass
class DeepseekModelConfig:
    """Hyper-parameters of a DeepSeek V2/V3 model (field names follow config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None  # None: a dense model (every layer a plain MLP)
    n_shared_experts: int | None
    num_experts_per_tok: int | None
    first_k_dense_replace: int
    moe_layer_freq: int
    topk_method: str
    scoring_func: str
    n_group: int  # None in config.json means one group
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # normalised: {"rope_type": "yarn", "factor": ..., ...} or None
    rope_interleave: bool
    hidden_act: str
    attention_bias: bool
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architectures: list[str] = field(default_factory=list)
    # From quantization_config: FP8 weights are dequantised at load in blocks of this shape (quantization=None).
    fp8_block_size: tuple[int, int] | None = None
    quantization_config: dict[str, Any] | None = None  # as in config.json
    # How the model is built: None = unquantised; set by build_model from EngineConfig.quantization.
    quant: QuantConfig | None = None
    torch_dtype: str | None = None
    source: str = "<dict>"  # the file this came from, for error messages

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> DeepseekModelConfig:
        """Read ``model_dir/config.json``. Raises ``FileNotFoundError`` for a missing directory or file and
        :class:`ConfigError` for malformed JSON or unsupported / invalid fields."""
        model_dir = os.fspath(model_dir)
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory not found: {model_dir}")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config.json not found in model directory {model_dir}")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level, got {type(raw).__name__}")
        return cls.from_dict(raw, source=path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> DeepseekModelConfig:
        """Build from a parsed config.json dict; ``source`` names the file in error messages."""

        def fail(name: str, problem: str) -> ConfigError:
            return ConfigError(f"{source}: field `{name}` {problem}")

        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise fail("model_type", f"is {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        values = dict(_DEFAULTS[model_type])
        known = {f.name for f in fields(cls)}
        values.update({k: v for k, v in raw.items() if k in known and k in values})
        values["rope_theta"], values["rope_scaling"] = _read_rope(
            raw, values["rope_theta"], values["max_position_embeddings"], fail
        )
        if model_type == "deepseek_v2":
            # V2 always rotates interleaved pairs; HF's V2 router never normalises top-k weights (we match HF,
            # which defines correctness here; official V2 configs set norm_topk_prob false anyway).
            values["rope_interleave"] = True
            values["norm_topk_prob"] = False
        if values["n_group"] is None:
            values["n_group"] = 1
        if values["topk_group"] is None:
            values["topk_group"] = values["n_group"]
        if values["n_shared_experts"] is None:
            values["n_shared_experts"] = 0
        quant = raw.get("quantization_config")
        fp8_block = None
        if quant is not None:
            if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
                method = quant.get("quant_method") if isinstance(quant, dict) else quant
                raise fail("quantization_config.quant_method", f"is {method!r}; only 'fp8' is supported")
            fp8_block = tuple(quant.get("weight_block_size") or (128, 128))
            if len(fp8_block) != 2 or not all(isinstance(b, int) and b > 0 for b in fp8_block):
                raise fail("quantization_config.weight_block_size", f"must be two positive integers, got {fp8_block!r}")
        cfg = cls(
            model_type=model_type,
            architectures=list(raw.get("architectures") or []),
            fp8_block_size=fp8_block,
            quantization_config=dict(quant) if quant is not None else None,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            source=source,
            **values,
        )
        cfg._validate(fail)
        return cfg

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Latent cache entry per token per layer: ``kv_lora_rank + qk_rope_head_dim`` (576 for V2/V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek's rule: MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN (as DeepSeek does)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.get("mscale_all_dim"):
            factor = rs["factor"]
            mscale = 0.1 * rs["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= mscale * mscale
        return scale

    # ---- validation ----------------------------------------------------------------------------------------
    def _validate(self, fail) -> None:
        positive = (
            "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads kv_lora_rank "
            "qk_nope_head_dim qk_rope_head_dim v_head_dim max_position_embeddings moe_layer_freq n_group "
            "topk_group"
        ).split()
        if self.q_lora_rank is not None:
            positive.append("q_lora_rank")
        if self.n_routed_experts is not None:
            positive += ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise fail(name, f"must be a positive integer, got {value!r}")
        for name in ("first_k_dense_replace", "num_nextn_predict_layers", "n_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise fail(name, f"must be a non-negative integer, got {value!r}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
            raise fail("rms_norm_eps", f"must be a positive number, got {self.rms_norm_eps!r}")
        if self.qk_rope_head_dim % 2:
            raise fail("qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            raise fail("hidden_act", f"is {self.hidden_act!r}; only 'silu' is supported")
        if self.topk_method not in _TOPK_METHODS:
            raise fail("topk_method", f"is {self.topk_method!r}; supported: {', '.join(_TOPK_METHODS)}")
        if self.scoring_func not in _SCORING_FUNCS:
            raise fail("scoring_func", f"is {self.scoring_func!r}; supported: {', '.join(_SCORING_FUNCS)}")
        if self.n_routed_experts is not None:
            if self.num_experts_per_tok > self.n_routed_experts:
                raise fail(
                    "num_experts_per_tok",
                    f"({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})",
                )
            if self.n_routed_experts % self.n_group:
                raise fail(
                    "n_group", f"({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})"
                )
            if self.topk_group > self.n_group:
                raise fail("topk_group", f"({self.topk_group}) exceeds n_group ({self.n_group})")
            if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
                raise fail(
                    "n_group", "leaves fewer than 2 experts per group, which noaux_tc group scoring needs"
                )


def _read_rope(
    raw: dict[str, Any], default_theta: float, max_positions: int, fail
) -> tuple[float, dict[str, Any] | None]:
    """Normalise ``rope_theta`` + ``rope_scaling`` (official) or ``rope_parameters`` (transformers >= 5) into
    ``(theta, scaling)`` where scaling is None for plain RoPE or a dict with ``rope_type == "yarn"``."""
    name = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(name)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise fail(name, f"must be an object, got {type(params).__name__}")
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise fail("rope_theta", f"must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "yarn" if rope_type == "deepseek_yarn" else rope_type  # vLLM's name for the same scaling
    if rope_type not in _ROPE_TYPES:
        raise fail(f"{name}.rope_type", f"is {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = "yarn"
    if scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = max_positions
    if scaling.get("factor") is None:
        # As transformers: without an explicit factor, use the context extension ratio.
        orig = scaling["original_max_position_embeddings"]
        scaling["factor"] = max_positions / orig
    factor = scaling["factor"]
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise fail(f"{name}.factor", f"must be a positive number, got {factor!r}")
    return float(theta), scaling
