"""Prefill policy (seed §5.2).

FIFO, first-scheduling checks, budgets, chunking, joint block + slot allocation.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.core.scheduler_driver import make_sched, snapshot, step_once

from deepinfer_npu import _core as C

PREFILL = C.StepKind.PREFILL


def prompt(n, start=1):
    return list(range(start, start + n))


def test_fifo_and_token_budget_without_chunking_others():
    s = make_sched(max_num_batched_tokens=250)
    for i in range(3):
        s.add_seq(i, prompt(100), 8)
    out = snapshot(s.schedule(True))
    # 100 + 100 fit; the third would need a chunk but a chunked request only runs alone.
    assert out["kind"] == PREFILL and list(out["seq_ids"]) == [0, 1]
    assert out["num_tokens"] == 200 and out["is_last_chunk"].all()
    assert list(out["seqlens_q"]) == [100, 100] and list(out["seqlens_k"]) == [100, 100]
    np.testing.assert_array_equal(out["input_ids"][:100], prompt(100))
    assert len(out["zero_states"]) == 2 and set(out["zero_states"]) == set(out["state_slots"])
    s.update(out["seq_ids"], [1, 1], [5, 5])
    out = snapshot(s.schedule(True))
    assert list(out["seq_ids"]) == [2]
    s.check_invariants()


def test_max_num_prompts():
    s = make_sched(max_num_prompts=2)
    for i in range(5):
        s.add_seq(i, prompt(4), 8)
    out = s.schedule(True)
    assert list(out.seq_ids) == [0, 1]


def test_prefill_max_sum_seqlen_k():
    s = make_sched(prefill_max_sum_seqlen_k=150, max_num_batched_tokens=512)
    s.add_seq(0, prompt(200), 8)  # the first sequence of a step is always admitted
    s.add_seq(1, prompt(100), 8)
    s.add_seq(2, prompt(40), 8)
    s.add_seq(3, prompt(40), 8)
    out = s.schedule(True)
    assert list(out.seq_ids) == [0]
    s.update(out.seq_ids, [1], [9])
    out = s.schedule(True)
    assert list(out.seq_ids) == [1, 2]  # 100 + 40 <= 150; + 40 would exceed it
    assert int(out.seqlens_k.sum()) <= 150


def test_chunked_request_runs_alone_then_joins_on_last_chunk():
    s = make_sched(max_num_batched_tokens=64)
    s.add_seq(0, prompt(150), 8)
    s.add_seq(1, prompt(10, 500), 8)
    steps = []
    for _ in range(3):
        out = snapshot(s.schedule(True))
        steps.append(out)
        s.update(out["seq_ids"], out["is_last_chunk"].astype(np.int32), [3] * int(out["is_last_chunk"].sum()))
        s.check_invariants()
    assert [list(x["seq_ids"]) for x in steps] == [[0], [0], [0, 1]]
    assert [list(x["seqlens_q"]) for x in steps] == [[64], [64], [22, 10]]
    assert [list(x["seqlens_k"]) for x in steps] == [[64], [128], [150, 10]]
    assert [list(x["is_last_chunk"]) for x in steps] == [[False], [False], [True, True]]
    np.testing.assert_array_equal(steps[1]["input_ids"], prompt(150)[64:128])
    # the chunked request keeps its state slot and blocks across chunks: zeroed once
    assert len(steps[0]["zero_states"]) == 1 and len(steps[1]["zero_states"]) == 0
    assert s.get_seq_status(0) == C.SeqStatus.PROMPTED


def test_chunk_in_flight_blocks_the_queue_until_updated():
    s = make_sched(max_num_batched_tokens=64)
    s.add_seq(0, prompt(100), 8)
    s.add_seq(1, prompt(5), 8)
    s.schedule(True)
    out = s.schedule(True)  # chunk of seq 0 not applied yet: FIFO waits, nothing overtakes
    assert out.num_seqs == 0 and out.kind == PREFILL


def test_chunk_alignment():
    s = make_sched(max_num_batched_tokens=50, chunk_alignment=16)
    s.add_seq(0, prompt(130), 8)
    ends = []
    while s.num_waiting:
        out = s.schedule(True)
        ends.append(int(out.seqlens_k[0]))
        s.update(out.seq_ids, out.is_last_chunk.astype(np.int32), [1] * int(out.is_last_chunk.sum()))
    assert ends == [48, 96, 130]  # chunk ends are multiples of 16 except the prompt end


def test_chunking_disabled_ignores_prompts_over_budget():
    s = make_sched(max_num_batched_tokens=64, enable_chunked_prefill=False)
    s.add_seq(0, prompt(100), 8)
    s.add_seq(1, prompt(60), 8)
    out = s.schedule(True)
    assert list(out.seq_ids) == [1]
    ((sid, status, reason),) = out.finished
    assert sid == 0 and status == C.SeqStatus.FINISHED_IGNORED
    assert "max_num_batched_tokens=64" in reason and "100" in reason


def test_ignored_too_long_names_the_limit():
    s = make_sched(max_model_len=64)
    s.add_seq(0, prompt(65), 8)
    s.add_seq(1, prompt(64), 8)
    out = s.schedule(True)
    assert list(out.seq_ids) == [1]
    ((sid, status, reason),) = out.finished
    assert sid == 0 and status == C.SeqStatus.FINISHED_IGNORED
    assert "max_model_len=64" in reason and "65" in reason
    assert s.get_seq_status(0) == C.SeqStatus.FINISHED_IGNORED
    s.check_invariants()


def test_ignored_when_pool_too_small():
    s = make_sched(num_kv_blocks=5, block_size=16, max_model_len=4096)
    s.add_seq(0, prompt(65), 8)  # 5 blocks > 4 allocatable
    out = s.schedule(True)
    ((sid, status, reason),) = out.finished
    assert (
        status == C.SeqStatus.FINISHED_IGNORED and "num_kv_blocks-1=4" in reason and "5 KV blocks" in reason
    )
    assert s.kv_block_manager.num_free == 4 and s.state_manager.num_free == s.config.num_state_slots - 1


def test_joint_allocation_waits_for_blocks_without_leaking_a_slot():
    s = make_sched(num_kv_blocks=5, block_size=16)
    s.add_seq(0, prompt(48), 8)  # 3 blocks
    s.add_seq(1, prompt(32), 8)  # 2 blocks: only 1 left
    out = s.schedule(True)
    assert list(out.seq_ids) == [0]
    s.update(out.seq_ids, [1], [1])
    slots_free = s.state_manager.num_free
    assert s.prefill_vote() == 0  # head not schedulable: no blocks
    out = s.schedule(True)
    assert out.num_seqs == 0 and s.state_manager.num_free == slots_free
    s.abort(0)
    out = s.schedule(True)
    assert list(out.seq_ids) == [1]


def test_joint_allocation_waits_for_a_state_slot():
    s = make_sched(max_num_seqs=2, state_slot_ratio=1.0)  # 2 usable slots
    for i in range(3):
        s.add_seq(i, prompt(4), 8)
    out = s.schedule(True)
    assert list(out.seq_ids) == [0, 1]
    s.update(out.seq_ids, [1, 1], [1, 1])
    assert s.state_manager.num_free == 0 and s.kv_block_manager.num_free > 10
    out = s.schedule(True)
    assert out.num_seqs == 0  # blocks are free but no slot: the request waits
    s.finish(0, C.SeqStatus.FINISHED_STOPPED)
    out = s.schedule(True)
    assert list(out.seq_ids) == [2]


def test_aborted_waiting_request_is_skipped():
    s = make_sched()
    for i in range(3):
        s.add_seq(i, prompt(4), 8)
    assert s.abort(1) and not s.abort(1) and not s.abort(99)
    out = s.schedule(True)
    assert list(out.seq_ids) == [0, 2]
    assert s.get_seq_status(1) == C.SeqStatus.FINISHED_ABORTED
    s.check_invariants()


def test_empty_prefill_has_no_side_effects():
    s = make_sched(num_kv_blocks=3, block_size=16)
    s.add_seq(0, prompt(32), 8)
    s.add_seq(1, prompt(32), 8)
    step_once(s, do_prefill=True)
    before = (s.kv_block_manager.free_list(), s.state_manager.free_list(), s.num_waiting, s.num_decode_steps)
    out = s.schedule(True)
    assert out.kind == PREFILL and out.num_seqs == 0 and out.finished == []
    assert (
        s.kv_block_manager.free_list(),
        s.state_manager.free_list(),
        s.num_waiting,
        s.num_decode_steps,
    ) == before


def test_add_seq_validation():
    s = make_sched()
    s.add_seq(0, [1, 2], 4)
    with pytest.raises(ValueError, match="already in use"):
        s.add_seq(0, [1], 4)
    with pytest.raises(ValueError, match="empty"):
        s.add_seq(1, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add_seq(1, [1], 0)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        s.add_seq(1, [1, -3], 4)
    with pytest.raises(TypeError, match="prompt_token_ids"):
        s.add_seq(1, [1.5, 2.0], 4)
    s.add_seq(2, np.array([3, 4], dtype=np.int64), 4)
    assert s.num_waiting == 2
