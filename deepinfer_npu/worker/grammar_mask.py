"""Structured output inside a step: the tokens each constrained row may sample, as a ban mask for ``spec_verify``.

The engine advances every request's grammar with the tokens of step N-1 before step N's sampling is launched (the
worker post-processes N-1 between N's forward and N's sampling, so under ZOS the bitmask is filled on the CPU while
the device runs N's forward). A decode row verifies drafts: position ``j`` is masked by the grammar state after the
row's first ``j`` drafts, which the host knows from the proposals copied with step N-1's results. Should a row's
actual draft differ from the one its next mask assumed (a fork's first step), that draft is banned at its position,
so it is rejected there and the mask after it is never used: masks can cost acceptance, never validity.
Unconstrained rows are untouched; a batch without grammars builds nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from deepinfer_npu.structured_output.matcher import allowed_mask, fill_rows, new_bitmask

ToDevice = Callable[..., torch.Tensor]


def merge(ban: torch.Tensor | None, extra: torch.Tensor | None) -> torch.Tensor | None:
    if extra is None:
        return ban
    return extra if ban is None else ban | extra


def prefill_banned(grammars: list, sample_rows: np.ndarray, vocab: int, to_device: ToDevice) -> torch.Tensor | None:
    """``[m, vocab]`` banned tokens of the prompt-end samples (``sample_rows[s]``: the plan row of sample ``s``)."""
    constrained = [s for s, i in enumerate(sample_rows.tolist()) if grammars[i] is not None]
    if not constrained:
        return None
    bitmask = new_bitmask(len(sample_rows), vocab)  # all allowed
    fill_rows([grammars[int(sample_rows[s])] for s in constrained], bitmask, constrained)
    return ~allowed_mask(to_device(bitmask.numpy(), torch.int32), vocab)


def decode_banned(grammars: list, num_rows: int, max_q: int, row: torch.Tensor, j: torch.Tensor,
                  draft_next: torch.Tensor, vocab: int, to_device: ToDevice) -> torch.Tensor | None:
    """``[T, vocab]`` banned tokens of a decode step's token rows (``row`` / ``j``: each token's plan row and
    position in it; ``draft_next``: the draft each token is checked against, -1 for none)."""
    constrained = [i for i in range(num_rows) if grammars[i] is not None]
    if not constrained:
        return None
    c = len(constrained)
    if max_q == 1:  # no drafts: one mask row per constrained row
        bitmask = new_bitmask(c, vocab)
        fill_rows([grammars[i] for i in constrained], bitmask, list(range(c)))
        row_to_c = np.full(num_rows, -1, dtype=np.int64)
        row_to_c[constrained] = np.arange(c)
        banned = ~allowed_mask(to_device(bitmask.numpy(), torch.int32), vocab)
        sel = to_device(row_to_c).index_select(0, row)
        return banned.index_select(0, sel.clamp(min=0)) & (sel >= 0)[:, None]
    bitmask = new_bitmask(c * max_q, vocab)
    words = bitmask.numpy()  # a view: rows are cleared without tensor indexing
    assumed = np.full((c, max_q), -1, dtype=np.int64)
    row_to_c = np.full(num_rows, -1, dtype=np.int64)
    drafts = []
    for r, i in enumerate(constrained):
        g = grammars[i]
        d = [] if g.drafts is None else [int(x) for x in g.drafts[: max_q - 1]]
        words[r * max_q + len(d) + 1: (r + 1) * max_q] = 0  # past the known drafts: never reached
        assumed[r, : len(d)] = d
        row_to_c[i] = r
        drafts.append(d)
    fill_rows([grammars[i] for i in constrained], bitmask, [r * max_q for r in range(c)], drafts)
    allowed = allowed_mask(to_device(words, torch.int32), vocab)
    sel = to_device(row_to_c).index_select(0, row)
    is_constrained = sel >= 0
    flat = sel.clamp(min=0) * max_q + j
    banned = ~allowed.index_select(0, flat) & is_constrained[:, None]
    assumed_next = to_device(assumed.reshape(-1)).index_select(0, flat)
    mismatch = is_constrained & (draft_next >= 0) & (draft_next != assumed_next)
    reject = torch.zeros_like(banned).scatter_(1, draft_next.clamp(min=0)[:, None], mismatch[:, None])
    return banned | reject
