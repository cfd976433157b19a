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
profile is never chosen on hardware. The MC2 expert-parallel pair's limits differ between A2 and A3, so
``Limits.mc2`` comes from the chip's name (:func:`mc2_for_device`); :func:`decide_ep` takes its decision.
"""

from __future__ import annotations

import dataclasses
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
    # npu_moe_distribute_dispatch / _combine (MC2): their limits differ between A2 and A3, so they come from the
    # chip's name (``mc2_for_device``); None: MC2 not used, ``mc2_missing`` says why.
    mc2: Mc2Limits | None = None
    mc2_missing: str = "the SoC is not identified as Atlas A2 or A3 (MC2's limits differ between them)"
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Mc2Limits:
    """The MC2 pair's documented limits on one SoC. Docs: Ascend/op-plugin docs/context
    torch_npu-npu_moe_distribute_dispatch.md and torch_npu-npu_moe_distribute_combine.md (the same limits on both
    pages): x bf16/fp16 [BS, H], expert_ids int32 [BS, K] (distinct ids a row), moe_expert_num in [1, 512] divisible
    by ep_world_size; A3: ep_world_size in {8, 16, 32, 64, 128, 144, 256, 288}, H = 7168, 0 < BS <= 512, K <= 8;
    A2: ep_world_size in {16, 32, 64}, 0 < H <= 7168 (% 32), 0 < BS <= 256, K <= 16, <= 24 experts a rank, and its
    combine requires ``expand_scales`` (the router weights sent by the dispatch). Usage:
    vllm_ascend/ops/fused_moe/token_dispatcher.py (TokenDispatcherWithMC2)."""

    soc: str
    ep_world_sizes: tuple[int, ...] | None  # None: any (emulation profile / tests)
    hidden_sizes: tuple[int, ...] | None
    hidden_max: int | None
    hidden_multiple: int
    max_tokens: int  # BS: tokens a rank sends in one call
    max_top_k: int
    max_local_experts: int | None
    dtypes: tuple[torch.dtype, ...]
    combine_needs_dispatch_weights: bool  # A2
    max_experts: int = 512


MC2_A3 = Mc2Limits(soc="A3", ep_world_sizes=(8, 16, 32, 64, 128, 144, 256, 288), hidden_sizes=(7168,),
                   hidden_max=None, hidden_multiple=1, max_tokens=512, max_top_k=8, max_local_experts=None,
                   dtypes=HALF, combine_needs_dispatch_weights=False)
MC2_A2 = Mc2Limits(soc="A2", ep_world_sizes=(16, 32, 64), hidden_sizes=None, hidden_max=7168, hidden_multiple=32,
                   max_tokens=256, max_top_k=16, max_local_experts=24, dtypes=HALF,
                   combine_needs_dispatch_weights=True)


def mc2_for_device(device_name: str | None) -> Mc2Limits | None:
    """A3 chips report ``Ascend910_93xx``, A2 chips ``Ascend910B*``."""
    name = (device_name or "").replace(" ", "")
    if "910_93" in name:
        return MC2_A3
    if "910B" in name:
        return MC2_A2
    return None


A2_A3 = Limits(name="a2_a3", fixed_dims=True)
ASCEND_950 = Limits(
    name="950", fixed_dims=True, gating_experts=None, gating_max_experts=2048, gating_k_group=None,
    mc2_missing="no documented MC2 limits for Ascend 950 in the torch_npu docs",
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
    # A3's MC2 limits with H and dtype lifted (what parity_tests/npu_emulation/ops_ep.py emulates by default)
    mc2=dataclasses.replace(MC2_A3, soc="A3 (emulation: H and dtype lifted)", hidden_sizes=None, dtypes=ANY_FLOAT),
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
    mc2 = mc2_for_device(device_name)
    return A2_A3 if mc2 is None else dataclasses.replace(A2_A3, mc2=mc2)


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


def mc2_buffer_mb(m: Mc2Limits, tokens: int, hidden: int, ep_world_size: int, local_experts: int,
                  top_k: int) -> float:
    """The HCCL_BUFFSIZE (MB, CANN's default 200) the docs require before calling MC2 with BS = ``tokens``.
    A3: 1024^2 * (HCCL_BUFFSIZE - 2) / 2 >= BS * 2 * (H + 128) * (ep_world_size * local_expert_num + K + 1), and
    >= 2; A2 (fullmesh): >= 2 * (BS * ep_world_size * min(local_expert_num, K) * H * sizeof(uint16) + 2 MB)."""
    if m.combine_needs_dispatch_weights:
        return 2 * (tokens * ep_world_size * min(local_experts, top_k) * hidden * 2 / 2**20 + 2)
    return max(2.0, 2 + 2 * tokens * 2 * (hidden + 128) * (ep_world_size * local_experts + top_k + 1) / 2**20)


def decide_ep(lim: Limits, ep_world_size: int, hidden: int, top_k: int, dtype: torch.dtype, num_slots: int,
              token_bound: int | None, hccl_buffsize_mb: float = 200) -> Decision:
    """MC2 for ``ep_dispatch`` / ``ep_combine`` when every documented limit holds for every call, else the reference
    all-to-all. Every input is the same on every rank of the group (the choice is a collective's): ``token_bound``
    is the rank-agreed upper bound on the tokens any rank passes (``AscendKernelSet.ep_max_tokens_per_rank``); it
    becomes MC2's BS limit and its ``global_bs``. ``hccl_buffsize_mb``: CANN's HCCL_BUFFSIZE (set alike on every
    rank)."""
    m = lim.mc2
    if m is None:
        return Decision(False, f"MC2 not used: {lim.mc2_missing}")
    why = []
    if m.ep_world_sizes is not None and ep_world_size not in m.ep_world_sizes:
        why.append(f"ep_world_size {ep_world_size} (takes {m.ep_world_sizes})")
    if ep_world_size < 2:
        why.append("ep_world_size 1")
    if m.hidden_sizes is not None and hidden not in m.hidden_sizes:
        why.append(f"hidden {hidden} (takes {m.hidden_sizes})")
    if m.hidden_max is not None and not (0 < hidden <= m.hidden_max and hidden % m.hidden_multiple == 0):
        why.append(f"hidden {hidden} (takes <= {m.hidden_max}, a multiple of {m.hidden_multiple})")
    if not 0 < top_k <= min(m.max_top_k, num_slots):
        why.append(f"top_k {top_k} (takes <= {m.max_top_k})")
    if dtype not in m.dtypes:
        why.append(f"dtype {dtype} (takes fp16/bf16)")
    if num_slots > m.max_experts or num_slots % max(ep_world_size, 1):
        why.append(f"{num_slots} expert slots (takes <= {m.max_experts}, divisible by ep_world_size)")
    elif m.max_local_experts is not None and num_slots // ep_world_size > m.max_local_experts:
        why.append(f"{num_slots // ep_world_size} expert slots a rank (takes <= {m.max_local_experts})")
    if m.combine_needs_dispatch_weights:
        why.append("the combine takes the router weights from the dispatch (expand_scales); ep_dispatch has none")
    if token_bound is None:
        why.append("no rank-agreed bound on tokens per rank (a prefill step, or a call outside the engine's step loop "
                   "with AscendKernelSet.ep_max_tokens_per_rank unset)")
    elif not 0 < token_bound <= m.max_tokens:
        why.append(f"tokens per rank up to {token_bound} (BS takes <= {m.max_tokens})")
    elif ep_world_size > 1 and num_slots % ep_world_size == 0:
        need = mc2_buffer_mb(m, token_bound, hidden, ep_world_size, num_slots // ep_world_size, top_k)
        if hccl_buffsize_mb < need:
            why.append(f"HCCL_BUFFSIZE {hccl_buffsize_mb:g} MB < the {need:.0f} MB the docs require for "
                       f"{token_bound} tokens a rank")
    if why:
        return Decision(False, f"MC2 ({m.soc}) does not fit: " + ", ".join(why) + "; the reference all_to_all_single "
                        "path (host-read split sizes) runs instead")
    return Decision(True, f"torch_npu.npu_moe_distribute_dispatch / npu_moe_distribute_combine (MC2, {m.soc}) on a "
                    f"dedicated group; BS <= {token_bound} a rank, global_bs = {token_bound} x {ep_world_size}; "
                    "fixed shapes, no host read")


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
