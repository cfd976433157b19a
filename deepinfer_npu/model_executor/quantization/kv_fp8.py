"""FP8 latent KV cache rows in FlashMLA's layout (``kv_cache_dtype="fp8"``): per token, the ``L`` latent values as
e4m3 (one fp32 scale per 128 of them, ``amax / 448``), then those scales, then the ``R`` RoPE key values in bf16 —
656 bytes for DeepSeek-V2/V3 (512 + 4 x 4 + 64 x 2) instead of 1 152 in bf16.

The CPU reference stores its caches this way (``backends/cpu/mla.py`` packs on write and unpacks on read: a uint8
cache is a packed one); backends without an FP8 attention path refuse ``kv_cache_dtype="fp8"`` at start-up
(``Backend.supports_fp8_kv_cache``). The start-up report uses :func:`latent_bytes_per_token`.
"""

from __future__ import annotations

import math

import torch

from .fp8 import BLOCK, dequantize_per_token_group, quantize_per_token_group

FP8_KV_DTYPE = torch.uint8  # rows are raw bytes: e4m3 values, fp32 scales and bf16 RoPE values side by side


def fp8_latent_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token's packed row: ``L`` e4m3 + ``4 * ceil(L / 128)`` scale bytes + ``2 * R`` bf16 bytes."""
    return kv_lora_rank + 4 * math.ceil(kv_lora_rank / BLOCK) + 2 * rope_dim


def latent_bytes_per_token(kv_lora_rank: int, rope_dim: int, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Cache bytes per token and layer: the packed FP8 row, or ``L + R`` values of the model dtype (``"auto"``)."""
    if kv_cache_dtype == "fp8":
        return fp8_latent_row_bytes(kv_lora_rank, rope_dim)
    if kv_cache_dtype == "auto":
        return (kv_lora_rank + rope_dim) * torch.empty((), dtype=model_dtype).element_size()
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")


def latent_cache_layout(kv_lora_rank: int, rope_dim: int, kv_cache_dtype: str,
                        model_dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """``(row width, element dtype)`` of a latent cache tensor ``[blocks, block_size, width]``."""
    if kv_cache_dtype == "fp8":
        return fp8_latent_row_bytes(kv_lora_rank, rope_dim), FP8_KV_DTYPE
    latent_bytes_per_token(kv_lora_rank, rope_dim, kv_cache_dtype, model_dtype)  # validates the name
    return kv_lora_rank + rope_dim, model_dtype


def pack_fp8_latents(latents: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """``latents`` [T, L + R] (``c_kv ‖ k_rope``, any float dtype) -> uint8 [T, fp8_latent_row_bytes(L, R)]."""
    c_kv, k_rope = latents[:, :kv_lora_rank], latents[:, kv_lora_rank:]
    q, scales = quantize_per_token_group(c_kv)
    parts = (q.view(torch.uint8), scales.contiguous().view(torch.uint8),
             k_rope.to(torch.bfloat16).contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1)


def unpack_fp8_latents(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_fp8_latents`: uint8 [..., bytes] -> fp32 [..., L + R]."""
    lead, groups = rows.shape[:-1], math.ceil(kv_lora_rank / BLOCK)
    flat = rows.reshape(-1, rows.shape[-1])
    q = flat[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn)
    scales = flat[:, kv_lora_rank : kv_lora_rank + 4 * groups].contiguous().view(torch.float32)
    k_rope = flat[:, kv_lora_rank + 4 * groups :].contiguous().view(torch.bfloat16)
    if k_rope.shape[-1] != rope_dim:
        raise ValueError(f"packed rows of {rows.shape[-1]} bytes do not hold L={kv_lora_rank}, R={rope_dim}")
    out = torch.cat((dequantize_per_token_group(q, scales), k_rope.float()), dim=-1)
    return out.reshape(*lead, kv_lora_rank + rope_dim)
