"""CudaKernelSet: each HAL op on the implementation chosen for it once per engine (``backends/cuda/ops/``).

The op families (norms, linear, the MLA prolog / attention / epilogue, MoE routing, the grouped expert MLP, the
step's kernels) are selected when the engine starts: ``warmup(plan)`` (the worker, before any graph is captured)
or ``plan_for_model`` (``--list-ops``) decide, from the model's dtype and dims, the device and whether tilelang and
each kernel module import, which TileLang kernels serve this engine; a kernel set used without either decides at
its first call from the device alone, and imports each kernel module at its first use. The same objects list the
kernel configurations the warm-up compiles and tell :meth:`op_report` what each op runs. At a call only the step's
host-known shapes are checked (row counts, widths, the host bound on the query length), never device values, and
every path taken is remembered for the report and the sync guard.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.hal.types import DispatchState, GatingParams, KernelWarmupPlan, MLAWeights, RopeLike

from .branches import ParallelBranches
from .ep_deepep import DeepEPNormalMode
from .ops import FAMILIES, OpConfig, OpImpl
from .ops.base import KernelModules, PathLog, current_device_is_sm90, tilelang_importable
from .ops.mla_quant import MLAQuant
from .ops.quant import QuantOps

__all__ = ["CudaKernelSet", "tilelang_importable"]

_FALLBACK = {
    "copy_kv_blocks": "reference index_copy on CUDA tensors (fork copy-on-write); sync-free",
    "rope": "reference op on CUDA tensors (gather + elementwise); sync-free",
    # FP8 (quantization="fp8"): ops/quant.py's kernels, else the reference dequantises to fp32 on the device
    "fp8_linear": "reference op on CUDA tensors (dequantise both operands, fp32 matmul)",
    "fp8_grouped_mlp": "reference op on CUDA tensors (per-expert loop, syncs on the expert counts)",
    "w8a8_linear": "INT8 W8A8 is the Ascend scheme; reference op on CUDA tensors (int32 matmul)",
    "w8a8_grouped_mlp": "INT8 W8A8 is the Ascend scheme; reference op on CUDA tensors",
    "mla_prolog_quant": "reference op on CUDA tensors (quantised projections dequantised to fp32)",
    "mla_epilogue_quant": "reference op on CUDA tensors (quantised o_proj dequantised to fp32)",
}
_DEFAULT_FALLBACK = "reference op on CUDA tensors"

#: the op families (``ops.FAMILIES``) and the quantised-weight ops, in warm-up order
_FAMILIES = {**FAMILIES, "quant": QuantOps, "mla_quant": MLAQuant}


class CudaKernelSet(DeepEPNormalMode, CpuKernelSet):
    """Expert parallelism (``FixedCapacityAtDecode``, from the reference kernel set): ``ep_dispatch`` /
    ``ep_combine`` run the fixed-capacity all-to-all over NCCL (equal splits, no host read, capturable) for a step
    whose agreed token count is declared and at most ``ep_fixed_max_tokens``; else DeepEP's normal kernels where
    ``deep_ep`` is built (``ep_deepep.py``), else the reference's variable splits (one allowed host sync a
    layer)."""

    #: implementations left out of every selection, by kernel name (e.g. ``{"mla_absorb"}``): tests that compare a
    #: kernel with the path it replaces set it on the class before an engine is built
    SKIP: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.num_sms: int | None = None  # set by CudaBackend; read lazily otherwise
        self.modules = KernelModules()
        self.log = PathLog()
        self.branches = ParallelBranches()
        self.dispatch_scan: tuple[torch.Tensor, torch.Tensor] | None = None  # moe dispatch -> grouped_mlp
        self._impls: dict[str, OpImpl] = {name: cls(self) for name, cls in _FAMILIES.items()}
        self._by_op = {op: impl for impl in self._impls.values() for op in (*impl.PLANNED, *impl.FALLBACK)}
        self.config: OpConfig | None = None
        self.FALLBACK_REASONS = {**_FALLBACK, **{op: t for i in self._impls.values() for op, t in i.FALLBACK.items()}}

    # ---- selection -----------------------------------------------------------------------------------------
    def select(self, cfg: OpConfig) -> None:
        """Choose every op family's kernels for ``cfg`` (once per engine; again only with a new configuration)."""
        self.config = cfg
        for impl in self._impls.values():
            impl.select(cfg)

    def impl(self, family: str) -> OpImpl:
        """The implementation of ``family`` (``ops.FAMILIES``), chosen for the engine (from the device alone when
        nothing was planned before this first call)."""
        if self.config is None:
            self.select(OpConfig(sm90=current_device_is_sm90(), skip=self.SKIP))
        return self._impls[family]

    def plan_for_model(self, model_config, dtype: torch.dtype, block_size: int) -> None:
        self.select(OpConfig.from_model(model_config, dtype, block_size, current_device_is_sm90(), self.SKIP))

    def warmup(self, plan: KernelWarmupPlan) -> str:
        """Select for ``plan``, then compile every TileLang configuration the selection reaches
        (``backends/cuda/warmup.py``); a kernel module that fails to compile is turned off (its ops take their
        fallback, with the reason). -> one-line summary, also logged."""
        from .warmup import warm_up

        self.branches.prepare()  # run_parallel's stream, before any graph capture
        self.select(OpConfig.from_plan(plan, current_device_is_sm90(), self.SKIP))
        return warm_up(self, plan)

    def start_early_warmup(self, plan: KernelWarmupPlan) -> str | None:
        """The warm-up's builds started before the weights load (``backends/cuda/warmup.py`` ``start_early``)."""
        from .warmup import start_early

        return start_early(self, plan)

    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """``{kernels_cuda module: [config, ...]}`` of every selected family for ``plan``, merged in family
        order, empty ones left out."""
        merged: dict[str, list[tuple]] = {}
        for family in self._impls:
            for module, cfgs in self.impl(family).warmup_configs(plan, num_sms).items():
                merged[module] = list(dict.fromkeys([*merged.get(module, []), *cfgs]))
        return {module: cfgs for module, cfgs in merged.items() if cfgs}

    def sms(self, device: torch.device) -> int:
        if self.num_sms is None:
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return self.num_sms

    def quantization_capture_refusal(self, quantization: str | None, hidden_size: int = 0,
                                     moe_intermediate_size: int = 0) -> str | None:
        """Why decode graphs cannot capture this engine's quantised ops (their reference fallbacks read host
        values), or None: FP8 with the FP8 kernels selected and the experts' shapes on the grouped kernel
        (sync-free, capturable; a projection the GEMM does not take dequantises on the device, no sync); never
        INT8 W8A8."""
        if quantization is None:
            return None
        if quantization != "fp8":
            return f"quantization={quantization!r} runs the reference ops on CUDA"
        quant = self.impl("quant")
        off = quant.off  # fp8_quant, fp8_gemm, fp8_grouped_gemm: each one's absence is a fallback
        if off:
            return "; ".join(f"kernels_cuda.{name} off: {why}" for name, why in off.items())
        if moe_intermediate_size:
            return quant.grouped_shape_reason(hidden_size, moe_intermediate_size)
        return None

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def has_run(self) -> bool:
        """True once any op has been called (the model's first forward decides which paths are taken)."""
        return self.log.calls > 0

    def syncing_ops(self) -> dict[str, list[str]]:
        """Ops that took a path reading device values on the host, with those paths."""
        return self.log.syncing_ops()

    # ---- ops -----------------------------------------------------------------------------------------------
    def run_parallel(self, main, *side, rows: int | None = None):
        out = self.branches.run(main, side, rows)
        if out is None:
            return super().run_parallel(main, *side, rows=rows)
        self.log.note("run_parallel", "side branches on a second CUDA stream (fork/join events)", True)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.impl("norms").rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.impl("norms").add_rms_norm(x, residual, weight, eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.impl("linear").linear(x, weight, bias)

    def router_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.impl("linear").router_logits(hidden, weight)

    def dense_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return self.impl("linear").dense_mlp(x, gate_up, down)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl("linear").silu_and_mul(x)

    def rope(self, x, positions, cos_sin_cache, interleaved):
        self.log.note("rope", "reference", False)
        return super().rope(x, positions, cos_sin_cache, interleaved)

    def mla_prolog(self, hidden: torch.Tensor, w: MLAWeights, positions: torch.Tensor, rope: RopeLike,
                   kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.impl("mla_prolog").mla_prolog(hidden, w, positions, rope, kv_cache, slot_mapping)

    def mla_forward(self, hidden, w, positions, rope, kv_cache, attn, softmax_scale):
        out = self.impl("mla_prefill_mha").mla_forward(hidden, w, positions, rope, kv_cache, attn, softmax_scale)
        if out is None:
            return super().mla_forward(hidden, w, positions, rope, kv_cache, attn, softmax_scale)
        return out

    def mla_attention(self, q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q,
                      softmax_scale, host=None, max_seqlen_q: int | None = None,
                      is_prefill: bool | None = None) -> torch.Tensor:
        return self.impl("mla_attention").mla_attention(q_latent, q_rope, kv_cache, block_tables, seqlens_q,
                                                        seqlens_k, cu_seqlens_q, softmax_scale, host, max_seqlen_q,
                                                        is_prefill)

    def mla_epilogue(self, out_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
        return self.impl("mla_epilogue").mla_epilogue(out_latent, w)

    def moe_gating_topk(self, router_logits, bias, params: GatingParams):
        return self.impl("moe_routing").moe_gating_topk(router_logits, bias, params)

    def moe_route(self, router_logits, bias, params: GatingParams, hidden, num_experts: int):
        return self.impl("moe_routing").moe_route(router_logits, bias, params, hidden, num_experts)

    def moe_dispatch(self, hidden, ids, num_experts: int):
        return self.impl("moe_routing").moe_dispatch(hidden, ids, num_experts)

    def grouped_mlp(self, sorted_hidden, tokens_per_expert, w13, w2):
        return self.impl("grouped_mlp").grouped_mlp(sorted_hidden, tokens_per_expert, w13, w2)

    def moe_combine(self, expert_out, state: DispatchState, weights):
        return self.impl("moe_routing").moe_combine(expert_out, state, weights)

    def moe_combine_add(self, expert_out, state: DispatchState, weights, addend):
        return self.impl("moe_routing").moe_combine_add(expert_out, state, weights, addend)

    def fp8_linear(self, x, weight, weight_scale_inv, bias=None):
        return self.impl("quant").fp8_linear(x, weight, weight_scale_inv, bias)

    def fp8_dense_mlp(self, x, gate_up, gate_up_scale_inv, down, down_scale_inv):
        return self.impl("quant").fp8_dense_mlp(x, gate_up, gate_up_scale_inv, down, down_scale_inv)

    def fp8_grouped_mlp(self, sorted_hidden, tokens_per_expert, w13, w13_scale_inv, w2, w2_scale_inv):
        return self.impl("quant").fp8_grouped_mlp(sorted_hidden, tokens_per_expert, w13, w13_scale_inv, w2,
                                                  w2_scale_inv)

    def mla_prolog_quant(self, hidden, w, scales, positions, rope, kv_cache, slot_mapping):
        return self.impl("mla_quant").mla_prolog_quant(hidden, w, scales, positions, rope, kv_cache, slot_mapping)

    def mla_epilogue_quant(self, out_latent, w, scales):
        return self.impl("mla_quant").mla_epilogue_quant(out_latent, w, scales)

    def spec_verify(self, logits, draft_next, row_of_token, j_of_token, num_rows: int, max_q: int, t,
                    ban_mask=None):
        return self.impl("step").spec_verify(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t,
                                             ban_mask)

    def zos_fixup(self, seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None, caps=None):
        return self.impl("step").zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs, caps)

    def decode_inputs(self, seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts,
                      block_size: int, num_tokens: int):
        return self.impl("step").decode_inputs(seqlens_q, seqlens_k, block_tables, state_slots, first_ids,
                                               last_token, drafts, block_size, num_tokens)

    # ---- reporting -----------------------------------------------------------------------------------------
    def op_report(self) -> dict[str, str]:
        """Per op: ``native (...)`` when every call so far took a native path, ``fallback (...)`` when every call
        took the reference, ``native (...; fallback for ...)`` when both happened; before the first call, what the
        selection runs: ``pending (...)``, or ``fallback (...)`` where its kernel is off for this engine."""
        return {op: self._report(op) for op in self.OPS}

    def _report(self, op: str) -> str:
        impl: Any = self._by_op.get(op)
        paths = self.log.paths.get(op)
        if not paths:
            if impl is not None and op in impl.PLANNED:
                kernel = impl.PRIMARY.get(op)
                why = impl.off.get(kernel) if kernel else None
                return f"fallback (kernels_cuda.{kernel} off: {why})" if why else f"pending ({impl.PLANNED[op]})"
            return f"fallback ({self.FALLBACK_REASONS.get(op, _DEFAULT_FALLBACK)})"
        native = [p for p, (n, _s) in paths.items() if n]
        syncing = [p for p, (_n, s) in paths.items() if s]
        syncing_what = impl.SYNCING.get(op) if impl is not None else None
        fallback = []
        for p in (p for p, (n, _s) in paths.items() if not n):
            if p == "reference":
                fallback.append(self.FALLBACK_REASONS.get(op, _DEFAULT_FALLBACK))
            else:
                fallback.append(p + ("; syncs: " + syncing_what if p in syncing and syncing_what else ""))
        if native and fallback:
            return f"native ({'; '.join(native)}; fallback for {'; '.join(fallback)})"
        if native:
            return f"native ({'; '.join(native)})"
        return f"fallback ({'; '.join(fallback)})"
