"""Shared by the GPU tests here: a DeepSeek-V2 model directory at the real MLA dims (random weights through
``load_format="dummy"``) and the logprobs-close rule for greedy runs on different kernels."""

from __future__ import annotations

import json

import pytest

DEEPSEEK_DIMS = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 4096,
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "topk_method": "greedy", "scoring_func": "softmax",
    "moe_layer_freq": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "initializer_range": 0.02,
}


@pytest.fixture
def deepseek_dims_model(tmp_path):
    """-> make(**overrides): writes config.json (DEEPSEEK_DIMS with the overrides) to a temporary directory and
    returns its path as a string, for ``LLM(path, load_format="dummy")``."""

    def make(**overrides) -> str:
        (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_DIMS | overrides))
        return str(tmp_path)

    return make


@pytest.fixture
def assert_logprobs_close():
    """-> check(a_outputs, b_outputs): greedy runs on different kernels (logprobs=5): at the first position where
    the tokens differ, each run's token is in the other's top-5."""

    def check(a_outputs, b_outputs) -> None:
        for a, b in zip(a_outputs, b_outputs):
            ta, tb = list(a.token_ids), list(b.token_ids)
            first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
            if first is not None:
                assert tb[first] in a.logprobs[first] and ta[first] in b.logprobs[first], (first, ta, tb)

    return check
