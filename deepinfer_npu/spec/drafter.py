"""The drafter contract: what the worker hands a drafter after each step, and what it gets back.

A drafter proposes ``k`` tokens per sequence for the next step, with a confidence per token (the probability that
the draft is accepted given the previous ones were), from device tensors only — no host synchronisation, so it
runs inside the zero-overhead launch path. See ``docs/interfaces.md`` §4.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_npu.model_executor.attention_metadata import AttentionMetadata


@dataclass
class DraftContext:
    """One finished main step, as a drafter sees it (device tensors).

    ``hidden [T, D]``: the main model's final-normed hidden state of every token of the step.
    ``target_tokens [T]``: the token that follows each input token (the accepted draft, the emitted sample at the
    first rejection, the next prompt token inside a prefill chunk); the MTP catch-up embeds these.
    ``anchor_rows [B']``: flat index of the token whose successor is the new golden token, per proposing row;
    ``bonus_tokens / bonus_positions / slots [B']``: that golden token, its position, the row's state slot.
    ``captured``: residual-stream outputs of the target layers the drafter asked for (DFlash), else None.
    ``host_rows``: the main step's row (host index) of each proposing row, so drafters can derive host length
    bounds (``AttentionMetadata.host``) for their own attention steps without reading the device.
    """

    attn: AttentionMetadata
    hidden: torch.Tensor
    target_tokens: torch.Tensor
    anchor_rows: torch.Tensor
    bonus_tokens: torch.Tensor
    bonus_positions: torch.Tensor
    slots: torch.Tensor
    captured: dict[int, torch.Tensor] | None = None
    host_rows: np.ndarray | None = None  # main-step row (host index) of each proposing row, for host lengths


class Drafter:
    """Base class. ``capture_layer_ids`` (DFlash) asks the main forward for those layers' outputs."""

    name: str = "drafter"
    capture_layer_ids: tuple[int, ...] | None = None

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def on_main_forward(self, attn: AttentionMetadata, captured: dict[int, torch.Tensor] | None,
                        slots_per_token: torch.Tensor) -> None:
        """Called right after every main forward (prefill and decode), before verification."""

    def main_forward_hook_in_graph(self):
        """A function ``(captured, positions [S], slots_per_token [S]) -> None`` doing :meth:`on_main_forward`'s
        work with device ops only, which decode graphs then capture after the main forward (padding tokens come at
        position 0 of state slot 0, the dummy slot); the worker skips :meth:`on_main_forward` for steps replayed
        from such a graph. None (the default): the hook stays eager."""
        return None

    def propose(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ``drafts [B', k]`` int64 and ``confidences [B', k]`` fp32 for ``ctx.anchor_rows``."""
        raise NotImplementedError

    def enable_graphs(self, runner, max_rows: int) -> bool:
        """Offer a graph runner (the worker does when decode graphs are on): a drafter whose propose can be
        captured keeps it and returns True. Default: no graphs."""
        return False

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Reset per-slot drafter state for new sequences (``zero_states``)."""

    def clone_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy per-slot drafter state for forks (``clone_states``)."""
