"""moe_lb and the merge of the ranks' expert-parallel reports into get_stats(); the move planning helpers."""

from __future__ import annotations

import pytest

from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.eplb.metrics import merge_ep_stats, moe_lb
from deepinfer_npu.eplb.weight_move import align, plan_moves


def test_moe_lb_is_the_slowest_rank_over_the_mean():
    assert moe_lb([30, 10, 20, 20]) == pytest.approx(1.5)
    assert moe_lb([5, 5]) == 1.0
    assert moe_lb([0, 0]) is None


def test_merge_takes_the_slowest_rank_pause_and_per_layer_balance():
    def rank(tokens, pauses):
        history = [{"step": 10 * (i + 1), "window_moe_lb": 2.0, "planned_moe_lb": 1.1, "moved_experts": 3}
                   for i in range(len(pauses))]
        return {"expert_parallel": {"rank_tokens": tokens, "eplb": {
            "replans": len(pauses), "steps": 25, "moved_experts": 6, "pause_ms": pauses, "history": history,
            "physical_experts": 10, "redundant_experts": 2}}}

    merged = merge_ep_stats([rank([30, 0], [5.0, 7.0]), rank([10, 0], [6.0, 2.0])])
    assert merged["moe_lb_per_layer"] == [pytest.approx(1.5), None]
    assert merged["moe_lb"] == pytest.approx(1.5)
    assert merged["moe_tokens_per_rank"] == [30, 10]
    eplb = merged["eplb"]
    assert eplb["replans"] == 2 and eplb["pause_ms_max"] == 7.0 and eplb["pause_ms_last"] == 7.0
    assert eplb["pause_ms_mean"] == pytest.approx(6.5)
    assert [h["pause_ms"] for h in eplb["history"]] == [6.0, 7.0]


def test_alignment_keeps_experts_in_place_and_the_per_rank_sets():
    old = ExpertPlacement(4, 2, (0, 1, 2, 3, 0, 1))  # rank 0: 0 1 2, rank 1: 3 0 1
    new_slots = [3, 1, 0, 2, 0, 1]  # rank 0 gets {3, 1, 0}, rank 1 gets {2, 0, 1}
    aligned = align(old, new_slots, ranks_per_node=2)
    # the list {2, 0, 1} shares three experts with rank 0's and goes there; rows keep what they hold
    assert aligned == [0, 1, 2, 3, 0, 1]
    assert plan_moves(old, ExpertPlacement(4, 2, tuple(aligned))) == []
    new = ExpertPlacement(4, 2, tuple(align(old, [3, 3, 0, 1, 2, 2], ranks_per_node=2)))
    moves = plan_moves(old, new)
    assert sorted(new.local_experts(0) + new.local_experts(1)) == [0, 1, 2, 2, 3, 3]
    assert all(old.local_experts(m.src_rank)[m.src_row] == new.local_experts(m.dst_rank)[m.dst_row] for m in moves)
