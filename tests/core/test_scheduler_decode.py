"""Decode policy (seed §5.3), the vote (§5.1), fork copy-on-write (§5.4), ZOS optimistic scheduling (§6.2) and
update semantics."""

from __future__ import annotations

import numpy as np
import pytest
from tests.core.scheduler_driver import make_sched, prefill_all, snapshot, step_once

from deepinfer_npu import _core as C

DECODE = C.StepKind.DECODE


def prompt(n, start=1):
    return list(range(start, start + n))


def decode(s, accepted=None):
    out = snapshot(s.schedule(False))
    if out["num_seqs"]:
        counts = [
            (d if accepted is None else accepted(int(i), int(d))) + 1
            for i, d in zip(out["seq_ids"], out["num_drafts"])
        ]
        s.update(out["seq_ids"], np.array(counts, np.int32), np.full(sum(counts), 3, np.int32))
    return out


# ---------------------------------------------------------------------------------------------- vote


def test_vote_forces_prefill_when_nothing_runs():
    s = make_sched()
    assert s.prefill_vote() == 0  # nothing waiting
    s.add_seq(0, prompt(4), 8)
    assert s.prefill_vote() == -1


@pytest.mark.parametrize("all_every,any_every", [(70, 100), (7, 10)])
def test_vote_attempt_points(all_every, any_every):
    s = make_sched(
        prefill_attempt_interval=all_every, prefill_any_attempt_interval=any_every, num_kv_blocks=512
    )
    s.add_seq(0, prompt(4), 10_000 if all_every == 70 else 100)
    prefill_all(s)
    s.add_seq(1, prompt(4), 8)  # waiting and schedulable from now on
    horizon = 2 * any_every + 15
    for _ in range(horizon):
        c = s.num_decode_steps
        expected = -1 if c % any_every == 0 else (1 if c % all_every == 0 else 0)
        assert s.prefill_vote() == expected, c
        decode(s)  # the test never prefills, so the head stays waiting
    assert s.num_decode_steps == horizon


def test_restarting_the_attempt_points_counts_them_from_the_current_decode_step():
    s = make_sched(prefill_attempt_interval=7, prefill_any_attempt_interval=10, num_kv_blocks=512)
    s.add_seq(0, prompt(4), 100)
    prefill_all(s)
    s.add_seq(1, prompt(4), 8)
    for _ in range(3):
        decode(s)
    assert s.prefill_vote() == 0  # 3 decode steps: no point
    s.restart_attempt_points()
    assert s.prefill_vote() == -1  # a restart is both kinds of point
    for step in range(1, 11):
        decode(s)
        assert s.prefill_vote() == {7: 1, 10: -1}.get(step, 0), step
    assert s.num_decode_steps == 13  # the restart moves the points, not the count


def test_vote_respects_kv_usage_threshold():
    s = make_sched(num_kv_blocks=11, block_size=16, prefill_kv_usage_threshold=0.5)
    s.add_seq(0, prompt(96), 64)  # 6 of 10 blocks
    prefill_all(s)
    s.add_seq(1, prompt(4), 8)
    assert s.num_decode_steps == 0 and s.kv_usage() > 0.5
    assert s.prefill_vote() == 0  # at an attempt point, but usage is above the threshold


def test_step_kind_never_mixed():
    s = make_sched()
    s.add_seq(0, prompt(4), 8)
    prefill_all(s)
    s.add_seq(1, prompt(4), 8)
    out = s.schedule(False)
    assert out.kind == DECODE and list(out.seq_ids) == [0]  # the waiting request is not mixed in
    assert s.schedule(True).kind == C.StepKind.PREFILL


def test_empty_decode_kind():
    s = make_sched()
    out = s.schedule(False)
    assert out.kind == C.StepKind.EMPTY and out.num_seqs == 0


# ---------------------------------------------------------------------------------------------- selection


