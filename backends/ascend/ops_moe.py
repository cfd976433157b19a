"""DeepSeek MoE on torch_npu: gating, token routing, grouped SwiGLU MLP, un-permute + weighted sum."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_npu.hal.types import DispatchState, GatingParams

from . import runtime


def moe_gating_topk(
    router_logits: torch.Tensor, bias: torch.Tensor | None, params: GatingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """HAL ``moe_gating_topk`` on ``torch_npu.npu_moe_gating_top_k`` (only called when the decision fits).

    The op: norm_type 1 = sigmoid / 0 = softmax; the bias only steers selection; groups ranked by the sum of
    their top-2 (group_select_mode=1, DeepSeek-V3 noaux_tc) or their max (0); k_group best groups kept; top-k;
    weights renormalised ``y / (sum(y) + eps) * routed_scaling_factor`` (renorm=0: norm before top-k).
    Doc: torch_npu-npu_moe_gating_top_k.md (hiascend Pytorch/700 ptaoplist_002365), aclnnMoeGatingTopK.md;
    usage: vllm_ascend/ops/fused_moe/experts_selector.py (_select_experts_with_fusion_ops).
    """
    grouped = params.n_group > 1
    weights, ids, _out = runtime.load().npu_moe_gating_top_k(
        router_logits,
        k=params.top_k,
        bias=None if bias is None else bias.to(router_logits.dtype),
        k_group=params.topk_group if grouped else 1,
        group_count=params.n_group if grouped else 1,
        group_select_mode=1 if params.topk_method == "noaux_tc" else 0,
        renorm=0,
        norm_type=1 if params.scoring_func == "sigmoid" else 0,
        out_flag=False,
        routed_scaling_factor=params.routed_scaling_factor,
        eps=1e-20,
    )
    return weights.float(), ids.to(torch.int32)


@dataclass
class AscendDispatchState(DispatchState):
    """Adds the routing op's ``expanded_row_idx`` [T*k] int32 (flat assignment ``t*k + j`` -> its row in the
    expert-sorted buffer), which the un-permute op consumes directly. ``order`` (the HAL field) is its
    inverse."""

    expanded_row_idx: torch.Tensor | None = None


def moe_dispatch(
    hidden: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
    """HAL ``moe_dispatch`` on ``torch_npu.npu_moe_init_routing_v2`` (dropless, no quantisation, counts).

    Doc: torch_npu-npu_moe_init_routing_v2.md (Ascend/pytorch docs): returns (expanded_x [T*k, H] grouped by
    expert, expanded_row_idx [T*k] int32, expert_token_cumsum_or_count [E] int64 with
    expert_tokens_num_type=1, expanded_scale). Usage: vllm_ascend/ops/fused_moe/token_dispatcher.py
    (TokenDispatcherWithAllGather), which pairs expanded_row_idx with npu_moe_token_unpermute as we do.
    """
    num_tokens, top_k = ids.shape
    expanded_x, expanded_row_idx, counts, _scale = runtime.load().npu_moe_init_routing_v2(
        hidden,
        ids.to(torch.int32),
        active_num=num_tokens * top_k,
        expert_num=num_experts,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=[0, num_experts],
        quant_mode=-1,
        row_idx_type=0,
    )
    rows = expanded_row_idx.long()
    order = torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel(), device=rows.device))
    state = AscendDispatchState(
        order=order, num_tokens=num_tokens, top_k=top_k, expanded_row_idx=expanded_row_idx
    )
    return expanded_x, counts.to(torch.int64), state


def grouped_mlp(
    sorted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """HAL ``grouped_mlp``: two ``npu_grouped_matmul`` calls around ``npu_swiglu``.

    npu_grouped_matmul(x=[x], weight=[w [E, K, N]], split_item=2 (one output tensor), group_type=0 (groups
    along M), group_list_type=1 (group_list holds per-expert counts, int64), group_list=...) -> [out [M, N]].
    Our stacked weights are [E, N, K]; the transposed view is passed (no copy), as vllm-ascend does for
    unquantised experts. Doc: torch_npu-npu_grouped_matmul.md; usage: vllm_ascend/ops/fused_moe/moe_mlp.py.
    """
    npu = runtime.load()
    counts = tokens_per_expert.to(torch.int64)
    gate_up = npu.npu_grouped_matmul(
        x=[sorted_hidden],
        weight=[w13.transpose(1, 2)],
        split_item=2,
        group_list_type=1,
        group_type=0,
        group_list=counts,
    )[0]
    act = npu.npu_swiglu(gate_up, dim=-1)
    return npu.npu_grouped_matmul(
        x=[act],
        weight=[w2.transpose(1, 2)],
        split_item=2,
        group_list_type=1,
        group_type=0,
        group_list=counts,
    )[0]


def moe_combine(expert_out: torch.Tensor, state: DispatchState, weights: torch.Tensor) -> torch.Tensor:
    """HAL ``moe_combine`` on ``torch_npu.npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs)``:
    ``out[t] = sum_j permuted_tokens[sorted_indices[t*k + j]] * probs[t, j]``. Like vllm-ascend we cast the
    tokens to the probs' dtype (fp32) first, which is also the HAL's fp32 accumulation.
    Doc: torch_npu-npu_moe_token_unpermute.md; usage: vllm_ascend/ops/fused_moe/token_dispatcher.py."""
    if not isinstance(state, AscendDispatchState) or state.expanded_row_idx is None:
        from deepinfer_npu.backends.cpu.moe import moe_combine as ref

        return ref(expert_out, state, weights)
    out = runtime.load().npu_moe_token_unpermute(
        expert_out.float(), state.expanded_row_idx.abs(), probs=weights.float()
    )
    return out.to(expert_out.dtype)
