"""config.json parsing: both rope spellings, defaults, and errors that name the field and file."""

from __future__ import annotations

import json

import pytest

from deepinfer_npu.model_executor import ConfigError, DeepseekModelConfig

# As in deepseek-ai/DeepSeek-V3's config.json (dims shrunk), official spelling: rope_theta + rope_scaling
# "type".
OFFICIAL_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "topk_method": "noaux_tc",
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def _write(tmp_path, content) -> str:
    (tmp_path / "config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return str(tmp_path)


def test_official_and_transformers_rope_spellings_agree(tmp_path):
    official = DeepseekModelConfig.from_dict(OFFICIAL_V3)
    modern = dict(OFFICIAL_V3)
    del modern["rope_theta"], modern["rope_scaling"]
    modern["rope_parameters"] = {**OFFICIAL_V3["rope_scaling"], "rope_theta": 10000.0, "rope_type": "yarn"}
    del modern["rope_parameters"]["type"]
    new = DeepseekModelConfig.from_pretrained(_write(tmp_path, modern))
    assert official.rope_theta == new.rope_theta == 10000.0
    assert official.rope_scaling == new.rope_scaling
    assert official.rope_scaling["rope_type"] == "yarn" and official.rope_scaling["factor"] == 40
    assert official.fp8_block_size == (128, 128)
    # YaRN softmax scale: qk_head_dim^-0.5 * (0.1 * ln 40 + 1)^2
    assert official.softmax_scale == pytest.approx(24**-0.5 * (0.1 * __import__("math").log(40) + 1) ** 2)
    assert [official.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_missing_optional_fields_take_hf_defaults():
    cfg = DeepseekModelConfig.from_dict({"model_type": "deepseek_v2", "num_experts_per_tok": 6})
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.topk_method, cfg.scoring_func) == (
        4096,
        1536,
        "greedy",
        "softmax",
    )
    assert (cfg.n_group, cfg.topk_group, cfg.rope_scaling, cfg.rope_theta) == (1, 1, None, 10000.0)
    v3 = DeepseekModelConfig.from_dict({"model_type": "deepseek_v3", "q_lora_rank": None})
    assert (v3.q_lora_rank, v3.topk_method, v3.scoring_func, v3.num_nextn_predict_layers) == (
        None,
        "noaux_tc",
        "sigmoid",
        1,
    )
    assert v3.kv_cache_dim == 576


def test_missing_dir_and_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found: .*nope"):
        DeepseekModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        DeepseekModelConfig.from_pretrained(tmp_path)


def test_malformed_json_names_file(tmp_path):
    path = _write(tmp_path, '{"model_type": "deepseek_v3",,}')
    with pytest.raises(ConfigError, match=r"config\.json: malformed JSON .*line 1"):
        DeepseekModelConfig.from_pretrained(path)


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"model_type": "llama"}, "`model_type` is 'llama'"),
        ({"hidden_act": "gelu"}, "`hidden_act`"),
        ({"topk_method": "sinkhorn"}, "`topk_method`"),
        ({"num_experts_per_tok": 32}, "`num_experts_per_tok` \\(32\\) exceeds n_routed_experts"),
        ({"n_group": 3}, "`n_group`"),
        ({"hidden_size": -4}, "`hidden_size` must be a positive integer"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "`rope_scaling.rope_type` is 'dynamic'"),
        ({"quantization_config": {"quant_method": "awq"}}, "`quantization_config.quant_method`"),
    ],
)
def test_bad_values_name_field_and_file(tmp_path, patch, field):
    path = _write(tmp_path, {**OFFICIAL_V3, **patch})
    with pytest.raises(ConfigError, match=rf"config\.json: field {field}"):
        DeepseekModelConfig.from_pretrained(path)
