"""A DeepSeek MoE layer run expert-parallel: each rank holds its placement's experts and the routed rows travel.

``shard_experts`` keeps only this rank's experts (in slot order) in a ``DeepseekMoE``'s stacked weights;
``ep_moe_forward`` is that layer's forward over the EP group: the router and the shared experts run on the
rank's own tokens, the routed (token, choice) rows go to the ranks owning their experts (the kernel set's
``ep_dispatch``), run through the local grouped GEMM, come back (``ep_combine``) and are reduced with the router
weights in the same order as on one device, so the layer's output equals the single-device layer's.

A layer built under expert parallelism registers an ``EPLayer`` with the group: its own placement (a load
balancer may replace it between steps, ``deepinfer_npu/eplb``), that placement's route table on the device, and
the tokens each of its local slots received, added on the device from the local dispatch op's counts (the
backend's routing op: ``bincount`` on the CPU, ``npu_moe_init_routing_v2``'s expert counts on Ascend, or
``npu_moe_distribute_dispatch``'s ``expert_token_nums`` under MC2, the permute kernel's counts on CUDA), so counting
costs one add per layer and step and no host read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .expert_placement import ExpertPlacement, RouteTable

WINDOW, SINCE_PLAN = 0, 1  # rows of EPLayer.load


class EPLayer:
    """One MoE layer's expert-parallel state on this rank."""

    def __init__(self, index: int, placement: ExpertPlacement, experts, device: torch.device,
                 routing_skew: float = 0.0) -> None:
        self.index = index  # registration order: the same on every rank (layers are built in the same order)
        self.experts = experts  # the layer's StackedExperts (a balancer moves rows of its weights)
        self.device = device
        self.install(placement)
        # [2, slots_per_rank] int64 on the device: row WINDOW the balancer's window, row SINCE_PLAN the tokens since
        # this placement was installed (get_stats' moe_lb)
        self.load = torch.zeros(2, placement.slots_per_rank, dtype=torch.int64, device=device)
        # test and benchmark hook: router logit of expert e lowered by skew * ln(1 + e), a Zipf-like preference
        # for the low-numbered experts (changes the model's outputs)
        self.skew = None
        if routing_skew:
            self.skew = (-routing_skew * torch.log1p(torch.arange(placement.num_logical, dtype=torch.float32))
                         ).to(device)

    def install(self, placement: ExpertPlacement) -> None:
        self.placement = placement
        self.table = RouteTable(placement, self.device)


@dataclass
class EPGroup:
    """This rank's place in the expert-parallel group, and the MoE layers built under it."""

    placement: ExpertPlacement  # every layer's placement at start
    rank: int
    group: dist.ProcessGroup | None = None
    routing_skew: float = 0.0  # EngineConfig.moe_routing_skew (tests, benchmarks)
    layers: list[EPLayer] = field(default_factory=list, repr=False)
    forwards: int = 0  # MoE layer forwards run here (every layer, main model and drafter)
    # model steps: step-loop iterations that ran a MoE forward (``step_boundary``); the same on every rank, since
    # every rank runs the same forwards (their collectives pair up)
    steps: int = 0
    balancer: Any = None  # deepinfer_npu.eplb.ExpertBalancer when EPLB is on
    _forwards_seen: int = field(default=0, repr=False)

    def start_counting(self) -> None:
        """Forwards so far (start-up and warm-up runs) are no model steps."""
        self._forwards_seen = self.forwards

    def step_boundary(self) -> None:
        """Called by the step loop between two steps: one more model step if a MoE forward ran since the last."""
        if self.forwards != self._forwards_seen:
            self.steps += 1
            self._forwards_seen = self.forwards

    @property
    def local_experts(self) -> list[int]:
        return self.placement.local_experts(self.rank)

    def register(self, moe) -> EPLayer:
        layer = EPLayer(len(self.layers), self.placement, moe.experts, moe.experts.w13.device, self.routing_skew)
        self.layers.append(layer)
        return layer


def shard_experts(moe, ep: EPGroup) -> None:
    """Replace the layer's stacked expert weights [E, ...] by this rank's slots [slots_per_rank, ...]."""
    if ep.placement.num_logical != moe.num_experts:
        raise ValueError(f"the placement is for {ep.placement.num_logical} experts, the layer has "
                         f"{moe.num_experts}")
    index = torch.tensor(ep.local_experts, device=moe.experts.w13.device)
    for name in getattr(moe.experts, "remapped_params", ("w13", "w2")):  # quantised: the scales too
        stacked = getattr(moe.experts, name).data
        setattr(moe.experts, name, torch.nn.Parameter(stacked.index_select(0, index), requires_grad=False))


def ep_moe_forward(moe, hidden: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """``hidden`` [T, D] (post-attention-normed; T may be 0 on a rank with no tokens) -> [T, D]."""
    k = moe.kernels
    layer: EPLayer | None = getattr(moe, "ep_layer", None)
    router_logits = k.router_logits(hidden, moe.gate.weight)
    if layer is not None and layer.skew is not None:
        router_logits = router_logits + layer.skew
    weights, ids = k.moe_gating_topk(router_logits, moe.gate.e_score_correction_bias, moe.gating)
    if layer is None:  # a layer sharded by hand (shard_experts): the group's placement, rebuilt per call
        placement, slots = ep.placement, ep.placement.route(ids, ep.rank)
    else:  # replicas spread by token index, shifted per rank and step so one-token decode batches spread too
        placement, slots = layer.placement, layer.table.route(ids, ep.rank + ep.steps)
    dispatched = k.ep_dispatch(hidden, slots, placement, ep.group, weights)
    if layer is not None:
        layer.load.add_(dispatched.tokens_per_slot)  # the routing op's per-slot counts, accumulated on the device
        ep.forwards += 1
    out = moe.experts_mlp(dispatched.rows, dispatched.tokens_per_slot)
    routed = k.ep_combine(out, dispatched, weights, ep.group)
    if moe.shared_experts is None:
        return routed
    return routed + moe.shared_experts(hidden)
