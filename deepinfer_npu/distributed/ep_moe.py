"""A DeepSeek MoE layer run expert-parallel: each rank holds its placement's experts and the routed rows travel.

``shard_experts`` keeps only this rank's experts (in slot order) in a ``DeepseekMoE``'s stacked weights;
``ep_moe_forward`` is that layer's forward over the EP group: the router and the shared experts run on the
rank's own tokens, the routed (token, choice) rows go to the ranks owning their experts (``ep_dispatch``), run
through the local grouped GEMM, come back (``ep_combine``) and are reduced with the router weights in the same
order as on one device, so the layer's output equals the single-device layer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ep_comm import ep_combine, ep_dispatch
from .expert_placement import ExpertPlacement


@dataclass(frozen=True)
class EPGroup:
    placement: ExpertPlacement
    rank: int
    group: dist.ProcessGroup | None = None

    @property
    def local_experts(self) -> list[int]:
        return self.placement.local_experts(self.rank)


def shard_experts(moe, ep: EPGroup) -> None:
    """Replace the layer's stacked expert weights [E, ...] by this rank's slots [slots_per_rank, ...]."""
    if ep.placement.num_logical != moe.num_experts:
        raise ValueError(f"the placement is for {ep.placement.num_logical} experts, the layer has "
                         f"{moe.num_experts}")
    index = torch.tensor(ep.local_experts, device=moe.experts.w13.device)
    moe.experts.w13 = torch.nn.Parameter(moe.experts.w13.data.index_select(0, index), requires_grad=False)
    moe.experts.w2 = torch.nn.Parameter(moe.experts.w2.data.index_select(0, index), requires_grad=False)


def ep_moe_forward(moe, hidden: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """``hidden`` [T, D] (post-attention-normed; T may be 0 on a rank with no tokens) -> [T, D]."""
    k = moe.kernels
    router_logits = k.router_logits(hidden, moe.gate.weight)
    weights, ids = k.moe_gating_topk(router_logits, moe.gate.e_score_correction_bias, moe.gating)
    rows, local_expert, handle = ep_dispatch(hidden, ep.placement.route(ids), ep.placement, ep.group)
    num_local = ep.placement.slots_per_rank
    sorted_rows, counts, state = k.moe_dispatch(rows, local_expert.view(-1, 1).to(torch.int32), num_local)
    out = k.grouped_mlp(sorted_rows, counts, moe.experts.w13, moe.experts.w2)
    # back to receive order; a weight of 1.0 in fp32 leaves every value as the expert produced it
    out = k.moe_combine(out, state, torch.ones(rows.shape[0], 1, device=rows.device))
    routed = ep_combine(out, handle, weights, ep.group)
    if moe.shared_experts is None:
        return routed
    return routed + moe.shared_experts(hidden)
