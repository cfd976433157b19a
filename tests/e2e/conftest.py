"""Fixtures for end-to-end engine tests: small random transformers DeepSeek models saved in HF layout, and
transformers' own greedy continuation as the reference."""

from __future__ import annotations

import pytest
import torch

from tests.model.tiny_models import make_hf_model, save_hf

CASES = {
    "v3_grouped": ("v3", dict(n_group=2, topk_group=1, first_k_dense_replace=1)),
    "v3_noqlora_yarn": ("v3", dict(q_lora_rank=None, first_k_dense_replace=2, n_group=4, topk_group=2, rope_scaling={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "v2_group_limited": ("v2", dict(topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                    first_k_dense_replace=0, q_lora_rank=24)),
}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (hf_model, model_dir)."""
    out = {}
    for name, (kind, overrides) in CASES.items():
        model = make_hf_model(kind, seed=len(out), **overrides)
        path = tmp_path_factory.mktemp(name)
        out[name] = (model, save_hf(model, str(path)))
    return out


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by transformers, recomputing the full sequence each step (no cache shortcuts)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


# Mixed lengths crossing 16-token block boundaries (block_size=16 in these tests).
PROMPTS = [
    list(range(1, 6)),
    [(7 * i + 3) % 90 + 1 for i in range(17)],
    [(11 * i + 5) % 90 + 1 for i in range(33)],
    [(13 * i + 1) % 90 + 1 for i in range(16)],
]
