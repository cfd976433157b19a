"""Scheduler configs for the C++ core tests and a tiny fake engine that drives a Scheduler step by step."""

from __future__ import annotations

import numpy as np

from deepinfer_npu import _core as C


def make_cfg(**kw) -> C.SchedulerConfig:
    base = dict(
        max_model_len=512, num_kv_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256
    )
    base.update(kw)
    return C.SchedulerConfig(**base)


def make_sched(**kw) -> C.Scheduler:
    return C.Scheduler(make_cfg(**kw))


def snapshot(out) -> dict:
    """Copy a ScheduleOutput (its arrays are only valid until the next schedule())."""
    return {
        "kind": out.kind,
        "num_seqs": out.num_seqs,
        "num_tokens": out.num_tokens,
        "seq_ids": out.seq_ids.copy(),
        "seqlens_q": out.seqlens_q.copy(),
        "seqlens_k": out.seqlens_k.copy(),
        "num_drafts": out.num_drafts.copy(),
        "is_last_chunk": out.is_last_chunk.copy(),
        "input_ids": out.input_ids.copy(),
        "block_tables": out.block_tables.copy(),
        "state_slots": out.state_slots.copy(),
        "clone_blocks": out.clone_blocks.copy(),
        "clone_states": out.clone_states.copy(),
        "zero_states": out.zero_states.copy(),
        "prev_remap": out.prev_remap.copy(),
        "remap_identical": out.remap_identical,
        "finished": list(out.finished),
    }


def results_for(step: dict, accepted=None, token: int = 7):
    """(seq_ids, num_new_tokens, new_token_ids) for a step.

    Prefill: 1 token on the last chunk; decode: a + 1 tokens, a = accepted(seq_id, num_drafts) (default all).
    """
    ids = step["seq_ids"]
    if step["kind"] == C.StepKind.PREFILL:
        counts = step["is_last_chunk"].astype(np.int32)
    else:
        counts = np.array(
            [
                (d if accepted is None else accepted(int(i), int(d))) + 1
                for i, d in zip(ids, step["num_drafts"])
            ],
            dtype=np.int32,
        )
    toks = np.full(int(counts.sum()), token, dtype=np.int32)
    return ids, counts, toks


def step_once(s: C.Scheduler, accepted=None, use_vote: bool = True, do_prefill: bool | None = None) -> dict:
    """One synchronous engine step (vote, schedule, round two, update). Returns the snapshot."""
    if do_prefill is None:
        do_prefill = s.prefill_vote() != 0 if use_vote else False
    out = s.schedule(do_prefill)
    if do_prefill and out.num_seqs == 0:
        finished = list(out.finished)
        out = s.schedule(False)
        snap = snapshot(out)
        snap["finished"] = finished + snap["finished"]
    else:
        snap = snapshot(out)
    if snap["num_seqs"]:
        s.update(*results_for(snap, accepted))
    return snap


def prefill_all(s: C.Scheduler, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if s.num_waiting == 0:
            return
        snap = step_once(s, do_prefill=True)
        if snap["kind"] != C.StepKind.PREFILL:
            return