def test_decode_budget_max_num_seqs_and_tokens():
    s = make_sched(max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(3):
        s.add_seq(i, prompt(4), 100)
    prefill_all(s)
    for i in range(3):
        s.fork_seq(0, 10 + i)
    out = s.schedule(False)
    assert out.num_seqs == 3
    s2 = make_sched(max_num_seqs=8, max_num_batched_tokens=10, nextn=4)
    for i in range(4):
        s2.add_seq(i, prompt(2), 100)
    prefill_all(s2)
    out = s2.schedule(False)
    assert out.num_seqs == 4 and out.num_tokens <= 10
    assert list(out.num_drafts) == [2, 2, 1, 1]  # uniform level 1, leftover given in order
    assert list(out.seqlens_q) == [d + 1 for d in out.num_drafts]


def test_selection_from_shortest_output_end():
    s = make_sched(max_num_batched_tokens=2, max_num_seqs=8)
    s.add_seq(0, [1, 2], 100)
    prefill_all(s)
    for _ in range(5):
        decode(s)
    s.add_seq(1, [1, 2], 100)
    s.add_seq(2, [1, 2], 100)
    prefill_all(s)
    out = s.schedule(False)  # 2-token budget: two of three sequences, the shortest outputs
    assert sorted(out.seq_ids) == [1, 2]


def test_final_sort_by_total_length():
    s = make_sched()
    s.add_seq(0, prompt(3), 100)
    s.add_seq(1, prompt(30), 100)
    s.add_seq(2, prompt(10), 100)
    prefill_all(s)
    out = s.schedule(False)
    assert list(out.seq_ids) == [1, 2, 0]
    assert list(out.seqlens_k) == [31, 11, 4]


def test_forced_preemption_finishes_longest_output():
    s = make_sched(num_kv_blocks=9, block_size=4, max_num_seqs=4, max_model_len=256)
    s.add_seq(0, prompt(4), 200)
    prefill_all(s)
    for _ in range(4):
        decode(s)  # seq 0 has the longest output
    for i in (1, 2):
        s.add_seq(i, prompt(4), 200)
    prefill_all(s)
    finished = []
    for _ in range(40):
        out = decode(s)
        finished += out["finished"]
        s.check_invariants()
        if finished:
            break
    assert s.num_preemptions > 0
    sid, status, reason = finished[0]
    assert sid == 0 and status == C.SeqStatus.FINISHED_PREEMPTED
    assert "preempted" in reason and "KV cache" in reason
    assert s.get_seq_status(0) == C.SeqStatus.FINISHED_PREEMPTED


def test_preemption_recompute_goes_to_waiting_front():
    s = make_sched(
        num_kv_blocks=9, block_size=4, max_num_seqs=4, max_model_len=256, stop_preempted_request=False
    )
    s.add_seq(0, prompt(4), 200)
    prefill_all(s)
    for _ in range(4):
        decode(s)
    s.add_seq(1, prompt(4), 200)
    prefill_all(s)
    s.add_seq(2, prompt(30, 100), 200)  # waits: needs more blocks than are left
    for _ in range(40):
        out = decode(s)
        s.check_invariants()
        if s.num_preemptions:
            break
    assert s.num_preemptions > 0 and out["finished"] == []
    info = s.seq_info(0)
    assert info["status"] == C.SeqStatus.WAITING
    assert info["block_table"] == [] and info["state_slot"] == 0 and info["num_computed_tokens"] == 0
    assert info["tokens"][:4] == prompt(4) and len(info["tokens"]) > 4  # outputs kept, recomputed as prompt
    assert info["num_prompt_tokens"] == 4
    # seq 0 is at the front of waiting, ahead of seq 2 that arrived earlier
    s.abort(1)
    out = s.schedule(True)
    assert list(out.seq_ids)[0] == 0
    assert out.seqlens_q[0] == len(info["tokens"])


def test_recompute_preemption_while_in_flight_appends_only():
    s = make_sched(num_kv_blocks=5, block_size=4, max_num_seqs=4, stop_preempted_request=False)
    s.add_seq(0, prompt(4), 200)
    s.add_seq(1, prompt(4), 200)
    prefill_all(s)
    first = snapshot(s.schedule(False))  # in flight
    for _ in range(8):
        o = s.schedule(False)  # ZOS: keep scheduling without update until preemption
        if s.num_preemptions:
            break
        s.update(first["seq_ids"], [1] * first["num_seqs"], [5] * first["num_seqs"])
        first = snapshot(o)
    assert s.num_preemptions
    victim = next(i for i in (0, 1) if s.get_seq_status(i) == C.SeqStatus.WAITING)
    before = s.seq_info(victim)["tokens"]
    s.update(first["seq_ids"], [1] * first["num_seqs"], [9] * first["num_seqs"])
    info = s.seq_info(victim)
    assert info["tokens"] == before + [9] and info["num_computed_tokens"] == 0
    s.check_invariants()


def test_drafts_capped_by_max_new_tokens_and_max_model_len():
    s = make_sched(nextn=4, max_model_len=12)
    s.add_seq(0, prompt(4), 3)  # 1 output after prefill, 2 more allowed
    s.add_seq(1, prompt(9), 100)  # len 10 after prefill, max_model_len 12
    prefill_all(s)
    out = snapshot(s.schedule(False))
    drafts = dict(zip(out["seq_ids"].tolist(), out["num_drafts"].tolist()))
    assert drafts == {0: 1, 1: 1}
    s.update(out["seq_ids"], [2, 2], [1, 1, 1, 1])
    out = s.schedule(False)  # both reached their limits: nothing to decode until Python finishes them
    assert out.num_seqs == 0
    assert s.seq_info(0)["tokens"].__len__() - 4 == 3 and len(s.seq_info(1)["tokens"]) == 12


# ---------------------------------------------------------------------------------------------- fork


def test_fork_copy_on_write_partial_block():
    s = make_sched(block_size=16)
    s.add_seq(0, prompt(20), 50)
    prefill_all(s)
    p = s.seq_info(0)
    s.fork_seq(0, 1)
    c = s.seq_info(1)
    assert c["status"] == C.SeqStatus.PROMPTED and c["needs_cow"]
    assert c["block_table"] == p["block_table"] and c["state_slot"] == p["state_slot"]
    assert all(s.kv_block_manager.ref_count(b) == 2 for b in p["block_table"])
    assert s.state_manager.ref_count(p["state_slot"]) == 2
    out = snapshot(s.schedule(False))
    c2, p2 = s.seq_info(1), s.seq_info(0)
    assert out["clone_blocks"].tolist() == [[p["block_table"][1], c2["block_table"][1]]]
    assert out["clone_states"].tolist() == [[p["state_slot"], c2["state_slot"]]]
    assert c2["block_table"][0] == p2["block_table"][0] and c2["block_table"][1] != p2["block_table"][1]
    assert c2["state_slot"] != p2["state_slot"]
    assert s.kv_block_manager.ref_count(p["block_table"][0]) == 2
    assert s.kv_block_manager.ref_count(p["block_table"][1]) == 1
    assert s.state_manager.ref_count(p["state_slot"]) == 1
    assert len(out["zero_states"]) == 0
    s.check_invariants()


def test_fork_full_last_block_clones_state_only():
    s = make_sched(block_size=16)
    s.add_seq(0, prompt(32), 50)
    prefill_all(s)
    s.fork_seq(0, 1)
    out = s.schedule(False)
    assert out.clone_blocks.shape == (0, 2) and out.clone_states.shape == (1, 2)
    s.check_invariants()


def test_fork_parent_finishes_first_keeps_shared_blocks():
    s = make_sched(block_size=16)
    s.add_seq(0, prompt(20), 50)
    prefill_all(s)
    s.fork_seq(0, 1)
    s.fork_seq(0, 2)
    s.finish(0, C.SeqStatus.FINISHED_STOPPED)
    s.check_invariants()
    out = s.schedule(False)
    assert sorted(out.seq_ids) == [1, 2] and out.clone_blocks.shape == (2, 2)
    s.check_invariants()
    s.abort(1)
    s.abort(2)
    assert s.kv_block_manager.num_free == s.kv_block_manager.num_allocatable
    assert s.state_manager.num_free == s.state_manager.num_allocatable


def test_fork_errors():
    s = make_sched()
    s.add_seq(0, prompt(4), 8)
    with pytest.raises(ValueError, match="PROMPTED or RUNNING"):
        s.fork_seq(0, 1)
    with pytest.raises(ValueError, match="unknown"):
        s.fork_seq(7, 1)
    prefill_all(s)
    with pytest.raises(ValueError, match="in use"):
        s.fork_seq(0, 0)


# ---------------------------------------------------------------------------------------------- ZOS + update


def test_zos_optimistic_reservation_and_remap():
    s = make_sched(nextn=2, block_size=4)
    s.add_seq(0, prompt(6), 100)
    s.add_seq(1, prompt(3), 100)
    prefill_all(s)
    a = snapshot(s.schedule(False))
    assert list(a["seq_ids"]) == [0, 1] and list(a["seqlens_k"]) == [7 + 2, 4 + 2]
    assert a["input_ids"].tolist() == [7, -1, -1, 7, -1, -1]  # last committed token, drafts from device
    assert list(a["prev_remap"]) == [-1, -1] and not a["remap_identical"]
    b = snapshot(s.schedule(False))  # step a still in flight
    # optimistic: len + d_prev + q_len
    assert list(b["seqlens_k"]) == [7 + 2 + 3, 4 + 2 + 3]
    assert b["input_ids"].tolist() == [-1] * 6
    assert list(b["prev_remap"]) == [0, 1] and b["remap_identical"]
    for sid in (0, 1):  # blocks cover tokens + two reservations of nextn + 1
        info = s.seq_info(sid)
        assert len(info["block_table"]) * 4 >= len(info["tokens"]) - 1 + 2 * 3
        assert info["num_inflight"] == 2
    s.check_invariants()
    s.update(a["seq_ids"], [1, 3], [11, 21, 22, 23])  # seq 0 accepted 0 drafts, seq 1 all 2
    assert s.seq_info(0)["tokens"][-1] == 11 and s.seq_info(0)["num_computed_tokens"] == 7
    assert s.seq_info(1)["tokens"][-3:] == [21, 22, 23] and s.seq_info(1)["num_computed_tokens"] == 6
    s.check_invariants()
    c = snapshot(s.schedule(False))  # after update(a), b in flight
    assert list(c["prev_remap"]) == [0, 1]
    assert c["seqlens_k"].tolist() == [8 + 2 + 3, 7 + 2 + 3]
    s.update(b["seq_ids"], [3, 1], [1, 2, 3, 4])
    s.update(c["seq_ids"], [1, 1], [1, 2])
    d = snapshot(s.schedule(False))  # nothing in flight: inputs from the CPU, remap -1
    assert list(d["prev_remap"]) == [-1, -1] and d["input_ids"][0] == 1
    s.check_invariants()


def test_prepare_zos_inputs_function():
    remap, same = C.prepare_zos_inputs(np.array([5, 6, 7]), np.array([5, 6, 7]))
    assert same and remap.tolist() == [0, 1, 2] and remap.dtype == np.int32
    remap, same = C.prepare_zos_inputs([5, 6, 7], [7, 9, 5, 6])
    assert not same and remap.tolist() == [2, -1, 0, 1]
    remap, same = C.prepare_zos_inputs([], [1])
    assert remap.tolist() == [-1] and not same


def test_update_variable_accepted_counts_and_validation():
    s = make_sched(nextn=3)
    for i in range(3):
        s.add_seq(i, prompt(5), 100)
    prefill_all(s)
    out = snapshot(s.schedule(False))
    assert list(out["num_drafts"]) == [3, 3, 3]
    ids = out["seq_ids"]
    with pytest.raises(ValueError, match="1..4"):
        s.update(ids, [1, 5, 1], [0] * 7)
    with pytest.raises(ValueError, match="1..4"):
        s.update(ids, [0, 1, 1], [0] * 2)
    with pytest.raises(ValueError, match="sums to"):
        s.update(ids, [1, 1, 1], [0] * 4)
    with pytest.raises(ValueError, match="twice"):
        s.update([ids[0], ids[0]], [1, 1], [0, 0])
    s.check_invariants()  # failed calls changed nothing
    s.update(ids, [1, 4, 2], [10, 20, 21, 22, 23, 30, 31])
    lens = {i: len(s.seq_info(i)["tokens"]) for i in range(3)}
    assert lens == {int(ids[0]): 7, int(ids[1]): 10, int(ids[2]): 8}
    for i in range(3):
        info = s.seq_info(i)
        assert info["num_computed_tokens"] == len(info["tokens"]) - 1 and info["num_inflight"] == 0
    with pytest.raises(ValueError, match="no step in flight"):
        s.update([0], [1], [1])
    s.update([12345], [2], [1, 2])  # unknown ids are ignored
    s.check_invariants()


def test_finish_and_abort_in_flight():
    s = make_sched()
    s.add_seq(0, prompt(4), 100)
    s.add_seq(1, prompt(4), 100)
    prefill_all(s)
    out = snapshot(s.schedule(False))
    assert s.abort(0)
    assert s.finish(1, C.SeqStatus.FINISHED_LENGTH) and not s.finish(1, C.SeqStatus.FINISHED_STOPPED)
    with pytest.raises(ValueError, match="FINISHED_STOPPED or FINISHED_LENGTH"):
        s.finish(0, C.SeqStatus.FINISHED_PREEMPTED)
    s.update(out["seq_ids"], [1, 1], [1, 1])  # results of finished sequences are ignored
    assert s.get_seq_status(1) == C.SeqStatus.FINISHED_LENGTH and not s.has_unfinished()
    assert s.kv_block_manager.num_free == s.kv_block_manager.num_allocatable
    assert s.schedule(False).num_seqs == 0
    with pytest.raises(KeyError):
        s.get_seq_status(777)


def test_run_to_completion_frees_everything():
    s = make_sched(nextn=2, num_kv_blocks=40, block_size=4, stop_preempted_request=False, max_num_seqs=6)
    rng = np.random.default_rng(0)
    want = {}
    for i in range(20):
        s.add_seq(i, list(rng.integers(1, 100, rng.integers(1, 30))), int(rng.integers(1, 40)))
        want[i] = s.seq_info(i)["max_new_tokens"]
    for _ in range(3000):
        if not s.has_unfinished():
            break
        step_once(s, accepted=lambda sid, d: int(rng.integers(0, d + 1)))
        for i in list(want):
            try:
                info = s.seq_info(i)
            except KeyError:
                want.pop(i)
                continue
            if len(info["tokens"]) - info["num_prompt_tokens"] >= want[i] and info["num_inflight"] == 0:
                assert (
                    len(info["tokens"]) - info["num_prompt_tokens"] == want[i]
                )  # never beyond max_new_tokens
                s.finish(i, C.SeqStatus.FINISHED_LENGTH)
        s.check_invariants()
    assert not s.has_unfinished()
    assert s.kv_block_manager.num_free == s.kv_block_manager.num_allocatable
    assert s.state_manager.num_free == s.state_manager.num_allocatable
