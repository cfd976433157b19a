"""Every data-parallel rank runs the same step kind and the same padded size: the two-round vote.

Round one: each rank's scheduler votes (``Scheduler.prefill_vote``: -1 = prefill now, ANY point or nothing
running; 1 = prefill at an ALL point; 0 = no) and an all-reduce MIN over the CPU group decides: any -1 forces a
prefill step, otherwise every rank must say 1. Round two: after scheduling, an all-reduce MAX asks whether any
rank actually scheduled a prompt; if none did, every rank schedules decode instead, so a vote can never lock the
deployment into empty prefill steps. The padded size every rank runs is the MAX of their token counts, so
collectives and captured graphs line up; a rank with no work runs an empty step of the agreed kind. Round one also
says whether the whole group was idle (no rank had a sequence running): every rank then restarts its attempt points
at once, so the counters that place them stay equal across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepAgreement:
    """What the ranks agreed on for one step."""

    prefill: bool  # the step kind
    max_num_tokens: int  # the largest step any rank runs (pad to it for EP collectives and graphs)
    any_work: bool  # False: no rank has anything to run (every rank may idle)


def _all_reduce(values: list[int], op: dist.ReduceOp, group: dist.ProcessGroup | None) -> list[int]:
    # gloo CPU tensors: the vote never touches the device.
    t = torch.tensor(values, dtype=torch.int64)
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t.tolist()


@dataclass(frozen=True)
class PrefillVote:
    """Round one's outcome."""

    prefill: bool  # the step kind, before round two
    group_idle: bool  # no rank had a sequence running or prompted


def vote_prefill(local_vote: int, idle: bool, group: dist.ProcessGroup | None) -> PrefillVote:
    """Round one: all-reduce MIN of the schedulers' votes (and of the ranks' idle flags)."""
    if local_vote not in (-1, 0, 1):
        raise ValueError(f"prefill vote must be -1, 0 or 1, got {local_vote}")
    agreed, all_idle = _all_reduce([local_vote, int(idle)], dist.ReduceOp.MIN, group)
    return PrefillVote(prefill=agreed != 0, group_idle=bool(all_idle))


def confirm_step(prefill: bool, scheduled_prompts: int, num_tokens: int,
                 group: dist.ProcessGroup | None) -> StepAgreement:
    """Round two: did any rank schedule a prompt (for a prefill step), and how large is the largest step."""
    any_prompt, max_tokens = _all_reduce([int(prefill and scheduled_prompts > 0), num_tokens],
                                         dist.ReduceOp.MAX, group)
    if prefill and not any_prompt:
        return StepAgreement(prefill=False, max_num_tokens=0, any_work=False)
    return StepAgreement(prefill=prefill, max_num_tokens=max_tokens, any_work=max_tokens > 0)


def agree_decode_size(num_tokens: int, group: dist.ProcessGroup | None) -> int:
    """The decode step size every rank pads to (the group's largest ``total_q``)."""
    (agreed,) = _all_reduce([num_tokens], dist.ReduceOp.MAX, group)
    return agreed
