"""The latent KV cache as the fused attention op wants it: separate contiguous ``k_nope`` and ``k_rope``
caches.

The HAL allocates one tensor per layer, ``[num_blocks, block_size, L + R]`` (FlashMLA layout). Ascend's MLA
ops
(``npu_fused_infer_attention_score`` with ``query_rope``/``key_rope``, ``npu_mla_prolog_v2``,
``npu_kv_rmsnorm_rope_cache``) take two contiguous caches ``[num_blocks, block_size, 1, L]`` and ``[..., R]``.
Slicing the last dim would give non-contiguous views, so instead we *reinterpret the same storage*: its first
``num_blocks*block_size*L`` elements are the k_nope cache and the rest the k_rope cache. Nothing is copied and
the memory budget is unchanged.

Consequence: code outside this backend must not address the cache by block (``cache[block]``): in the split
layout, ``cache[b]`` is not block ``b``. Fork copy-on-write goes through the HAL op
``KernelSet.copy_kv_blocks`` (``ModelRunner.apply_block_ops`` calls it), which the Ascend kernel set implements
with :func:`copy_blocks_split` for caches written in this layout.
The layout is used only when mla_prolog and mla_attention both run natively, so the reference ops (which read
the HAL layout) never see it.
"""

from __future__ import annotations

import torch


def split_views(kv_cache: torch.Tensor, latent_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_nope [nb, bs, 1, L], k_rope [nb, bs, 1, R])`` views over ``kv_cache``'s storage (both
    contiguous)."""
    nb, bs, width = kv_cache.shape
    if width != latent_dim + rope_dim:
        raise ValueError(f"kv cache width {width} != kv_lora_rank {latent_dim} + rope dim {rope_dim}")
    if not kv_cache.is_contiguous():
        raise ValueError("the split KV layout needs a contiguous cache tensor")
    flat = kv_cache.view(-1)
    rows = nb * bs
    k_nope = flat[: rows * latent_dim].view(nb, bs, 1, latent_dim)
    k_rope = flat[rows * latent_dim :].view(nb, bs, 1, rope_dim)
    return k_nope, k_rope


def write_split(
    kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``c_kv`` [T, L] and ``k_pe`` [T, R] into the split caches at ``slot_mapping`` [T].

    Negative slots (padding) are redirected to slot 0, which lies in block 0: the scheduler never hands block
    0
    out, so it is a write-only sink. This keeps the scatter free of a data-dependent mask (``x[mask]`` would
    need a device->host sync to size its result).
    """
    k_nope, k_rope = split_views(kv_cache, c_kv.shape[-1], k_pe.shape[-1])
    slots = torch.where(slot_mapping >= 0, slot_mapping, torch.zeros_like(slot_mapping))
    k_nope.view(-1, c_kv.shape[-1]).index_copy_(0, slots, c_kv.to(kv_cache.dtype))
    k_rope.view(-1, k_pe.shape[-1]).index_copy_(0, slots, k_pe.to(kv_cache.dtype))


def copy_blocks_split(
    kv_cache: torch.Tensor, latent_dim: int, rope_dim: int, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Block copy-on-write in the split layout: block ``dst[i]`` of both the k_nope and the k_rope cache becomes
    a copy of block ``src[i]`` (the split-layout equivalent of the reference ``index_copy_`` on dim 0). Sources
    are gathered before destinations are written, as in the reference."""
    k_nope, k_rope = split_views(kv_cache, latent_dim, rope_dim)
    k_nope.index_copy_(0, dst, k_nope.index_select(0, src))
    k_rope.index_copy_(0, dst, k_rope.index_select(0, src))


def to_hal_layout(kv_cache: torch.Tensor, latent_dim: int, rope_dim: int) -> torch.Tensor:
    """A copy of a split-layout cache in the HAL layout ``[num_blocks, block_size, L + R]`` (tests, debugging)."""
    k_nope, k_rope = split_views(kv_cache, latent_dim, rope_dim)
    return torch.cat((k_nope.squeeze(2), k_rope.squeeze(2)), dim=-1)


def from_hal_layout(hal: torch.Tensor, latent_dim: int, rope_dim: int) -> torch.Tensor:
    """The split-layout storage (shape ``[num_blocks, block_size, L + R]``) holding ``hal``'s rows."""
    out = torch.empty_like(hal).contiguous()
    k_nope, k_rope = split_views(out, latent_dim, rope_dim)
    k_nope.copy_(hal[..., :latent_dim].unsqueeze(2))
    k_rope.copy_(hal[..., latent_dim:].unsqueeze(2))
    return out
