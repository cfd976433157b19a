"""DeepSeek MoE reference ops: gating, dispatch (sort by expert), grouped SwiGLU MLP, combine."""

from __future__ import annotations

import torch

from deepinfer_npu.hal.types import DispatchState, GatingParams

from .linear import silu_and_mul


def _group_mask(group_scores: torch.Tensor, params: GatingParams) -> torch.Tensor:
    """[T, G] group scores -> [T, E] bool mask of the experts in each token's ``topk_group`` best groups."""
    top_groups = torch.topk(group_scores, k=params.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    per_group = params.num_experts // params.n_group
    return keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(group_scores.shape[0], params.num_experts)


def moe_gating_topk(
    router_logits: torch.Tensor, bias: torch.Tensor | None, params: GatingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` [T, E] -> ``(weights [T, k] fp32, ids [T, k] int32)``; see ``GatingParams``."""
    logits = router_logits.float()
    num_tokens = logits.shape[0]
    if params.scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif params.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unsupported scoring_func {params.scoring_func!r}")
    grouped = (num_tokens, params.n_group, params.num_experts // params.n_group)

    if params.topk_method == "noaux_tc":
        # The correction bias steers which experts are chosen; the weights are the unbiased scores.
        choice = scores + bias.float() if bias is not None else scores
        group_scores = choice.view(grouped).topk(2, dim=-1).values.sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(group_scores, params), float("-inf"))
        ids = torch.topk(choice, k=params.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
    elif params.topk_method == "group_limited_greedy":
        group_scores = scores.view(grouped).max(dim=-1).values
        masked = scores.masked_fill(~_group_mask(group_scores, params), 0.0)
        weights, ids = torch.topk(masked, k=params.top_k, dim=-1, sorted=False)
    elif params.topk_method == "greedy":
        weights, ids = torch.topk(scores, k=params.top_k, dim=-1, sorted=False)
    else:
        raise ValueError(f"unsupported topk_method {params.topk_method!r}")

    if params.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * params.routed_scaling_factor
    return weights, ids.to(torch.int32)


def moe_dispatch(
    hidden: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
    """``hidden`` [T, D], ``ids`` [T, k] -> ``(sorted_hidden [T*k, D], tokens_per_expert [E], state)``."""
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1).long()
    # Stable sort keeps token order inside each expert, so results do not depend on the sort implementation.
    order = torch.argsort(flat_ids, stable=True)
    sorted_hidden = hidden[order // top_k]
    tokens_per_expert = torch.bincount(flat_ids, minlength=num_experts)
    return sorted_hidden, tokens_per_expert, DispatchState(order=order, num_tokens=num_tokens, top_k=top_k)


def grouped_mlp(
    sorted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """SwiGLU per expert over its contiguous rows: ``w13`` [E, 2I, D], ``w2`` [E, D, I] -> [M, D].

    One matmul pair per expert with tokens (never a loop over tokens).
    """
    out = torch.empty_like(sorted_hidden)
    counts = tokens_per_expert.tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = sorted_hidden[start : start + count]
        out[start : start + count] = silu_and_mul(rows @ w13[expert].t()) @ w2[expert].t()
        start += count
    return out


def moe_combine(expert_out: torch.Tensor, state: DispatchState, weights: torch.Tensor) -> torch.Tensor:
    """Un-permute ``expert_out`` [T*k, D] and sum each token's k rows weighted by ``weights`` [T, k] -> [T,
    D]."""
    unsorted = torch.empty_like(expert_out, dtype=torch.float32)
    unsorted[state.order] = expert_out.float()
    per_token = unsorted.view(state.num_tokens, state.top_k, expert_out.shape[-1])  # also for 0 tokens
    return (per_token * weights.float().unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)
