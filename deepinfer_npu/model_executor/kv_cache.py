"""Allocation of the paged latent KV caches (one tensor per attention layer)."""

from __future__ import annotations

import torch

from .model_config import DeepseekModelConfig


def allocate_kv_caches(
    cfg: DeepseekModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    num_layers: int | None = None,
) -> list[torch.Tensor]:
    """``num_layers`` (default ``cfg.num_hidden_layers``) zeroed tensors [num_blocks, block_size, L + R].

    Pass ``num_layers=cfg.num_nextn_predict_layers`` for the MTP layers' caches. Block 0 is the padding target
    and is never handed out by the block manager.
    """
    n = cfg.num_hidden_layers if num_layers is None else num_layers
    return [
        torch.zeros(num_blocks, block_size, cfg.kv_cache_dim, dtype=dtype, device=device) for _ in range(n)
    ]
