"""The expert-parallel load balancer of one rank: counts -> placement -> weight moves, at a step boundary.

One balancer serves every MoE layer this rank built under expert parallelism (the main model's and the MTP
drafter's: DeepSeek's MoE layers are homogeneous), each layer with a placement of its own computed from its own
load in one policy call. Every ``rebalance_interval`` model steps, at the boundary between two steps, all ranks
(which count the same steps: the MoE layers' collectives keep them in lockstep, and the step loop checks the
counts agree) gather the tokens each physical slot received over the last ``window_size`` steps, map them to
logical experts, run the policy (``policy.rebalance_experts``), keep a layer's old placement unless the new one
is better balanced on that load, move the weights of the experts that change rank (``weight_move``) and
install the new route tables. The pause, from the first collective to the device being idle again, is measured
on each rank; requests are untouched (KV cache, slots and scheduling do not depend on where experts live).
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from deepinfer_npu.config import EPLBConfig
from deepinfer_npu.distributed.ep_moe import SINCE_PLAN, WINDOW, EPGroup
from deepinfer_npu.distributed.expert_placement import ExpertPlacement

from .metrics import mean_lb, moe_lb
from .policy import device_loads, num_redundant_experts, rebalance_experts
from .weight_move import align, apply_moves, plan_moves


def initial_placement(num_logical: int, ep_size: int, config: EPLBConfig, *, num_groups: int,
                      num_nodes: int) -> ExpertPlacement:
    """The placement before any load is known: the policy on a uniform load, with the redundant slots."""
    redundant = num_redundant_experts(num_logical, ep_size, config.redundant_experts_per_rank * ep_size)
    plan = rebalance_experts(torch.ones(1, num_logical), num_logical + redundant, num_groups, num_nodes, ep_size)
    return ExpertPlacement(num_logical=num_logical, ep_size=ep_size, slot_to_logical=tuple(plan[0].tolist()))


class ExpertBalancer:
    def __init__(self, ep: EPGroup, config: EPLBConfig, *, num_groups: int, num_nodes: int) -> None:
        if ep.placement.ep_size % num_nodes:
            raise ValueError(f"{ep.placement.ep_size} expert-parallel ranks do not divide over {num_nodes} nodes")
        self.ep = ep
        self.config = config
        self.num_groups = num_groups
        self.num_nodes = num_nodes
        self.plan_step = 0  # ep.steps when the current placements were installed
        self.window_open = False
        self.replans = 0
        self.moved_experts = 0  # expert copies that crossed ranks, all layers, all re-plans
        self.pause_ms: deque[float] = deque(maxlen=256)
        self.history: deque[dict] = deque(maxlen=16)

    @property
    def world(self) -> int:
        return self.ep.placement.ep_size

    def at_step_boundary(self) -> bool:
        """Open the load window or re-plan when the step count says so; True when it re-planned. Every rank calls
        it at the same boundary (same step count)."""
        since = self.ep.steps - self.plan_step
        if not self.window_open and since >= self.config.rebalance_interval - self.config.window_size:
            for layer in self.ep.layers:
                layer.load[WINDOW].zero_()
            self.window_open = True
        if since >= self.config.rebalance_interval and self.ep.layers:
            self.rebalance()
            return True
        return False

    def rebalance(self) -> None:
        """Re-place every layer from the window's load (collective over the device group)."""
        start = time.perf_counter()
        layers = self.ep.layers
        num_logical = layers[0].placement.num_logical
        if any(layer.placement.num_logical != num_logical for layer in layers):
            raise RuntimeError("the MoE layers under one balancer must have the same number of routed experts")
        local = torch.stack([layer.load[WINDOW] for layer in layers])  # [L, slots_per_rank]
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local, group=self.ep.group)
        slot_load = torch.cat(gathered, dim=1).cpu().double()  # [L, S]: physical slot order
        if not bool(slot_load.any()):  # no token in the window (the same answer on every rank): nothing to learn
            self.plan_step = self.ep.steps
            self.window_open = False
            return
        old = torch.tensor([layer.placement.slot_to_logical for layer in layers], dtype=torch.int64)
        load = torch.zeros(len(layers), num_logical, dtype=torch.float64).scatter_add_(1, old, slot_load)
        plan = rebalance_experts(load, old.shape[1], self.num_groups, self.num_nodes, self.world)
        worst_old = device_loads(load, old, self.world).amax(-1)
        worst_new = device_loads(load, plan, self.world).amax(-1)
        measured = slot_load.view(len(layers), self.world, -1).sum(-1)
        planned_lb = []
        moved = 0
        for index, layer in enumerate(layers):
            if not worst_new[index] < worst_old[index]:  # not better on this load: nothing moves
                planned_lb.append(moe_lb(device_loads(load[index:index + 1], old[index:index + 1],
                                                      self.world)[0].tolist()))
                continue
            slots = align(layer.placement, plan[index].tolist(), self.world // self.num_nodes)
            new = ExpertPlacement(num_logical=num_logical, ep_size=self.world, slot_to_logical=tuple(slots))
            moves = plan_moves(layer.placement, new)
            stacks = [getattr(layer.experts, name).data for name in layer.experts.remapped_params]  # (+ scales)
            apply_moves(stacks, moves, self.ep.rank, self.world, self.ep.group)
            moved += sum(m.src_rank != m.dst_rank for m in moves)
            layer.experts.relabel(new.local_experts(self.ep.rank))
            layer.install(new)
            planned_lb.append(moe_lb(device_loads(load[index:index + 1], plan[index:index + 1],
                                                  self.world)[0].tolist()))
        for layer in layers:
            layer.load.zero_()
        device = layers[0].device
        if device.type != "cpu":
            getattr(torch, device.type).synchronize(device)
        pause = (time.perf_counter() - start) * 1e3
        self.replans += 1
        self.moved_experts += moved
        self.pause_ms.append(pause)
        self.history.append({"step": self.ep.steps, "window_moe_lb": mean_lb([moe_lb(r) for r in measured.tolist()]),
                             "planned_moe_lb": mean_lb(planned_lb), "moved_experts": moved})
        self.plan_step = self.ep.steps
        self.window_open = False


def ep_stats(ep: EPGroup) -> dict:
    """This rank's report for ``get_stats()``: per layer, the tokens its slots received under the current
    placement; with a balancer, its counters. Reads the device counters (a host sync, at stats time only)."""
    layers = ep.layers
    tokens = torch.stack([layer.load[SINCE_PLAN].sum() for layer in layers]).tolist() if layers else []
    report = {"rank_tokens": tokens}
    balancer = ep.balancer
    if balancer is not None:
        physical = layers[0].placement.num_slots if layers else ep.placement.num_slots
        report["eplb"] = {
            "replans": balancer.replans, "steps": ep.steps, "moved_experts": balancer.moved_experts,
            "pause_ms": list(balancer.pause_ms), "history": list(balancer.history),
            "physical_experts": physical, "redundant_experts": physical - ep.placement.num_logical,
        }
    return report
