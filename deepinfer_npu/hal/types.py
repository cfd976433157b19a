"""Plain data passed to KernelSet ops: weights of one MLA layer, gating parameters, MoE dispatch state, and the
start-up shapes a kernel set warms up for (``KernelWarmupPlan``).

These are the op contract's argument types, so every backend sees the same structures; they hold tensors and
ints only (no modules), which keeps ops free functions that a backend can map onto one fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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
    # [rows of q_proj (or q_a_proj) + L + R, D]: the query's first projection and ``kv_a_proj`` in one tensor, of
    # which those two are the row slices (no copy); both read the same input, so a backend may run them as one
    # GEMM. None with biases, or when the two do not share it.
    fused_a_proj: torch.Tensor | None = None


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


@dataclass
class EPDispatched:
    """What ``ep_dispatch`` gives this rank: its routed rows sorted by local expert slot, the rows per slot, and
    what ``ep_combine`` needs to bring the outputs back (backend-specific)."""

    rows: torch.Tensor  # [R, D] the (token, choice) rows this rank's slots run, slot 0's first
    tokens_per_slot: torch.Tensor  # [slots_per_rank] int64 on the device
    state: Any


@dataclass(frozen=True, kw_only=True)
class KernelWarmupPlan:
    """What the engine knows at start-up about the shapes of its steps, for ``KernelSet.warmup``.

    A backend whose kernels are built per configuration (CUDA's TileLang kernels are JIT-compiled per shape
    variant) compiles every variant these shapes can reach before the first step, instead of stalling a step
    for seconds at first use. Built by the worker (``worker/kernel_warmup.py``) after the model is loaded and
    before any graph is captured. Sizes are the target model's unless noted; ``H`` = ``num_heads``.
    """

    # ---- model
    dtype: torch.dtype  # activations, weights and the KV cache
    vocab_size: int  # logits are [rows, vocab_size] fp32
    hidden_size: int
    num_heads: int  # attention heads on this device (after tensor parallelism, if any)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj without the low-rank path (V2-Lite)
    rope_interleaved: bool  # RopeLike.interleaved of the attention layers
    softmax_scale: float  # MLA's score scale (YaRN mscale included)
    rms_norm_eps: float  # the decoder's hidden-size RMSNorms (plain and fused with the residual add)
    latent_norm_eps: float  # q_a / kv_a layernorms (MLAWeights.norm_eps)
    mlp_intermediate_sizes: tuple[int, ...] = ()  # I of the dense SwiGLU MLPs: dense layers, shared experts
    moe_gating: GatingParams | None = None  # routed experts (num_experts, top_k, router); None: no MoE layer
    moe_intermediate_size: int = 0  # I of one routed expert
    drafter_rms_norm_eps: float | None = None  # a drafter's own hidden-size RMSNorms (DFlash), plain only
    # (in_features, weight dtype) of the 2-D weights the model's layers run through ``linear`` (router: fp32)
    linear_weights: tuple[tuple[int, torch.dtype], ...] = ()

    # ---- engine
    block_size: int  # tokens per KV-cache block (page)
    max_model_len: int  # -> the scheduler's block-table width, ceil(max_model_len / block_size)
    max_num_seqs: int  # most requests in a decode step
    max_num_prompts: int  # most requests in a prefill step
    max_num_batched_tokens: int  # most tokens in a step (a prefill chunk's query length included)
    num_speculative_tokens: int = 0  # k drafts verified per request and step; 0 without speculation
    speculative_method: str | None = None  # "mtp" (runs the target's layers on its own tables) | "dflash" | None
    varlen: bool = False  # draft counts are re-split on the device (zos_fixup's re-split; host q lengths unknown)
    decode_graph_sizes: tuple[int, ...] = ()  # total_q of the captured decode graphs (empty: eager decode)
    decode_graph_width: int = 0  # block-table width of those graphs
    quantization: str | None = None  # EngineConfig.quantization ("fp8" / "w8a8") or None
    fp8_linear_shapes: tuple[tuple[int, int], ...] = ()  # (out, in) of the model's 2-D FP8 weights
    fp8_one_row_shapes: tuple[tuple[int, int], ...] = ()  # (out, in) of the fused q / kv_a FP8 weights (fused_a_proj)
    kv_cache_fp8: bool = False  # the latent caches hold packed FP8 rows (EngineConfig.kv_cache_dtype == "fp8")

    @property
    def block_table_width(self) -> int:
        """Width of the scheduler's block tables (every eager step's)."""
        return -(-self.max_model_len // self.block_size)
