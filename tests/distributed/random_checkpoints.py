"""Tiny random DeepSeek checkpoints (HF transformers models, saved as safetensors) for the multi-rank tests:
grouped routing, shared experts and a dense first layer, at sizes a CPU runs in seconds."""

from __future__ import annotations

import torch


def save_random_checkpoint(kind: str, path) -> str:
    """A tiny random DeepSeek-V2 (``"v2"``) or V3 (``"v3"``) checkpoint at ``path``; returns its directory."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                max_position_embeddings=256, initializer_range=0.15, first_k_dense_replace=1)
    if kind == "v2":  # softmax scores, group-limited greedy routing
        config = DeepseekV2Config(**base, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                  topk_group=2, routed_scaling_factor=1.5)
        model = DeepseekV2ForCausalLM(config)
    else:  # sigmoid scores, noaux_tc with a correction bias
        config = DeepseekV3Config(**base, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5)
        model = DeepseekV3ForCausalLM(config)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    return str(path)
