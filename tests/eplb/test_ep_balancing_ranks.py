"""Expert-parallel load balancing across 3 spawned gloo ranks (one job, several checks):

- weights move between ranks to any new placement (random placements; rows identify their expert);
- a MoE layer with redundant experts counts the tokens each of its slots received on the device (the local
  dispatch op's counts: the CPU reference and the Ascend ops under contract emulation), and its output equals
  the single-process layer's;
- a re-plan from skewed counts moves the weights, installs the new placement, and the layer's output is unchanged.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_npu.config import EPLBConfig
from deepinfer_npu.distributed.ep_moe import SINCE_PLAN, WINDOW, EPGroup
from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.distributed.parallel_state import (DistributedConfig, destroy_process_groups,
                                                      init_process_groups, set_expert_parallel)
from deepinfer_npu.eplb.balancer import ExpertBalancer, initial_placement
from deepinfer_npu.eplb.weight_move import align, apply_moves, plan_moves
from deepinfer_npu.model_executor.layers.moe import DeepseekMoE
from deepinfer_npu.model_executor.model_config import DeepseekModelConfig
from tests.distributed.rank_exit import leave_rank

WORLD, EXPERTS = 3, 8


def _cfg() -> DeepseekModelConfig:
    return DeepseekModelConfig.from_dict(dict(
        hidden_size=32, moe_intermediate_size=16, intermediate_size=64, n_routed_experts=EXPERTS,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, vocab_size=64, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=None, first_k_dense_replace=1,
        model_type="deepseek_v3", scoring_func="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1))


def _check_random_moves(rank: int, group) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        slots = 12
        old = ExpertPlacement(EXPERTS, WORLD, tuple(torch.cat((torch.arange(EXPERTS), torch.randint(
            0, EXPERTS, (slots - EXPERTS,), generator=gen)))[torch.randperm(slots, generator=gen)].tolist()))
        new_slots = torch.cat((torch.arange(EXPERTS), torch.randint(0, EXPERTS, (slots - EXPERTS,), generator=gen)))
        new = ExpertPlacement(EXPERTS, WORLD, tuple(new_slots[torch.randperm(slots, generator=gen)].tolist()))
        new = ExpertPlacement(EXPERTS, WORLD, tuple(align(old, list(new.slot_to_logical), WORLD)))
        w = torch.tensor(old.local_experts(rank), dtype=torch.float32).view(-1, 1, 1).expand(-1, 3, 2).contiguous()
        v = w[:, :1, :].clone() * 10
        apply_moves([w, v], plan_moves(old, new), rank, WORLD, group)
        want = torch.tensor(new.local_experts(rank), dtype=torch.float32)
        assert torch.equal(w[:, 0, 0], want) and bool((w == want.view(-1, 1, 1)).all())
        assert torch.equal(v[:, 0, 0], want * 10)


def _layers(rank: int, group, skew: float, kernels_factory):
    """(the single-process layer, the same weights as this rank's EP layer)."""
    cfg = _cfg()
    torch.manual_seed(0)
    full = DeepseekMoE(cfg, kernels_factory(), dtype=torch.float32, device="cpu")
    for p in full.parameters():
        p.data.normal_(0, 0.2)
    placement = initial_placement(EXPERTS, WORLD, EPLBConfig(1, 4, 8), num_groups=2, num_nodes=1)
    ep = EPGroup(placement, rank, group, routing_skew=skew)
    set_expert_parallel(ep)
    try:
        moe = DeepseekMoE(cfg, kernels_factory(), dtype=torch.float32, device="cpu")
    finally:
        set_expert_parallel(None)
    for name, p in moe.named_parameters():
        source = dict(full.named_parameters())[name].data
        p.data.copy_(source[placement.local_experts(rank)] if name.startswith("experts.") else source)
    return full, moe, ep


def _reference_output(full, hidden, skew):
    bias = -skew * torch.log1p(torch.arange(EXPERTS, dtype=torch.float32))
    k = full.kernels
    original = k.router_logits
    k.router_logits = lambda h, w: original(h, w) + bias
    try:
        return full(hidden)
    finally:
        k.router_logits = original


def _check_counts_and_replan(rank: int, group, kernels_factory, tokens: list[int]) -> None:
    skew = 1.5
    full, moe, ep = _layers(rank, group, skew, kernels_factory)
    layer = ep.layers[0]
    assert moe.ep_layer is layer and layer.placement.num_slots == 12
    hidden = torch.randn(tokens[rank], 32, generator=torch.Generator().manual_seed(rank))
    want = _reference_output(full, hidden, skew)
    torch.testing.assert_close(moe(hidden), want, rtol=1e-6, atol=1e-6)
    # the counts equal the slots the routing chose, summed over the ranks
    logits = moe.kernels.router_logits(hidden, moe.gate.weight) + layer.skew
    _, ids = moe.kernels.moe_gating_topk(logits, moe.gate.e_score_correction_bias, moe.gating)
    slots = layer.table.route(ids, rank + 0)  # the step offset of the first forward
    total = torch.bincount(slots.view(-1), minlength=12)
    dist.all_reduce(total, group=group)
    mine = total.view(WORLD, -1)[rank]
    assert torch.equal(layer.load[WINDOW], mine) and torch.equal(layer.load[SINCE_PLAN], mine)
    assert ep.forwards == 1 and ep.steps == 0
    ep.step_boundary()
    assert ep.steps == 1
    # a re-plan from skewed counts: new placement, weights moved, same output
    balancer = ExpertBalancer(ep, EPLBConfig(1, 1, 1), num_groups=2, num_nodes=1)
    ep.balancer = balancer
    balancer.window_open = True  # the window of the steps since the placement was installed (counted above)
    layer.load[WINDOW] = torch.tensor([[400, 5, 3, 1], [2, 1, 1, 1], [300, 2, 1, 1]][rank])
    before = layer.placement
    assert balancer.at_step_boundary()
    assert balancer.replans == 1 and balancer.pause_ms[0] > 0
    assert layer.placement != before
    hot = layer.placement.slot_to_logical
    assert hot.count(0) >= 2 and hot.count(8 // 2) >= 1  # the hottest expert holds the most replicas
    assert bool((layer.load == 0).all())
    assert moe.experts.expert_ids == layer.placement.local_experts(rank)
    torch.testing.assert_close(moe(hidden), want, rtol=1e-6, atol=1e-6)


def _rank_main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    groups = init_process_groups(DistributedConfig(rank=rank, world_size=WORLD, local_rank=rank, master_port=port,
                                                   timeout_s=60))
    try:
        _check_random_moves(rank, groups.device_group)
        from deepinfer_npu.backends.cpu.kernels import CpuKernelSet

        _check_counts_and_replan(rank, groups.device_group, CpuKernelSet, [5, 0, 9])  # a rank without tokens
        from parity_tests.npu_emulation import emulated_npu

        with emulated_npu():
            from deepinfer_npu.backends.ascend.kernels import AscendKernelSet

            # (the emulated npu_moe_gating_top_k takes no empty batch; engine ranks never route 0 tokens)
            from parity_tests.npu_emulation import CALLS

            CALLS.clear()
            _check_counts_and_replan(rank, groups.device_group, AscendKernelSet, [5, 2, 9])
            assert CALLS["npu_moe_init_routing_v2"] > 0  # the counts came from the routing op
    finally:
        destroy_process_groups()
    leave_rank()


def test_moves_counts_and_replan_over_three_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(port,), nprocs=WORLD, join=True, start_method="spawn")
