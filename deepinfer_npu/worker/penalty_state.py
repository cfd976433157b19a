"""The token counts behind repetition / frequency / presence penalties, kept on the device per state slot.

Under zero-overhead scheduling the host plans step N+1 before it knows step N's tokens, so the counts cannot
come from the host: ``SlotState.output_counts[slot, token]`` counts the tokens a completion generated *before
its last one*, and ``SlotState.prompt_mask`` marks its prompt tokens. The last generated token is the next
step's first input; a decode step's row holds ``[last, draft_1 .. draft_d]``, so the counts for the token
sampled after input ``j`` are the slot's counts plus the row's inputs ``0..j`` (exact for every verified
position), and after verification the inputs ``0..accepted`` join the slot's counts (the new last token waits
for the next step). A prefill marks its prompt tokens and counts its inputs past the prompt (a recomputed
request's earlier outputs). Everything here is device ops on device tensors: no host read.

A fork's child copies its parent's slot; since the parent may have moved on by the child's first step, the
engine has such rows rebuilt from the host's token lists (:func:`rebuild`).
"""

from __future__ import annotations

import torch

from deepinfer_npu.worker.slot_state import SlotState


def record_prefill(s: SlotState, slot_of_token: torch.Tensor, is_prompt: torch.Tensor,
                   input_ids: torch.Tensor) -> None:
    """A prefill chunk's tokens: prompt tokens into ``prompt_mask``, later ones (recomputed outputs) counted.
    Tokens that are not prompt tokens write their mask entry to the dummy slot 0 (never read)."""
    mask_slot = torch.where(is_prompt, slot_of_token, torch.zeros_like(slot_of_token))
    s.prompt_mask.index_put_((mask_slot, input_ids), torch.ones_like(input_ids, dtype=torch.bool))
    s.output_counts.index_put_((slot_of_token, input_ids), (~is_prompt).to(torch.int32), accumulate=True)


def row_counts(s: SlotState, row_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output_counts, prompt_mask)`` ``[R, V]`` of the slots ``row_slots`` (a prefill's sampled rows)."""
    return s.output_counts.index_select(0, row_slots), s.prompt_mask.index_select(0, row_slots)


def decode_counts(s: SlotState, slot_of_token: torch.Tensor, row_of_token: torch.Tensor, j_of_token: torch.Tensor,
                  input_ids: torch.Tensor, num_rows: int, max_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per flat token of a decode step: the counts of the tokens generated before the one sampled after it
    (slot counts + the row's inputs ``0..j``) ``[T, V]`` int32, and the prompt mask ``[T, V]``."""
    device = input_ids.device
    pad = torch.full((num_rows, max_q), -1, dtype=torch.int64, device=device)
    pad[row_of_token, j_of_token] = input_ids.to(torch.int64)
    before = pad.index_select(0, row_of_token)  # [T, max_q]: the row's inputs
    upto = torch.arange(max_q, device=device)[None, :] <= j_of_token[:, None]
    valid = upto & (before >= 0)
    counts = s.output_counts.index_select(0, slot_of_token)
    counts.scatter_add_(1, before.clamp(min=0), valid.to(torch.int32))
    return counts, s.prompt_mask.index_select(0, slot_of_token)


def record_decode(s: SlotState, slot_of_token: torch.Tensor, j_of_token: torch.Tensor,
                  accepted_of_token: torch.Tensor, input_ids: torch.Tensor) -> None:
    """After verification: the inputs ``0..accepted`` of each row (its last token and accepted drafts) are
    generated tokens that now precede the row's new last token."""
    keep = (j_of_token <= accepted_of_token).to(torch.int32)
    s.output_counts.index_put_((slot_of_token, input_ids.to(torch.int64)), keep, accumulate=True)


def rebuild(s: SlotState, slots: torch.Tensor, prompt_slots: torch.Tensor, prompt_ids: torch.Tensor,
            output_slots: torch.Tensor, output_ids: torch.Tensor) -> None:
    """Reset ``slots`` and refill them from token lists (flattened ``(slot, token)`` pairs): the prompt's
    tokens into the mask, the generated tokens before the last into the counts."""
    s.output_counts.index_fill_(0, slots, 0)
    s.prompt_mask.index_fill_(0, slots, False)
    s.prompt_mask.index_put_((prompt_slots, prompt_ids), torch.ones_like(prompt_ids, dtype=torch.bool))
    s.output_counts.index_put_((output_slots, output_ids), torch.ones_like(output_ids, dtype=torch.int32),
                               accumulate=True)
