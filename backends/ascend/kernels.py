"""AscendKernelSet: each HAL op on its torch_npu fused op when the documented limits fit, else the reference
(inherited from the CPU backend's ``CpuKernelSet``, the HAL's reference).

Decisions come from :mod:`.capabilities`, are taken at an op's first call from static facts (dims, dtype,
expert counts, block size) and memoised, so the plan is fixed by the model's first forward and never
re-evaluated per step. The ops with no fused equivalent (``zos_fixup``, ``spec_verify``) and gating
configurations outside ``npu_moe_gating_top_k``'s limits take the TileLang-Ascend kernels of ``kernels_ascend/``
when :func:`.tilelang_ascend.probe` finds them usable — decided once, at start-up — else the torch composition.
``op_report`` lists the decision per op with the op or kernel used or the reason for the fallback, plus how decode
graphs run on this backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from deepinfer_npu.backends.cpu import cache_ops as ref_cache_ops
from deepinfer_npu.backends.cpu import mla as ref_mla
from deepinfer_npu.backends.cpu import moe as ref_moe
from deepinfer_npu.backends.cpu import quant as ref_quant
from deepinfer_npu.backends.cpu import rope as ref_rope
from deepinfer_npu.backends.cpu import spec_verify as ref_spec_verify
from deepinfer_npu.backends.cpu import zos as ref_zos
from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.distributed.ep_decode_path import current_agreed_ep_tokens
from deepinfer_npu.hal.types import DispatchState, EPDispatched, GatingParams, MLAWeights, RopeLike

from . import capabilities as caps
from . import kv_layout, ops_dense, ops_ep, ops_mla, ops_moe, ops_quant, tilelang_ascend

NOT_RUN_NOTE = (
    "this backend has not yet run on an NPU (verified by CPU contract emulation only; docs/ascend.md)"
)
_FIXED = {
    "rms_norm": "torch_npu.npu_rms_norm",
    "add_rms_norm": "torch_npu.npu_add_rms_norm",
    "linear": "aten matmul (F.linear) on the NPU",
    "silu_and_mul": "torch_npu.npu_swiglu",
    "mla_epilogue": "aten bmm + matmul on the NPU",
    "copy_kv_blocks": "aten index_select + index_copy_ in the cache's layout (split k_nope / k_rope caches when "
    "the fused attention is used)",
}
GRAPHS_NOTE = (
    "NpuGraphRunner (torch.npu.NPUGraph per decode size; FIA host lengths re-issued per step with "
    "graph_task_update_begin/end): used only with enable_graphs=True; verified by the CPU contract emulation only, "
    "never captured or replayed on an NPU"
)


class AscendKernelSet(CpuKernelSet):
    FALLBACK_REASONS = {
        **CpuKernelSet.FALLBACK_REASONS,
        "decode_inputs": "the reference's aten ops on the NPU (backends/cpu/step_inputs.py; sync-free); no fused "
        "NPU kernel yet",
        # FP8 does not run on 910-class NPUs; the reference dequantises to fp32 on the device
        "fp8_linear": "FP8 not supported by 910-class NPUs; reference op (dequantise, fp32 matmul) on the device",
        "fp8_grouped_mlp": "FP8 not supported by 910-class NPUs; reference op on the device",
        "mla_prolog_quant": "no quantised MLA prolog yet; reference op on the device (the latents written in the "
        "attention's cache layout)",
        "mla_epilogue_quant": "no quantised MLA epilogue yet; reference op on the device",
    }
    #: Upper bound on how far a ZOS step's true key length may fall short of the host's optimistic one (the
    #: previous in-flight step's draft count, <= num_speculative_tokens). None: each request's queries are
    #: padded to the 16-row FIA window, which covers it whenever drafts_prev + drafts_now <= 15 (always for
    #: k <= 7); a ``HostLengths.max_kv_shortfall`` field, if the HAL grows one, takes precedence.
    kv_shortfall_bound: int | None = None

    def __init__(self, limits: caps.Limits | None = None) -> None:
        self.limits = limits
        #: The most tokens any rank of the EP group passes to one ``ep_dispatch`` while this value stands; it must be
        #: the same on every rank (set from the engine's token budget or the step vote's agreed maximum). MC2 needs
        #: it: its BS limit is checked against it and its ``global_bs`` (fixed output shapes) is sized by it. None:
        #: unknown, and the reference all-to-all runs.
        self.ep_max_tokens_per_rank: int | None = None
        self._mc2_comms: dict[int, tuple[object, ops_ep.Mc2Comm]] = {}  # id(EP group) -> (group, its MC2 domain)
        self._decisions: dict[str, caps.Decision] = {}
        self._memo: dict[tuple, caps.Decision] = {}
        # Caches written in the split k_nope / k_rope layout -> (L, R), so block copies use that layout.
        self._split_caches = WeakIdKeyDictionary()
        # TileLang-Ascend kernels (zos_fixup, spec_verify, gating): decided once (setup_tilelang;
        # AscendBackend calls it at start-up), None until then.
        self.tilelang: tilelang_ascend.TileLangAscendKernels | None = None
        self.tilelang_probe: tilelang_ascend.Probe | None = None

    # ---- TileLang-Ascend kernels ---------------------------------------------------------------------------
    def setup_tilelang(self, probe: tilelang_ascend.Probe | None = None,
                       kernels: tilelang_ascend.TileLangAscendKernels | None = None) -> tilelang_ascend.Probe:
        """Decide once whether zos_fixup / spec_verify (and gating outside the fused op's limits) run on the
        TileLang-Ascend kernels (``probe``: tilelang importable, its Ascend JIT path present, an NPU present) and
        record why. Tests may pass both a probe and ``kernels`` (e.g. the host C build of the same programs)."""
        self.tilelang_probe = probe if probe is not None else tilelang_ascend.probe()
        if self.tilelang_probe.usable:
            self.tilelang = kernels if kernels is not None else tilelang_ascend.TileLangAscendKernels("ascend")
        else:
            self.tilelang = None
        for op, what in tilelang_ascend.WIRED.items():
            if self.tilelang is not None:
                where = "host C build: tests only" if self.tilelang.target == "c" else "never run on an NPU"
                self._decisions[op] = caps.Decision(True, f"TileLang-Ascend {what} ({where})")
            else:
                self._decisions[op] = caps.Decision(
                    False, f"TileLang-Ascend {what} not usable here: {self.tilelang_probe.reason}; the torch "
                    "composition (reference op) runs on the device")
        # Gating decisions already taken (plan_for_model before the probe) are redone with the new decision.
        for key in [k for k in self._memo if k[0] == "moe_gating_topk"]:
            del self._memo[key]
        self._decisions.pop("moe_gating_topk", None)
        return self.tilelang_probe

    def _tl(self) -> tilelang_ascend.TileLangAscendKernels | None:
        if self.tilelang_probe is None:
            self.setup_tilelang()
        return self.tilelang

    # ---- decisions -----------------------------------------------------------------------------------------
    def _lim(self) -> caps.Limits:
        if self.limits is None:  # constructed outside AscendBackend (tests): ask the runtime once
            from . import runtime

            emulated = runtime.unavailable_reason() is None and runtime.emulated()  # no torch_npu: not emulated
            self.limits = caps.detect_profile(None, emulated)
        return self.limits

    def _decide(self, op: str, key: tuple, fn: Callable[[], caps.Decision]) -> caps.Decision:
        memo_key = (op, *key)
        if memo_key not in self._memo:
            self._memo[memo_key] = fn()
            self._decisions[op] = self._memo[memo_key]
        return self._memo[memo_key]

    def _rope_decision(self, interleaved: bool, rdim: int, dtype: torch.dtype) -> caps.Decision:
        return self._decide(
            "rope",
            (interleaved, rdim, dtype),
            lambda: caps.decide_rope(self._lim(), interleaved, rdim, dtype),
        )

    def _attn_decision(self, lrank: int, rdim: int, heads: int, block: int, dtype) -> caps.Decision:
        return self._decide(
            "mla_attention",
            (lrank, rdim, heads, block, dtype),
            lambda: caps.decide_attention(self._lim(), lrank, rdim, heads, block, dtype),
        )

    def _rope_fn(self, interleaved: bool, rdim: int, dtype: torch.dtype):
        return ops_dense.rope if self._rope_decision(interleaved, rdim, dtype).native else ref_rope.rope

    # ---- norms / dense -------------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ops_dense.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return ops_dense.add_rms_norm(x, residual, weight, eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return ops_dense.silu_and_mul(x)

    def rope(self, x, positions, cos_sin_cache, interleaved):
        return self._rope_fn(interleaved, x.shape[-1], x.dtype)(x, positions, cos_sin_cache, interleaved)

    # ---- MLA -----------------------------------------------------------------------------------------------
    def mla_prolog(
        self,
        hidden: torch.Tensor,
        w: MLAWeights,
        positions: torch.Tensor,
        rope: RopeLike,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rope_fn = self._rope_fn(rope.interleaved, w.qk_rope_head_dim, hidden.dtype)
        # The cache layout follows the attention decision, so writer and reader always agree.
        split = self._attn_decision(
            w.kv_lora_rank, w.qk_rope_head_dim, w.num_heads, kv_cache.shape[1], kv_cache.dtype
        ).native
        self._decisions.setdefault(
            "mla_prolog",
            caps.Decision(
                True,
                "composed: F.linear + torch_npu.npu_rms_norm + the rope op above + cache scatter "
                "(npu_mla_prolog_v2/_v3 not used: NZ weights, fixed dims, k_rope order)",
            ),
        )
        if split:
            self.register_split_cache(kv_cache, w.kv_lora_rank, w.qk_rope_head_dim)
        return ops_mla.mla_prolog(hidden, w, positions, rope, kv_cache, slot_mapping, rope_fn, split)

    def mla_prolog_quant(self, hidden, w: MLAWeights, scales, positions, rope: RopeLike, kv_cache, slot_mapping):
        """The reference's quantised prolog; its latents go into the layout the attention reads (split k_nope /
        k_rope when the fused attention runs), as ``mla_prolog`` writes them."""
        split = self._attn_decision(
            w.kv_lora_rank, w.qk_rope_head_dim, w.num_heads, kv_cache.shape[1], kv_cache.dtype
        ).native
        if not split:
            return ref_quant.mla_prolog_quant(hidden, w, scales, positions, rope, kv_cache, slot_mapping)
        self.register_split_cache(kv_cache, w.kv_lora_rank, w.qk_rope_head_dim)
        q_latent, q_rope, c_kv, k_pe = ref_quant.mla_prolog_quant_parts(hidden, w, scales, positions, rope)
        kv_layout.write_split(kv_cache, c_kv, k_pe, slot_mapping)
        return q_latent, q_rope

    def mla_attention(
        self, q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale, host=None,
        max_seqlen_q=None, is_prefill=None,
    ) -> torch.Tensor:
        # max_seqlen_q / is_prefill (the HAL's hints) are not needed: FIA takes per-request host lengths.
        d = self._attn_decision(
            q_latent.shape[-1], q_rope.shape[-1], q_latent.shape[1], kv_cache.shape[1], kv_cache.dtype
        )
        if not d.native:
            return ref_mla.mla_attention(
                q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale
            )
        return ops_mla.mla_attention_fia(
            q_latent,
            q_rope,
            kv_cache,
            block_tables,
            seqlens_q,
            seqlens_k,
            cu_seqlens_q,
            softmax_scale,
            self._lim().fia_max_q_per_request,
            host=host,
            shortfall_bound=self.kv_shortfall_bound,
        )

    # ---- KV cache blocks -----------------------------------------------------------------------------------
    def register_split_cache(self, kv_cache: torch.Tensor, latent_dim: int, rope_dim: int) -> None:
        """Mark ``kv_cache`` as stored in the split k_nope / k_rope layout (the native prolog does this on its
        first write; held weakly, by identity)."""
        self._split_caches[kv_cache] = (latent_dim, rope_dim)

    def copy_kv_blocks(self, caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Fork copy-on-write in each cache's own layout: split k_nope / k_rope caches (written by the native
        prolog) copy block by block in both parts; caches in the HAL layout take the reference ``index_copy_``."""
        if src.numel() == 0:
            return
        for cache in caches:
            dims = self._split_caches.get(cache)
            if dims is None:
                ref_cache_ops.copy_kv_blocks([cache], src, dst)
            else:
                kv_layout.copy_blocks_split(cache, dims[0], dims[1], src, dst)

    def mla_epilogue(self, out_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
        return ops_mla.mla_epilogue(out_latent, w)

    # ---- MoE -----------------------------------------------------------------------------------------------
    def _gating_decision(self, params: GatingParams, has_bias: bool) -> caps.Decision:
        """npu_moe_gating_top_k where its documented limits fit; else kernels_ascend.gating_topk when the start-up
        probe allowed the TileLang-Ascend kernels and the kernel takes the configuration; else the reference."""
        fused = caps.decide_gating(
            self._lim(),
            params.scoring_func,
            params.topk_method,
            params.norm_topk_prob,
            has_bias,
            params.num_experts,
            params.n_group,
            params.topk_group,
            params.top_k,
        )
        if fused.native:
            return fused
        tl = self._tl()
        native, use_kernel, detail = tilelang_ascend.gating_decision(
            fused.detail, self.tilelang_probe, tl.target if tl is not None else None, params)
        return caps.Decision(native, detail, tilelang=use_kernel)

    def moe_gating_topk(self, router_logits, bias, params: GatingParams):
        d = self._decide(
            "moe_gating_topk", (params, bias is not None), lambda: self._gating_decision(params, bias is not None)
        )
        if d.tilelang:
            return self._tl().moe_gating_topk(router_logits, bias, params)
        if not d.native:
            return ref_moe.moe_gating_topk(router_logits, bias, params)
        return ops_moe.moe_gating_topk(router_logits, bias, params)

    def moe_dispatch(self, hidden, ids, num_experts: int):
        d = self._decide(
            "moe_dispatch", (num_experts,), lambda: caps.decide_dispatch(self._lim(), num_experts)
        )
        if not d.native:
            return ref_moe.moe_dispatch(hidden, ids, num_experts)
        return ops_moe.moe_dispatch(hidden, ids, num_experts)

    def grouped_mlp(self, sorted_hidden, tokens_per_expert, w13, w2):
        d = self._decide("grouped_mlp", (w13.dtype,), lambda: caps.decide_grouped_mlp(self._lim(), w13.dtype))
        if not d.native:
            return ref_moe.grouped_mlp(sorted_hidden, tokens_per_expert, w13, w2)
        return ops_moe.grouped_mlp(sorted_hidden, tokens_per_expert, w13, w2)

    def w8a8_linear(self, x, weight, weight_scale, bias=None):
        d = self._decide("w8a8_linear", (x.dtype,), lambda: caps.decide_w8a8(self._lim(), x.dtype, grouped=False))
        if not d.native:
            return super().w8a8_linear(x, weight, weight_scale, bias)
        return ops_quant.w8a8_linear(x, weight, weight_scale, bias)

    def w8a8_grouped_mlp(self, sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale):
        d = self._decide("w8a8_grouped_mlp", (sorted_hidden.dtype,),
                         lambda: caps.decide_w8a8(self._lim(), sorted_hidden.dtype, grouped=True))
        if not d.native:
            return super().w8a8_grouped_mlp(sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale)
        return ops_quant.w8a8_grouped_mlp(sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale)

    def moe_combine(self, expert_out, state: DispatchState, weights):
        self._decisions.setdefault(
            "moe_combine",
            caps.Decision(
                True,
                "torch_npu.npu_moe_token_unpermute (after npu_moe_init_routing_v2; else the "
                "reference un-permute)",
            ),
        )
        return ops_moe.moe_combine(expert_out, state, weights)

    def spec_verify(self, logits, draft_next, row_of_token, j_of_token, num_rows: int, max_q: int, t,
                    ban_mask=None):
        tl = self._tl()
        if tl is not None:
            return tl.spec_verify(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t, ban_mask)
        return ref_spec_verify.spec_verify(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t, ban_mask)

    def zos_fixup(self, seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None, caps=None):
        tl = self._tl()
        if tl is not None:
            return tl.zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs, caps)
        return ref_zos.zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs, caps)

    # ---- expert parallelism: MC2 where its documented limits hold, else the reference all-to-all --------------
    def _ep_decision(self, hidden: torch.Tensor, slots: torch.Tensor, placement, group) -> caps.Decision:
        """From values every rank shares (the choice is a collective's): world size, hidden size, top-k, dtype,
        expert slots and the agreed token bound."""
        world = dist.get_world_size(group)
        if world != placement.ep_size:
            raise ValueError(f"the EP group has {world} ranks but the expert placement is for {placement.ep_size}")
        key = (world, hidden.shape[1], slots.shape[1], hidden.dtype, placement.num_slots, self._ep_token_bound(),
               ops_ep.hccl_buffsize_mb())
        d = self._decide("ep_dispatch", key, lambda: caps.decide_ep(self._lim(), *key))
        self._decisions["ep_dispatch"] = self._decisions["ep_combine"] = d
        return d

    def _ep_token_bound(self) -> int | None:
        """Tokens any rank passes to a MoE layer this step: ``ep_max_tokens_per_rank`` when set, else the decode
        step's size the engine declares (``distributed/ep_decode_path.agreed_ep_tokens``; None for prefill)."""
        if self.ep_max_tokens_per_rank is not None:
            return self.ep_max_tokens_per_rank
        return current_agreed_ep_tokens()

    def _mc2_comm(self, group, device: torch.device) -> ops_ep.Mc2Comm:
        entry = self._mc2_comms.get(id(group))
        if entry is None or entry[0] is not group:
            entry = (group, ops_ep.open_comm(group, device))
            self._mc2_comms[id(group)] = entry
        return entry[1]

    def ep_dispatch(self, hidden, slots, placement, group, weights=None) -> EPDispatched:
        if not self._ep_decision(hidden, slots, placement, group).native:
            return super().ep_dispatch(hidden, slots, placement, group, weights)
        return ops_ep.dispatch(hidden, slots, placement.num_slots, placement.slots_per_rank,
                               self._mc2_comm(group, hidden.device), self._ep_token_bound())

    def ep_combine(self, expert_out, dispatched: EPDispatched, weights, group) -> torch.Tensor:
        if isinstance(dispatched.state, ops_ep.Mc2State):
            return ops_ep.combine(expert_out, dispatched.state, weights)
        return super().ep_combine(expert_out, dispatched, weights, group)

    def ep_path_report(self) -> dict[str, str]:
        """``{"ep_dispatch": ..., "ep_combine": ...}`` for ``--list-ops``: the decision taken, else what decides it."""
        d = self._decisions.get("ep_dispatch")
        if d is not None:
            text = d.report()
        elif self._lim().mc2 is None:
            text = f"fallback (MC2 not used: {self._lim().mc2_missing}; the reference all_to_all_single)"
        else:
            text = (f"pending (MC2, {self._lim().mc2.soc}, at the first MoE forward when the EP world size, hidden "
                    "size, top-k, dtype, expert slots and ep_max_tokens_per_rank fit its documented limits; else "
                    "the reference all_to_all_single)")
        return {"ep_dispatch": text, "ep_combine": text}

    # ---- reporting -----------------------------------------------------------------------------------------
    def _plan(self, cfg, dtype: torch.dtype, block_size: int) -> dict[str, caps.Decision]:
        plan = caps.plan_for_config(self._lim(), cfg, dtype, block_size)
        if "moe_gating_topk" in plan:  # the same decision the op takes (fused op, TileLang kernel or reference)
            params = GatingParams(
                top_k=cfg.num_experts_per_tok,
                num_experts=cfg.n_routed_experts,
                scoring_func=cfg.scoring_func,
                topk_method=cfg.topk_method,
                n_group=cfg.n_group,
                topk_group=cfg.topk_group,
                norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor,
            )
            plan["moe_gating_topk"] = self._gating_decision(params, cfg.topk_method == "noaux_tc")
        return plan

    def plan_for_config(self, cfg, dtype: torch.dtype, block_size: int) -> dict[str, str]:
        """The decisions a model would get, before any forward (``--list-ops`` with a model, tests)."""
        return {op: d.report() for op, d in self._plan(cfg, dtype, block_size).items()}

    def plan_for_model(self, model_config, dtype, block_size: int) -> None:
        """The per-model decisions the ops would take at their first call (same functions), made now."""
        self._decisions.update(self._plan(model_config, dtype, block_size))

    def op_report(self) -> dict[str, str]:
        if self.tilelang_probe is None:
            self.setup_tilelang()
        report = {"note": NOT_RUN_NOTE, "profile": self._lim().name, "decode_graphs": GRAPHS_NOTE}
        for op in self.OPS:
            if op in _FIXED:
                report[op] = f"native ({_FIXED[op]})"
            elif op in self._decisions:
                report[op] = self._decisions[op].report()
            elif op in self.FALLBACK_REASONS:
                report[op] = f"fallback ({self.FALLBACK_REASONS[op]})"
            else:
                report[op] = "pending (decided at the op's first call from the model's shapes)"
        return report
