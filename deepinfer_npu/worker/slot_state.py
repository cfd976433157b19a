"""Per-state-slot device buffers that carry a sequence from one step to the next (docs/interfaces.md §4).

Indexed by the scheduler's state slot, so forks copy them (``clone_states``), new sequences reset them
(``zero_states``), and the next step gathers its inputs here on the device — nothing waits for the host.

The penalty buffers (``output_counts``, ``prompt_mask``: ``[num_slots, vocab]``) exist only once a request uses a
repetition / frequency / presence penalty (:meth:`enable_penalties`); see ``worker/penalty_state.py``.
"""

from __future__ import annotations

import torch


class SlotState:
    def __init__(self, num_slots: int, num_drafts: int, device: torch.device) -> None:
        k = max(num_drafts, 1)
        self.num_slots = num_slots
        self.device = device
        self.last_token = torch.zeros(num_slots, dtype=torch.int64, device=device)  # next row's first input
        self.drafts = torch.zeros(num_slots, k, dtype=torch.int64, device=device)
        self.draft_probs = torch.zeros(num_slots, k, dtype=torch.float32, device=device)
        self.correction = torch.zeros(num_slots, dtype=torch.int64, device=device)  # drafts - accepted of last step
        # per slot and token: how often the completion generated it, not counting its last token (the next
        # step's first input, counted when that step verifies it); and whether the prompt holds it
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    @property
    def has_penalties(self) -> bool:
        return self.output_counts is not None

    def enable_penalties(self, vocab_size: int) -> None:
        """Allocate the penalty buffers (zeroed) if they do not exist yet."""
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.num_slots, vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self.num_slots, vocab_size, dtype=torch.bool, device=self.device)

    def _buffers(self) -> list[torch.Tensor]:
        bufs = [self.last_token, self.drafts, self.draft_probs, self.correction]
        if self.output_counts is not None:
            bufs += [self.output_counts, self.prompt_mask]
        return bufs

    def zero(self, slots: torch.Tensor) -> None:
        for buf in self._buffers():
            buf.index_fill_(0, slots, 0)

    def clone(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for buf in self._buffers():
            buf.index_copy_(0, dst, buf.index_select(0, src))
