"""Plain data passed to KernelSet ops: weights of one MLA layer, gating parameters, MoE dispatch state.

These are the op contract's argument types, so every backend sees the same structures; they hold tensors and
ints only (no modules), which keeps ops free functions that a backend can map onto one fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class RopeLike(Protocol):
    """What ``mla_prolog`` needs from a rotary embedding (``model_executor.layers.rope.RotaryEmbedding``)."""

    #: [max_positions, R] fp32: cos in [:, :R/2], sin in [:, R/2:], YaRN attention factor included
    cos_sin_cache: torch.Tensor
    interleaved: bool  # True: rotate pairs (x[2i], x[2i+1]); False: rotate halves (x[i], x[i + R/2])


@dataclass
class MLAWeights:
    """Weights of one MLA layer in the absorbed layout (``D`` hidden, ``H`` heads, ``L`` kv_lora_rank, ``R``
    qk_rope_head_dim, ``N`` qk_nope_head_dim, ``V`` v_head_dim, ``Q`` q_lora_rank).

    Exactly one of ``q_proj`` ([H*(N+R), D]) or ``q_a_proj`` ([Q, D]) + ``q_a_layernorm`` ([Q]) + ``q_b_proj``
    ([H*(N+R), Q]) is set. ``kv_b_proj`` of the checkpoint ([H*(N+V), L]) is split at load into ``w_uk`` [H,
    N, L] (absorbed into the query) and ``w_uv`` [H, V, L] (applied to the latent attention output).
    """

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    kv_a_proj: torch.Tensor  # [L + R, D]
    kv_a_layernorm: torch.Tensor  # [L]
    w_uk: torch.Tensor  # [H, N, L]
    w_uv: torch.Tensor  # [H, V, L]
    o_proj: torch.Tensor  # [D, H*V]
    q_proj: torch.Tensor | None = None
    q_a_proj: torch.Tensor | None = None
    q_a_layernorm: torch.Tensor | None = None
    q_b_proj: torch.Tensor | None = None
    # Only with ``attention_bias: true`` (as in HF: q_a_proj, kv_a_proj_with_mqa and o_proj get biases).
    q_a_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    # q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not config.rms_norm_eps (as DeepSeek does).
    norm_eps: float = 1e-6


@dataclass(frozen=True)
class GatingParams:
    """DeepSeek router configuration for ``moe_gating_topk``.

    ``scoring_func``: ``"softmax"`` (V2) or ``"sigmoid"`` (V3). ``topk_method``: ``"greedy"``,
    ``"group_limited_greedy"`` (V2: groups ranked by their max score, experts of other groups get score 0) or
    ``"noaux_tc"`` (V3: groups ranked by the sum of their top-2 bias-corrected scores, the bias only steers
    selection; weights are the raw scores).
    """

    top_k: int
    num_experts: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


@dataclass
class DispatchState:
    """What ``moe_combine`` needs to undo ``moe_dispatch``.

    ``order`` [T*k] int64: row ``i`` of the expert-sorted buffer holds flat assignment ``order[i]``
    (assignment ``a`` = token ``a // k``, choice ``a % k``).
    """

    order: torch.Tensor
    num_tokens: int
    top_k: int
