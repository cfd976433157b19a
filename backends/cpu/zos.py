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
        num_slots = seqlens_q.sum() - b  # a device scalar: total_q is fixed, only its split moves
        cum = torch.cumprod(draft_probs.index_select(0, slots).float(), dim=1)
        allowed = torch.arange(k, device=cum.device)[None, :] < caps[:, None]
        score = torch.where(allowed, cum, torch.full_like(cum, -1.0)).flatten()
        order = torch.argsort(score, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        chosen = (rank < num_slots) & (score >= 0)
        new_drafts = chosen.view(b, k).sum(dim=1)
        new_q = 1 + new_drafts
        resplit = optimistic
        seqlens_k = torch.where(resplit, seqlens_k - seqlens_q + new_q, seqlens_k)
        seqlens_q = torch.where(resplit, new_q, seqlens_q)
    return seqlens_q.to(torch.int32), seqlens_k.to(torch.int32)
