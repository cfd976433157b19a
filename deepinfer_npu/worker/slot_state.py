"""Per-state-slot device buffers that carry a sequence from one step to the next (docs/interfaces.md §4).

Indexed by the scheduler's state slot, so forks copy them (``clone_states``), new sequences reset them
(``zero_states``), and the next step gathers its inputs here on the device — nothing waits for the host.
"""

from __future__ import annotations

import torch


class SlotState:
    def __init__(self, num_slots: int, num_drafts: int, device: torch.device) -> None:
        k = max(num_drafts, 1)
        self.last_token = torch.zeros(num_slots, dtype=torch.int64, device=device)  # next row's first input
        self.drafts = torch.zeros(num_slots, k, dtype=torch.int64, device=device)
        self.draft_probs = torch.zeros(num_slots, k, dtype=torch.float32, device=device)
        self.correction = torch.zeros(num_slots, dtype=torch.int64, device=device)  # drafts - accepted of last step

    def zero(self, slots: torch.Tensor) -> None:
        for buf in (self.last_token, self.drafts, self.draft_probs, self.correction):
            buf.index_fill_(0, slots, 0)

    def clone(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for buf in (self.last_token, self.drafts, self.draft_probs, self.correction):
            buf.index_copy_(0, dst, buf.index_select(0, src))
