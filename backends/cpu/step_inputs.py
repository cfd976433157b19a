"""Reference ``decode_inputs`` op: a decode step's per-token inputs, derived on the device (ZOS launch path).

Under zero-overhead scheduling the CPU plans step N+1 before step N has finished, so a row's first input token
(the token step N samples) and its draft tokens are only on the device, and ``zos_fixup`` may correct the lengths
there. From the corrected lengths, the block tables and the slot state this op derives, with no host read:

* ``cu_seqlens_q`` [B+1] int32 (exclusive scan of the query lengths, then the total);
* per token ``t`` of row ``r = row_of_token[t]`` at offset ``j = j_of_token[t]`` in its row: ``positions`` (the
  row's context length - its query length + j), ``slot_mapping`` (``block * block_size + position % block_size``;
  positions past the row's block table map to block 0, the padding block no sequence reads as its own);
* ``input_ids``: at j = 0 the row's first token (``first_ids[r]``, or, where the CPU did not know it (-1), the
  slot's ``last_token``), else the slot's draft ``j - 1``;
* ``draft_next``: the draft that follows each token in its row (``-1`` after the row's last token).

Precondition: ``num_tokens == seqlens_q.sum()`` (the CPU fixed total_q; zos_fixup's re-split keeps it).
The positions / slots / rows come from ``model_executor/device_metadata.token_layout`` (which the prefill
path's ``build_device_metadata`` uses too), the ids from the worker's decode path before this op existed; a
backend's kernel must match it exactly (integers: bit-exact).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer_npu.model_executor.device_metadata import token_layout


class DecodeInputs(NamedTuple):
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    row_of_token: torch.Tensor  # [T] int64
    j_of_token: torch.Tensor  # [T] int64
    input_ids: torch.Tensor  # [T] int64
    draft_next: torch.Tensor  # [T] int64


def decode_inputs(
    seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    state_slots: torch.Tensor,
    first_ids: torch.Tensor,
    last_token: torch.Tensor,
    drafts: torch.Tensor,
    block_size: int,
    num_tokens: int,
) -> DecodeInputs:
    """``seqlens_q / seqlens_k`` [B] int32, ``block_tables`` [B, W] int32, ``state_slots`` [B] int64,
    ``first_ids`` [B] int64 (-1: not known to the CPU), ``last_token`` [S] int64, ``drafts`` [S, K] int64 (K >= 1)
    -> :class:`DecodeInputs` for ``num_tokens`` tokens."""
    q = seqlens_q.to(torch.int64)
    cu, row, j, positions, slot_mapping = token_layout(q, seqlens_k.to(torch.int64), block_tables, block_size,
                                                       num_tokens)
    last_col = drafts.shape[1] - 1
    slot_tok = state_slots.index_select(0, row)
    first = first_ids.index_select(0, row)
    first = torch.where(first >= 0, first, last_token.index_select(0, slot_tok))
    ids = torch.where(j == 0, first, drafts[slot_tok, (j - 1).clamp(min=0, max=last_col)])
    has_next = (j + 1) < q.index_select(0, row)
    nxt = drafts[slot_tok, j.clamp(max=last_col)]
    draft_next = torch.where(has_next, nxt, torch.full_like(nxt, -1))
    return DecodeInputs(positions, slot_mapping, cu.to(torch.int32), row, j, ids, draft_next)
