"""Reference ``zos_fixup`` op: correct an optimistically scheduled decode step on the device (seed §6.2, §7.2).

Under zero-overhead scheduling the CPU plans step N+1 before step N's accepted counts are known. For every row
that was planned optimistically it assumed all drafts of N were accepted, so on the device:

* ``seqlens_k -= correction[slot]`` where ``correction = drafts_N - accepted_N`` (written by N's verification);
* with varlen verification, the per-row draft counts are re-split with the freshest confidences (step N's, where
  the CPU only had N-1's): the CPU fixed ``total_q`` (it picks the graph); here every row keeps its golden token
  and the ``total_q - B`` draft slots go to the highest cumulative acceptance probabilities, each row capped at
  ``caps[i]`` drafts (its reservation), so each row verifies a prefix of its drafts.

Everything stays on the device: no host synchronisation.
"""

from __future__ import annotations

import torch


def zos_fixup(
    seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    optimistic: torch.Tensor,
    slots: torch.Tensor,
    correction: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    caps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqlens_q / seqlens_k / slots / caps [B]``, ``optimistic [B]`` bool, ``correction [S]``,
    ``draft_probs [S, k]`` or None (no re-split) -> corrected ``(seqlens_q, seqlens_k)`` int32."""
    seqlens_q = seqlens_q.to(torch.int64)
    seqlens_k = seqlens_k.to(torch.int64)
    fix = torch.where(optimistic, correction.index_select(0, slots).to(torch.int64), torch.zeros_like(seqlens_k))
    seqlens_k = seqlens_k - fix
    if draft_probs is not None and caps is not None:
        b = seqlens_q.shape[0]
        k = draft_probs.shape[1]
        # Only optimistic rows are re-split, among themselves: their drafts total stays fixed (so does total_q),
        # rows the CPU planned with exact knowledge keep its split.
        num_slots = torch.where(optimistic, seqlens_q - 1, torch.zeros_like(seqlens_q)).sum()  # device scalar
        cum = torch.cumprod(draft_probs.index_select(0, slots).float().clamp(0.0, 1.0), dim=1)
        cum = torch.nan_to_num(cum, nan=0.0)
        allowed = (torch.arange(k, device=cum.device)[None, :] < caps[:, None]) & optimistic[:, None]
        score = torch.where(allowed, cum, torch.full_like(cum, -1.0)).flatten()
        order = torch.argsort(score, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        chosen = (rank < num_slots) & (score >= 0)
        new_drafts = chosen.view(b, k).sum(dim=1)
        new_q = 1 + new_drafts
        seqlens_k = torch.where(optimistic, seqlens_k - seqlens_q + new_q, seqlens_k)
        seqlens_q = torch.where(optimistic, new_q, seqlens_q)
    return seqlens_q.to(torch.int32), seqlens_k.to(torch.int32)
