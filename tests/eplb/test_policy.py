"""The placement policy on random loads: every expert keeps a replica, slot counts are exact, the plan is never
less balanced than the policy's packing without replicas, and it is deterministic; plus worked examples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_npu.eplb.policy import (balanced_packing, device_loads, num_redundant_experts, rebalance_experts,
                                       replicate)


@st.composite
def problems(draw):
    num_nodes = draw(st.sampled_from([1, 1, 2, 4]))
    devices_per_node = draw(st.integers(1, 3))
    num_devices = num_nodes * devices_per_node
    num_groups = draw(st.sampled_from([1, 2, 4, 8]))
    group_size = draw(st.integers(1, 4))
    num_logical = num_groups * group_size
    redundant = num_redundant_experts(num_logical, num_devices, draw(st.integers(0, 2)) * num_devices)
    layers = draw(st.integers(1, 3))
    loads = draw(st.lists(st.integers(0, 1000), min_size=layers * num_logical, max_size=layers * num_logical))
    weight = torch.tensor(loads, dtype=torch.float64).view(layers, num_logical)
    return weight, num_logical + redundant, num_groups, num_nodes, num_devices


@settings(max_examples=150, deadline=None)
@given(problems())
def test_plan_properties(problem):
    weight, num_slots, num_groups, num_nodes, num_devices = problem
    num_layers, num_logical = weight.shape
    plan = rebalance_experts(weight, num_slots, num_groups, num_nodes, num_devices)
    assert plan.shape == (num_layers, num_slots) and plan.dtype == torch.int64
    assert num_slots % num_devices == 0
    for layer in range(num_layers):
        held = torch.bincount(plan[layer], minlength=num_logical)
        assert held.numel() == num_logical and bool((held >= 1).all()), "an expert lost its last replica"
        assert int(held.sum()) == num_slots
    if num_logical % num_devices == 0:  # a placement without replicas exists: never worse than the policy's own
        single = rebalance_experts(weight, num_logical, num_groups, num_nodes, num_devices)
        worst = device_loads(weight, plan, num_devices).amax(-1)
        assert bool((worst <= device_loads(weight, single, num_devices).amax(-1) + 1e-9).all())
    assert torch.equal(plan, rebalance_experts(weight, num_slots, num_groups, num_nodes, num_devices))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.integers(1, 16), st.integers(0, 64))
def test_redundant_count_is_the_smallest_that_divides(num_logical, ep_size, floor):
    count = num_redundant_experts(num_logical, ep_size, floor)
    assert count >= floor and (num_logical + count) % ep_size == 0
    assert all((num_logical + c) % ep_size for c in range(floor, count))


def test_groups_stay_on_their_node():
    # 4 groups of 2 experts, 2 nodes of 2 devices: a node's slots hold only the experts of its own two groups
    weight = torch.tensor([[9.0, 1, 8, 2, 7, 3, 6, 4]])
    plan = rebalance_experts(weight, 12, num_groups=4, num_nodes=2, num_devices=4)
    for node in plan.view(2, 6).tolist():
        assert len({e // 2 for e in node}) == 2


def test_hot_experts_get_the_replicas_and_balance_improves():
    weight = (1.0 / torch.arange(1, 9, dtype=torch.float64)).unsqueeze(0)  # Zipf over 8 experts
    contiguous = torch.arange(8).unsqueeze(0)
    plan = rebalance_experts(weight, 12, num_groups=2, num_nodes=1, num_devices=4)
    counts = torch.bincount(plan[0], minlength=8)
    assert counts[0] == counts.max() and counts[0] >= 2
    before = device_loads(weight, contiguous, 4)
    after = device_loads(weight, plan, 4)
    assert float(before.max() / before.mean()) > 1.6
    assert float(after.max() / after.mean()) < 1.06


def test_global_policy_when_groups_do_not_divide_over_nodes():
    weight = torch.rand(2, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plan = rebalance_experts(weight, 8, num_groups=3, num_nodes=2, num_devices=4)  # 3 groups, 2 nodes
    assert torch.equal(plan, rebalance_experts(weight, 8, num_groups=1, num_nodes=1, num_devices=4))


def test_packing_and_replication_primitives():
    pack = balanced_packing(torch.tensor([[5.0, 4, 3, 3]]), 2)
    assert sorted(pack[0].tolist()) == [0, 0, 1, 1]
    assert float(torch.tensor([5.0, 4, 3, 3])[pack[0] == pack[0, 0]].sum()) == 8.0
    slots, count = replicate(torch.tensor([[6.0, 3, 1]]), 5)
    assert slots[0].tolist() == [0, 1, 2, 0, 0] and count[0].tolist() == [3, 1, 1]


@pytest.mark.parametrize("args,match", [
    ((torch.ones(1, 8), 10, 1, 1, 4), "divisible by num_devices"),
    ((torch.ones(1, 8), 6, 1, 1, 2), "must be >= the 8 experts"),
    ((-torch.ones(1, 8), 8, 1, 1, 2), "non-negative"),
    ((torch.ones(8), 8, 1, 1, 2), r"\[layers, experts\]"),
    ((torch.ones(1, 9), 9, 1, 2, 3), "not divisible by num_nodes"),
])
def test_bad_inputs_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(*args)
