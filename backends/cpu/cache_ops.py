"""Reference paged-KV-cache block ops (fork copy-on-write)."""

from __future__ import annotations

import torch


def copy_kv_blocks(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """For every cache ``[num_blocks, ...]``: block ``dst[i]`` becomes a copy of block ``src[i]`` (in place).

    All sources are read before any destination is written (gather, then scatter), so a block may be both a
    source and a destination of the same call. ``src`` / ``dst`` [C] int64 on the caches' device."""
    if src.numel() == 0:
        return
    for cache in caches:
        cache.index_copy_(0, dst, cache.index_select(0, src))
