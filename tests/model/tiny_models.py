"""Small random HF DeepSeek models (transformers) saved in HF layout, and a tiny paged-cache driver for our model."""

from __future__ import annotations

import os

import torch

from deepinfer_npu.hal import get_backend
from deepinfer_npu.model_executor import (
    DeepseekModelConfig,
    allocate_kv_caches,
    build_attention_metadata,
    build_model,
    load_weights,
)

BLOCK_SIZE = 16

# Small dims shared by every config; each case overrides what it exercises.
BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    max_position_embeddings=256,
    initializer_range=0.15,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def make_hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers DeepseekV2/V3ForCausalLM (eager attention, fp32) with non-trivial router
    biases."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    args = {**BASE, **overrides}
    if kind == "v2":
        config, cls = DeepseekV2Config(**args), DeepseekV2ForCausalLM
    else:
        config, cls = DeepseekV3Config(**args), DeepseekV3ForCausalLM
    config._attn_implementation = "eager"
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # norms are ones at init; perturb so a wrong norm weight shows
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def save_hf(model, path: str, **kwargs) -> str:
    model.save_pretrained(path, **kwargs)
    return os.fspath(path)


def load_ours(model_dir: str, dtype: torch.dtype = torch.float32):
    cfg = DeepseekModelConfig.from_pretrained(model_dir)
    model = build_model(cfg, get_backend("cpu"), dtype)
    load_weights(model, model_dir)
    return model


class PagedRunner:
    """Drives our model like a minimal engine: per-request block tables (non-contiguous blocks), prefill
    chunks and batched decode steps through the paged cache."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = BLOCK_SIZE, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        cfg = model.config
        self.kv_caches = allocate_kv_caches(cfg, num_blocks, block_size, model.dtype)
        # Hand out blocks in a shuffled order (block 0 reserved) so paging bugs cannot hide behind contiguity.
        g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def _reserve(self, rid: int, new_len: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.block_size < new_len:
            table.append(self.free.pop())

    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Run one step: ``{request id: new token ids}`` -> logits [sum(len), V] fp32 (rows in dict order)."""
        rids = list(chunks)
        q = [len(chunks[r]) for r in rids]
        k = [self.lengths.get(r, 0) + len(chunks[r]) for r in rids]
        for r, kk in zip(rids, k):
            self._reserve(r, kk)
        width = max(len(self.tables[r]) for r in rids)
        tables = [self.tables[r] + [0] * (width - len(self.tables[r])) for r in rids]
        attn = build_attention_metadata(q, k, tables, self.block_size)
        ids = torch.tensor([t for r in rids for t in chunks[r]], dtype=torch.int32)
        with torch.no_grad():
            hidden = self.model(ids, attn.positions, attn, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        for r, kk in zip(rids, k):
            self.lengths[r] = kk
        return logits


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """Full-sequence HF logits [len, V] fp32."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - b| / max |b| (the issue's logits metric)."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())
