"""CPU implementations of torch_npu's MoE ops, each from its documentation (Ascend/pytorch docs):
npu_moe_gating_top_k, npu_moe_init_routing_v2, npu_grouped_matmul, npu_moe_token_unpermute."""

from __future__ import annotations

import torch

from .contract import check, record


def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 1,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_out = softmax(x) (norm_type 0) | sigmoid(x) (1); selection on norm_out + bias; groups scored by
    max (group_select_mode 0) or top-2 sum (1), k_group kept, others -inf; top-k; y = norm_out[idx];
    y_out = y / (sum(y) + eps) * routed_scaling_factor. -> (y_out [T, k] x.dtype, expert_idx [T, k] int32,
    out [T, E] (norm_out when out_flag else empty))."""
    record("npu_moe_gating_top_k")
    check(x.dim() == 2, "x must be 2-D [T, E]")
    e = x.shape[1]
    check(bias is None or (bias.shape == (e,) and bias.dtype == x.dtype), "bias [E], same dtype as x")
    check(e % group_count == 0 and 1 <= k <= e // group_count * k_group, "k / group_count / k_group limits")
    check(renorm == 0, "renorm only supports 0")
    xf = x.float()
    norm_out = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    value = norm_out + bias.float() if bias is not None else norm_out
    if group_count > 1:
        grouped = value.view(x.shape[0], group_count, -1)
        if group_select_mode == 0:
            score = grouped.max(dim=-1).values
        else:
            score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(
            1, score.topk(k_group, dim=-1).indices, True
        )
        value = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(x.shape[0], e)
    idx = value.topk(k, dim=-1).indices
    y = norm_out.gather(1, idx)
    y = y / (y.sum(dim=-1, keepdim=True) + eps) * routed_scaling_factor
    out = norm_out if out_flag else norm_out.new_empty(0)
    return y.to(x.dtype), idx.to(torch.int32), out


def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale=None,
    offset=None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: list[int] | None = None,
    row_idx_type: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dropless, unquantised, count mode only (what the backend uses). Rows of ``x`` are expanded k times and
    grouped by expert (stable in flat index ``t*k + j``); ``expanded_row_idx[t*k + j]`` is that copy's row in
    ``expanded_x`` (the index npu_moe_token_unpermute consumes, as vllm-ascend pairs them)."""
    record("npu_moe_init_routing_v2")
    check(x.dim() == 2 and expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0], "x [T,H], idx [T,K]")
    check(expert_idx.dtype == torch.int32, "expert_idx must be int32")
    check(
        drop_pad_mode == 0 and quant_mode == -1 and row_idx_type == 0,
        "emulated: dropless, no quant, gather idx",
    )
    check(expert_tokens_num_type == 1 and expert_tokens_num_flag, "emulated: count mode with the flag on")
    t, k = expert_idx.shape
    check(active_num == t * k, "emulated: active_num = T*K (everything active)")
    check(0 < expert_num <= 10240, "expert_num range")
    rng = list(active_expert_range or [0, expert_num])
    check(rng == [0, expert_num], "emulated: all experts active")
    flat = expert_idx.reshape(-1).long()
    check(bool((flat >= 0).all()) and bool((flat < expert_num).all()), "expert ids in [0, expert_num)")
    order = torch.argsort(flat, stable=True)
    expanded_x = x[order // k]
    row_idx = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    counts = torch.bincount(flat, minlength=expert_num).to(torch.int64)
    return expanded_x, row_idx.to(torch.int32), counts, torch.empty(0, dtype=torch.float32)


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list: torch.Tensor | None = None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    output_dtype=None,
    tuning_config=None,
) -> list[torch.Tensor]:
    """split_item=2 (one x, one stacked weight [E, K, N], one output), group_type=0 (groups along M),
    group_list_type=1 (per-group counts, int64): rows of group e are multiplied by weight[e]."""
    record("npu_grouped_matmul")
    check(isinstance(x, list) and isinstance(weight, list) and len(x) == len(weight) == 1, "tensor lists")
    check(
        split_item == 2 and group_type == 0 and group_list_type == 1,
        "emulated: split_item 2, M groups, counts",
    )
    a, w = x[0], weight[0]
    check(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], "x [M, K], weight [E, K, N]")
    check(
        group_list is not None and group_list.dtype == torch.int64 and group_list.shape == (w.shape[0],),
        "group_list int64 [E]",
    )
    counts = group_list.tolist()
    check(sum(counts) <= a.shape[0], "group counts exceed M")
    out = a.new_zeros(a.shape[0], w.shape[2])
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[start : start + c] = a[start : start + c] @ w[e]
        start += c
    return [out.to(output_dtype) if output_dtype is not None else out]


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape=None,
) -> torch.Tensor:
    """out[t] = sum_j permuted_tokens[sorted_indices[t*k + j]] * probs[t, j] (k = probs.shape[1], or 1)."""
    record("npu_moe_token_unpermute")
    check(not padded_mode and restore_shape is None, "emulated: padded_mode False")
    check(sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1, "sorted_indices int32 [T*k]")
    check(sorted_indices.numel() == permuted_tokens.shape[0], "one index per permuted row")
    k = 1 if probs is None else probs.shape[1]
    rows = permuted_tokens[sorted_indices.long()].view(-1, k, permuted_tokens.shape[-1])
    if probs is None:
        return rows[:, 0]
    check(probs.dtype == permuted_tokens.dtype, "probs take the tokens' dtype")
    return (rows * probs.unsqueeze(-1)).sum(dim=1)
