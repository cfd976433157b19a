"""Which torch_npu fused op serves each KernelSet op: documented limits per chip, decided once per model
shape.

Every limit below is copied from the op's documentation (cited per entry); a shape or dtype outside it sends
the op to its fallback. A decision depends only on static facts (dims, dtype, expert counts, block size), so
it
is taken at the op's first call and memoised: the model's first forward fixes the plan, and ``op_report``
shows
it. :func:`plan_for_config` takes the same decisions up front from a model config (``--list-ops``, tests).

Profiles: ``a2_a3`` (Atlas A2/A3, the documented limits), ``950`` (Ascend 950: the newer aclnn docs widen the
gating op to <= 2048 experts), and ``emulation`` — the CPU contract emulation (parity_tests/ascend_emulation),
which keeps every *semantic* constraint (layouts, the gating op's always-on renormalisation, FIA's 16-query
window) but lifts fixed dims and dtypes so a small fp32 model exercises the same call sites. The emulation
profile is never chosen on hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_npu import envs

HALF = (torch.bfloat16, torch.float16)
ANY_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Limits:
    name: str
    fixed_dims: bool  # False only for the emulation profile
    # npu_interleave_rope: x [B, N, S, D] fp16/bf16, D = 64 (MLA rope dim).
    # Doc: Ascend/pytorch docs, torch_npu-npu_interleave_rope.md; usage vllm_ascend/attention/mla_v1.py
    # (rope_single)
    interleave_rope_dims: tuple[int, ...] = (64,)
    interleave_rope_dtypes: tuple[torch.dtype, ...] = HALF
    # npu_fused_infer_attention_score, MLA mode (query_rope/key_rope given): q/k head dim 512, rope dim 64,
    # fp16/bf16, heads a power of two <= 128, PagedAttention block size a multiple of 16 up to 512, and at
    # most 16
    # query tokens per request (sparse_mode=3). Doc: torch_npu-npu_fused_infer_attention_score.md
    # (Ascend/pytorch
    # docs; hiascend Pytorch/700 ptaoplist_001232); usage vllm_ascend/attention/mla_v1.py (_forward_decode).
    fia_latent_dims: tuple[int, ...] = (512,)
    fia_rope_dims: tuple[int, ...] = (64,)
    fia_dtypes: tuple[torch.dtype, ...] = HALF
    fia_heads: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    fia_max_q_per_request: int = 16
    # npu_moe_gating_top_k: x [T, E] with E == 256 on A2/A3 (<= 2048 on 950), k_group == 4 on A2/A3, k <= 32,
    # bias required on A2/A3; output always renormalised (y / (sum + eps) * routed_scaling_factor).
    # Doc: torch_npu-npu_moe_gating_top_k.md (hiascend Pytorch/700 ptaoplist_002365); aclnnMoeGatingTopK.md.
    gating_experts: tuple[int, ...] | None = (256,)
    gating_max_experts: int = 256
    gating_k_group: tuple[int, ...] | None = (4,)
    gating_max_k: int = 32
    # npu_grouped_matmul (split_item=2, group_type=0, group_list_type=1): fp16/bf16 weights and activations.
    # Doc: torch_npu-npu_grouped_matmul.md; usage vllm_ascend/ops/fused_moe (moe_mlp.py).
    gmm_dtypes: tuple[torch.dtype, ...] = HALF
    # npu_moe_init_routing_v2: expert_num <= 10240 outside key_value mode. Doc:
    # torch_npu-npu_moe_init_routing_v2.md
    routing_max_experts: int = 10240
    # W8A8 (dynamic): npu_dynamic_quant takes fp16/bf16 activations; npu_quant_matmul and the quantised
    # npu_grouped_matmul give fp16/bf16 outputs (A2/A3: pertoken + perchannel scales, bf16 or fp16 output).
    # Docs: torch_npu-npu_dynamic_quant.md, torch_npu-npu_quant_matmul.md, aclnnGroupedMatmulV4.md; usage
    # vllm_ascend/quantization/methods/w8a8_dynamic.py.
    w8a8_dtypes: tuple[torch.dtype, ...] = HALF
    extra: dict = field(default_factory=dict)


A2_A3 = Limits(name="a2_a3", fixed_dims=True)
ASCEND_950 = Limits(
    name="950", fixed_dims=True, gating_experts=None, gating_max_experts=2048, gating_k_group=None
)
EMULATION = Limits(
    name="emulation",
    fixed_dims=False,
    interleave_rope_dims=(),
    interleave_rope_dtypes=ANY_FLOAT,
    fia_latent_dims=(),
    fia_rope_dims=(),
    fia_dtypes=ANY_FLOAT,
    fia_heads=(),
    gating_experts=None,
    gating_max_experts=2048,
    gating_k_group=None,
    gmm_dtypes=ANY_FLOAT,
    w8a8_dtypes=ANY_FLOAT,
)
PROFILES = {p.name: p for p in (A2_A3, ASCEND_950, EMULATION)}
PROFILE_ENV = "DEEPINFER_ASCEND_PROFILE"


def detect_profile(device_name: str | None, emulated: bool) -> Limits:
    """``DEEPINFER_ASCEND_PROFILE`` wins; else the emulation profile under emulation, else by chip name."""
    forced = envs.get(PROFILE_ENV)
    if forced:
        if forced not in PROFILES:
            raise ValueError(f"{PROFILE_ENV}={forced!r}: expected one of {sorted(PROFILES)}")
        return PROFILES[forced]
    if emulated:
        return EMULATION
    if device_name and "950" in device_name:
        return ASCEND_950
    return A2_A3


@dataclass(frozen=True)
class Decision:
    native: bool
    detail: str  # the fused op used, or why not
    tilelang: bool = False  # served by a kernels_ascend program (a fused op's limits did not fit)

    def report(self) -> str:
        return f"native ({self.detail})" if self.native else f"fallback ({self.detail})"


def _in(value, allowed) -> bool:
    return not allowed or value in allowed


def decide_rope(lim: Limits, interleaved: bool, rope_dim: int, dtype: torch.dtype) -> Decision:
    if not interleaved:
        return Decision(True, "torch_npu.npu_rotary_mul (NeoX halves layout)")
    if not _in(rope_dim, lim.interleave_rope_dims):
        return Decision(
            False, f"npu_interleave_rope takes D={lim.interleave_rope_dims}, model has {rope_dim}"
        )
    if dtype not in lim.interleave_rope_dtypes:
        return Decision(False, f"npu_interleave_rope takes fp16/bf16, model runs {dtype}")
    return Decision(True, "torch_npu.npu_interleave_rope")


def decide_attention(
    lim: Limits, latent_dim: int, rope_dim: int, num_heads: int, block_size: int, dtype: torch.dtype
) -> Decision:
    why = []
    if not _in(latent_dim, lim.fia_latent_dims):
        why.append(f"kv_lora_rank {latent_dim} (FIA MLA mode takes {lim.fia_latent_dims})")
    if not _in(rope_dim, lim.fia_rope_dims):
        why.append(f"rope dim {rope_dim} (takes {lim.fia_rope_dims})")
    if not _in(num_heads, lim.fia_heads):
        why.append(f"{num_heads} heads (takes {lim.fia_heads})")
    if lim.fixed_dims and (block_size % 16 or block_size > 512):
        why.append(f"block_size {block_size} (PagedAttention takes multiples of 16 up to 512)")
    if dtype not in lim.fia_dtypes:
        why.append(f"dtype {dtype} (takes fp16/bf16)")
    if why:
        return Decision(False, "npu_fused_infer_attention_score does not fit: " + ", ".join(why))
    return Decision(
        True,
        f"torch_npu.npu_fused_infer_attention_score TND + query_rope/key_rope, sparse_mode=3, requests split "
        f"into <= {lim.fia_max_q_per_request}-query pieces",
    )


def decide_gating(
    lim: Limits,
    scoring_func: str,
    topk_method: str,
    norm_topk_prob: bool,
    has_bias: bool,
    num_experts: int,
    n_group: int,
    topk_group: int,
    top_k: int,
) -> Decision:
    why = []
    if topk_method == "noaux_tc" and scoring_func != "sigmoid":
        why.append("noaux_tc with softmax scoring")
    if topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        why.append(f"topk_method {topk_method!r}")
    if not norm_topk_prob or topk_method == "group_limited_greedy":
        # The op always renormalises the k weights; DeepSeek-V2 (HF ignores norm_topk_prob) does not.
        why.append("model does not renormalise top-k weights (the op always does)")
    if lim.fixed_dims and not has_bias:
        why.append("no e_score_correction_bias (required on A2/A3)")
    if lim.gating_experts is not None and num_experts not in lim.gating_experts:
        why.append(f"{num_experts} experts (takes {lim.gating_experts})")
    if num_experts > lim.gating_max_experts:
        why.append(f"{num_experts} experts (max {lim.gating_max_experts})")
    if lim.gating_k_group is not None and n_group > 1 and topk_group not in lim.gating_k_group:
        why.append(f"topk_group {topk_group} (k_group takes {lim.gating_k_group})")
    if top_k > lim.gating_max_k or top_k > num_experts // max(n_group, 1) * max(topk_group, 1):
        why.append(f"top_k {top_k}")
    if why:
        # What runs instead (kernels_ascend.gating_topk or the reference) is AscendKernelSet._gating_decision's call.
        return Decision(False, "npu_moe_gating_top_k does not fit: " + ", ".join(why))
    return Decision(True, "torch_npu.npu_moe_gating_top_k")


def decide_grouped_mlp(lim: Limits, dtype: torch.dtype) -> Decision:
    if dtype not in lim.gmm_dtypes:
        return Decision(False, f"npu_grouped_matmul takes fp16/bf16 here, model runs {dtype}")
    return Decision(True, "torch_npu.npu_grouped_matmul x2 + torch_npu.npu_swiglu")


def decide_w8a8(lim: Limits, dtype: torch.dtype, grouped: bool) -> Decision:
    if dtype not in lim.w8a8_dtypes:
        return Decision(False, f"npu_dynamic_quant / npu_quant_matmul take fp16/bf16 here, model runs {dtype}")
    if grouped:
        return Decision(True, "torch_npu.npu_dynamic_quant + npu_grouped_matmul (int8, per-token x per-channel "
                              "scales) x2 around npu_swiglu")
    return Decision(True, "torch_npu.npu_dynamic_quant + npu_quant_matmul (int8, per-token x per-channel scales)")


def decide_dispatch(lim: Limits, num_experts: int) -> Decision:
    if num_experts > lim.routing_max_experts:
        return Decision(False, f"npu_moe_init_routing_v2 takes <= {lim.routing_max_experts} experts")
    return Decision(True, "torch_npu.npu_moe_init_routing_v2 (dropless, count mode)")


def plan_for_config(lim: Limits, cfg, dtype: torch.dtype, block_size: int) -> dict[str, Decision]:
    """Decisions for a :class:`DeepseekModelConfig` before any forward (same functions the ops call)."""
    rope = decide_rope(lim, bool(getattr(cfg, "rope_interleave", True)), cfg.qk_rope_head_dim, dtype)
    plan = {
        "rope": rope,
        "mla_attention": decide_attention(
            lim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads, block_size, dtype
        ),
    }
    if cfg.n_routed_experts:
        plan["moe_gating_topk"] = decide_gating(
            lim,
            cfg.scoring_func,
            cfg.topk_method,
            bool(cfg.norm_topk_prob),
            cfg.topk_method == "noaux_tc",
            cfg.n_routed_experts,
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
        )
        plan["moe_dispatch"] = decide_dispatch(lim, cfg.n_routed_experts)
        plan["grouped_mlp"] = decide_grouped_mlp(lim, dtype)
    return plan
