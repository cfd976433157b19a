"""The latent KV cache as the fused attention op wants it: separate contiguous ``k_nope`` and ``k_rope``
caches.

The HAL allocates one tensor per layer, ``[num_blocks, block_size, L + R]`` (FlashMLA layout). Ascend's MLA
ops
(``npu_fused_infer_attention_score`` with ``query_rope``/``key_rope``, ``npu_mla_prolog_v2``,
``npu_kv_rmsnorm_rope_cache``) take two contiguous caches ``[num_blocks, block_size, 1, L]`` and ``[..., R]``.
Slicing the last dim would give non-contiguous views, so instead we *reinterpret the same storage*: its first
``num_blocks*block_size*L`` elements are the k_nope cache and the rest the k_rope cache. Nothing is copied and
the memory budget is unchanged.

Consequence (reported by the backend): with this layout, code outside this backend must not address the cache
by block (``cache[block]``). Today only ``ModelRunner.apply_block_ops`` does (fork copy-on-write, which the
engine
does not produce yet: ``n > 1`` is rejected); the HAL change that removes the caveat is a
``KernelSet.copy_kv_blocks(cache, src, dst)`` hook (asked for in the hand-off note).
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
