"""AttentionMetadata built from device tensors without any host synchronisation (the ZOS launch path).

``build_attention_metadata`` builds from host arrays; under zero-overhead scheduling the lengths are corrected on
the device, so the positions and cache slots must be derived there too. ``num_tokens`` and the ``max_seqlen_*``
bounds are host values the CPU fixed when it planned the step (upper bounds are fine).
"""

from __future__ import annotations

import torch

from .attention_metadata import AttentionMetadata, HostLengths


def token_layout(
    q: torch.Tensor, k: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token layout of a step from int64 query / context lengths ``q`` / ``k`` [B] -> ``(cu_seqlens_q [B+1],
    row_of_token, j_of_token, positions, slot_mapping)`` (int64, [T]); no host read. Positions past a row's block
    table map to block 0 (the padding block). Shared with the HAL's ``decode_inputs`` reference."""
    device = q.device
    b = q.shape[0]
    cu = torch.zeros(b + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(q, dim=0)
    row = torch.repeat_interleave(torch.arange(b, device=device), q, output_size=num_tokens)
    j = torch.arange(num_tokens, device=device) - cu.index_select(0, row)
    positions = k.index_select(0, row) - q.index_select(0, row) + j
    tables = block_tables.to(torch.int64)
    col = (positions // block_size).clamp(max=tables.shape[1] - 1)
    block = torch.where(positions // block_size < tables.shape[1], tables[row, col], torch.zeros_like(col))
    slot_mapping = block * block_size + positions % block_size
    return cu, row, j, positions, slot_mapping


def build_device_metadata(
    seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_tokens: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_prefill: bool,
    host: HostLengths | None = None,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """-> ``(attn, row_of_token [T], j_of_token [T])``. Positions past a row's block table (draft chains that run
    ahead of the reservation) map to block 0, the padding block, which no sequence reads as its own."""
    q = seqlens_q.to(torch.int64)
    k = seqlens_k.to(torch.int64)
    cu, row, j, positions, slot_mapping = token_layout(q, k, block_tables, block_size, num_tokens)
    attn = AttentionMetadata(
        seqlens_q=q.to(torch.int32),
        seqlens_k=k.to(torch.int32),
        cu_seqlens_q=cu.to(torch.int32),
        block_tables=block_tables.to(torch.int32),
        slot_mapping=slot_mapping,
        positions=positions,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        is_prefill=is_prefill,
        host=host,
    )
    return attn, row, j


def pad_block_tables(block_tables: torch.Tensor, max_position: int, block_size: int) -> torch.Tensor:
    """Widen ``block_tables`` with padding (block 0) so positions up to ``max_position`` have a column."""
    need = max_position // block_size + 1
    if block_tables.shape[1] >= need:
        return block_tables
    pad = block_tables.new_zeros((block_tables.shape[0], need - block_tables.shape[1]))
    return torch.cat([block_tables, pad], dim=1)
