"""FlashMLA (github.com/deepseek-ai/FlashMLA): paged MLA decode for Hopper, on our latent cache when the user built it.

Detects the ``flash_mla`` package (``get_mla_metadata``, ``flash_mla_with_kvcache``). :func:`mla_decode` calls it on
the engine's tensors: the FlashMLA layout is the one our cache already has (pages of 64 tokens, each row the 512
latent values followed by the 64 rope values, one KV head), so the cache is passed as a view. Fallback: the TileLang
kernel ``kernels_cuda.mla_decode``.
"""

from __future__ import annotations

import torch

from .status import VendorStatus, probe_module, require

NAME = "flash_mla"
FALLBACK = "kernels_cuda.mla_decode"
PAGE = 64  # FlashMLA's page_block_size
LATENT, ROPE = 512, 64  # head_dim_v and head_dim - head_dim_v (576 values per cache row)


def probe() -> VendorStatus:
    return probe_module(NAME, "flash_mla", ("get_mla_metadata", "flash_mla_with_kvcache"), ("flash_mla", "flash-mla"))


def unsupported(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why FlashMLA cannot take these tensors, or None: bf16 / fp16, L = 512, R = 64, pages of 64 tokens."""
    if kv_cache.dtype not in (torch.bfloat16, torch.float16) or q_latent.dtype != kv_cache.dtype:
        return f"dtype {q_latent.dtype} / cache {kv_cache.dtype} (bf16 or fp16 only)"
    if q_latent.shape[-1] != LATENT or q_rope.shape[-1] != ROPE:
        return f"head dims {q_latent.shape[-1]} + {q_rope.shape[-1]} (takes {LATENT} + {ROPE})"
    if kv_cache.dim() != 3 or kv_cache.shape[1] != PAGE or kv_cache.shape[2] != LATENT + ROPE:
        return f"cache {tuple(kv_cache.shape)} (takes [blocks, {PAGE}, {LATENT + ROPE}])"
    return None


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seqlens_k: torch.Tensor, softmax_scale: float, q_per_request: int) -> torch.Tensor:
    """The HAL's ``mla_attention`` for a decode step whose requests all have ``q_per_request`` query tokens.

    ``q_latent`` [T, H, 512], ``q_rope`` [T, H, 64], ``kv_cache`` [blocks, 64, 576], ``block_tables`` [B, nb],
    ``seqlens_k`` [B] (T = B * q_per_request) -> ``out_latent`` [T, H, 512]. Causal within a request as the
    HAL's contract: query j sits at position ``seqlens_k - q_per_request + j``.
    """
    lib = require(probe(), NAME)
    tokens, heads, latent = q_latent.shape
    batch = block_tables.shape[0]
    if tokens != batch * q_per_request:
        raise ValueError(f"{tokens} query tokens are not {batch} requests x {q_per_request}")
    why = unsupported(q_latent, q_rope, kv_cache)
    if why is not None:
        raise ValueError(f"flash_mla does not take {why}")
    q = torch.cat((q_latent, q_rope), dim=-1).view(batch, q_per_request, heads, latent + q_rope.shape[-1])
    k_cache = kv_cache.unsqueeze(2)  # [blocks, 64, 1 KV head, 576]
    cache_seqlens = seqlens_k.to(torch.int32)
    # (metadata, splits): releases before 1.0 plan here; later ones plan at the first call and return (meta, None).
    metadata, num_splits = lib.get_mla_metadata(cache_seqlens, q_per_request * heads, 1)
    out, _lse = lib.flash_mla_with_kvcache(q, k_cache, block_tables.to(torch.int32), cache_seqlens, latent,
                                           metadata, num_splits, softmax_scale=softmax_scale, causal=True)
    return out.reshape(tokens, heads, latent)
