"""``fp8_linear`` and ``fp8_grouped_mlp`` on the FP8 kernels (DeepGEMM's numerics, Hopper).

``fp8_linear``: the activations quantised per 1 x 128 group by ``kernels_cuda.fp8_quant``, then
``kernels_cuda.fp8_gemm`` (swapped operands up to 64 rows, K in slices where N is narrow, 128 x 128 tiles above;
above 64 rows cuBLASLt's block-scaled ``torch._scaled_mm`` where an eager check of the shape and M % 4 on random
activations agreed with the tile kernel, ``scaled_mm.py``); two or three launches, no host read after that check.
``fp8_dense_mlp`` (dense layers, shared experts): the same two GEMMs with the SwiGLU fused into the second
quantisation (``fp8_quant`` gated); four launches.
At one row, weights of at most ``SKINNY_MAX_WEIGHTS`` values take ``kernels_cuda.fp8_skinny_gemm`` instead (the
quantisation inside the GEMM): a projection is one launch, a dense MLP two (the SwiGLU in the gate/up GEMM).
``fp8_grouped_mlp``: ``moe_gemm.expert_starts`` (or the dispatch's scan), the rows quantised, the w13 GEMM on
``kernels_cuda.fp8_grouped_gemm``, the SwiGLU fused into the second quantisation (``fp8_quant`` gated), the w2
GEMM; five launches, no host read, CUDA-graph capturable. Each runs on bf16 activations with K a multiple of 16 and
N of 64 on a Hopper GPU; anything else takes the CPU reference on the device (dequantise, fp32 matmul; the grouped
one loops over experts after ``tokens_per_expert.tolist()``, a sync), with the reason in the op report.
"""

from __future__ import annotations

import torch

from deepinfer_npu import envs
from deepinfer_npu.hal.types import KernelWarmupPlan

from .base import BF16, NOT_ON_DEVICE, OpConfig, OpImpl, kernel_module, known_syncing_fallback, ref, step_token_bounds
from .mla_prolog import fused_rows_planned
from .scaled_mm import ScaledMM

FP8 = torch.float8_e4m3fn
# fp8_skinny_gemm (the quantisation inside the GEMM, one launch a projection) serves the projections of one-row
# steps whose weights have at most SKINNY_MAX_WEIGHTS values: there the two-kernel path's launches cost more than
# the kernel's repeated quantisation (each CTA quantises the row); on an H200 it won up to 11 M (5632 x 2048; M =
# 2**20) and lost from 14 M (7168 x 2048) on (docs/kernels/fp8.md). DEEPINFER_FP8_SKINNY=0 turns it off.
SKINNY_MAX_ROWS = 1
SKINNY_MAX_WEIGHTS = 12 * 2**20


class QuantOps(OpImpl):
    KERNELS = ("fp8_quant", "fp8_gemm", "fp8_grouped_gemm", "fp8_skinny_gemm")
    PRIMARY = {"fp8_linear": "fp8_gemm", "fp8_grouped_mlp": "fp8_grouped_gemm"}
    PLANNED = {
        "fp8_linear": "kernels_cuda.fp8_quant + kernels_cuda.fp8_gemm (bf16 rows, K % 16 == 0, N % 64 == 0); "
        "else the reference (dequantise, fp32 matmul)",
        "fp8_grouped_mlp": "kernels_cuda.fp8_quant + kernels_cuda.fp8_grouped_gemm (w13, SwiGLU fused into the "
        "second quantisation, w2); else the reference (per-expert loop, syncs)",
    }
    SYNCING = {"fp8_grouped_mlp": "tokens_per_expert.tolist()"}

    def __init__(self, ks) -> None:
        super().__init__(ks)
        self.scaled_mm = ScaledMM()  # which FP8 shapes cuBLASLt's block-scaled GEMM serves, found on the device

    def refuses(self, name: str, cfg: OpConfig) -> str | None:
        if not cfg.sm90:
            return "FP8 wgmma kernels are built for Hopper (compute capability 9.x); not this device"
        if cfg.dtype is not None and cfg.dtype != BF16:
            return f"model dtype {cfg.dtype}: the FP8 kernels take bf16 activations"
        return None

    def _modules(self, x: torch.Tensor, gemm: str):
        """``(fp8_quant, gemm module, None)`` when both serve this call's activations, else ``(None, None, why)``."""
        if not x.is_cuda:
            return None, None, NOT_ON_DEVICE
        if x.dtype != BF16:
            return None, None, f"{x.dtype} activations: the FP8 kernels take bf16"
        quant, why = self.use("fp8_quant")
        if quant is None:
            return None, None, why
        mod, why = self.use(gemm)
        return (quant, mod, None) if mod is not None else (None, None, why)

    def _skinny(self, x2d: torch.Tensor, *weights: tuple[torch.Tensor, torch.Tensor, bool]):
        """kernels_cuda.fp8_skinny_gemm when it takes ``x2d``'s rows against every ``(weight, scale, gated)`` and
        every weight is small enough to gain from it, else None."""
        if not envs.FP8_SKINNY or x2d.dim() != 2 or not 0 < x2d.shape[0] <= SKINNY_MAX_ROWS:
            return None
        if any(w.numel() > SKINNY_MAX_WEIGHTS for w, _s, _g in weights):
            return None
        mod, _why = self.use("fp8_skinny_gemm")
        if mod is None:
            return None
        (w, scale, gated), *rest = weights
        if mod.reason(x2d, w, scale, gated) is not None:
            return None
        if any(mod.weight_reason(*more) is not None for more in rest):
            return None
        return mod

    # ---- ops -----------------------------------------------------------------------------------------------
    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        quant, gemm, why = self._modules(x, "fp8_gemm")
        n, k = weight.shape
        if gemm is not None:
            why = gemm.reason(1, n, k) or (None if weight.dtype == FP8 else f"weight dtype {weight.dtype}")
        if why is not None:
            self.note("fp8_linear", f"reference ({why})", False)
            return ref("quant").fp8_linear(x, weight, weight_scale_inv, bias)
        x2d = x.reshape(-1, k)
        skinny = self._skinny(x2d, (weight, weight_scale_inv, False))
        if skinny is not None:
            self.note("fp8_linear", "kernels_cuda.fp8_skinny_gemm (one row: the quantisation inside the GEMM)", True)
            out = skinny.fp8_skinny_gemm(x2d, weight, weight_scale_inv)
        else:
            out = self._linear(quant, gemm, x2d, weight, weight_scale_inv)
        if bias is not None:
            out = out.float().add_(bias.float()).to(x.dtype)  # rounded twice (the reference rounds the fp32 sum once)
        return out.view(*x.shape[:-1], n)

    def fp8_dense_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale_inv: torch.Tensor,
                      down: torch.Tensor, down_scale_inv: torch.Tensor) -> torch.Tensor:
        """Dense layers and shared experts: quantise, gate/up GEMM, the SwiGLU fused into the second quantisation
        (``fp8_quant`` gated: the roundings of ``silu_and_mul``, then the quantisation), down GEMM; where the
        kernels do not take it, ``fp8_linear`` / ``silu_and_mul`` / ``fp8_linear``."""
        ks = self.ks
        quant, gemm, why = self._modules(x, "fp8_gemm")
        inter = down.shape[1]
        if gemm is not None:
            why = (gemm.reason(1, *gate_up.shape) or gemm.reason(1, *down.shape)
                   or quant_reason(quant, gate_up.shape[1], inter)
                   or (None if gate_up.dtype == down.dtype == FP8 else f"weight dtype {gate_up.dtype}")
                   or (None if gate_up.shape[0] == 2 * inter else f"gate_up {list(gate_up.shape)} for I={inter}"))
        if why is not None:  # the parts report their own paths
            return ks.fp8_linear(ks.silu_and_mul(ks.fp8_linear(x, gate_up, gate_up_scale_inv)), down, down_scale_inv)
        x2d = x.reshape(-1, x.shape[-1])
        skinny = self._skinny(x2d, (gate_up, gate_up_scale_inv, True), (down, down_scale_inv, False))
        if skinny is not None:
            self.note("silu_and_mul", "kernels_cuda.fp8_skinny_gemm gated (one row: SwiGLU in the gate/up GEMM)", True)
            self.note("fp8_linear", "kernels_cuda.fp8_skinny_gemm (one row: the quantisation inside the GEMM)", True)
            h = skinny.fp8_skinny_gemm(x2d, gate_up, gate_up_scale_inv, gated=True)
            return skinny.fp8_skinny_gemm(h, down, down_scale_inv).view(*x.shape[:-1], down.shape[0])
        self.note("silu_and_mul", "kernels_cuda.fp8_quant gated (FP8 MLPs: SwiGLU fused into the down projection's "
                  "quantisation)", True)
        h = self._linear(quant, gemm, x2d, gate_up, gate_up_scale_inv)
        out = self._linear(quant, gemm, h, down, down_scale_inv, gated=True)
        return out.view(*x.shape[:-1], down.shape[0])

    def _linear(self, quant, gemm, x2d, weight, scale, gated: bool = False) -> torch.Tensor:
        """The activations quantised by fp8_quant (``gated``: after the SwiGLU), then the FP8 GEMM: past the swapped
        form's rows cuBLASLt's block-scaled GEMM where it was checked on the device (``scaled_mm.py``), else
        fp8_gemm."""
        rows = x2d.shape[0]
        aq, sa = quant.quantize(x2d, gated=gated)
        if rows > gemm.SWAP_MAX_ROWS and self.scaled_mm.available() is None:
            out, why = self.scaled_mm.gemm(aq, sa, weight, scale, lambda a, s: gemm.fp8_gemm(a, s, weight, scale))
            if out is not None:
                self.note("fp8_linear", f"kernels_cuda.fp8_quant + torch._scaled_mm (cuBLASLt block scales, rows > "
                          f"{gemm.SWAP_MAX_ROWS})", True)
                return out
            if why in self.scaled_mm.errors.values():  # refused or disagreed (not: not checked yet, in a capture)
                self.note("fp8_linear", f"kernels_cuda.fp8_quant + kernels_cuda.fp8_gemm ({why})", True)
                return gemm.fp8_gemm(aq, sa, weight, scale)
        self.note("fp8_linear", "kernels_cuda.fp8_quant + kernels_cuda.fp8_gemm", True)
        return gemm.fp8_gemm(aq, sa, weight, scale)

    def fp8_grouped_mlp(self, sorted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor,
                        w13_scale_inv: torch.Tensor, w2: torch.Tensor, w2_scale_inv: torch.Tensor) -> torch.Tensor:
        why = self._grouped_reason(sorted_hidden, tokens_per_expert, w13, w2)
        if why is not None:
            self.note("fp8_grouped_mlp", f"reference ({why})", False, syncs=sorted_hidden.is_cuda)
            with known_syncing_fallback():
                return ref("quant").fp8_grouped_mlp(sorted_hidden, tokens_per_expert, w13, w13_scale_inv, w2,
                                                    w2_scale_inv)
        quant, gg = self.modules.get("fp8_quant"), self.modules.get("fp8_grouped_gemm")
        grouped = self.ks.impl("grouped_mlp")
        starts = grouped.expert_starts(self.modules.get("moe_gemm"), tokens_per_expert)  # the dispatch's scan
        self.note("fp8_grouped_mlp", "kernels_cuda.fp8_quant + kernels_cuda.fp8_grouped_gemm (w13, gated quant, "
                  "w2)", True)
        h = gg.fp8_grouped_gemm(*quant.quantize(sorted_hidden), w13, w13_scale_inv, starts)
        return gg.fp8_grouped_gemm(*quant.quantize(h, gated=True), w2, w2_scale_inv, starts)

    def _grouped_reason(self, sorted_hidden, tokens_per_expert, w13, w2) -> str | None:
        quant, gg, why = self._modules(sorted_hidden, "fp8_grouped_gemm")
        if why is not None:
            return why
        if w13.dtype != FP8 or w2.dtype != FP8:
            return f"expert weights {w13.dtype} / {w2.dtype}: expected float8_e4m3fn"
        if sorted_hidden.shape[0] == 0:
            return "no rows"
        mg = self.modules.get("moe_gemm")  # expert_starts: the row scan shared with the bf16 grouped GEMMs
        if mg is None:
            return self.modules.error("moe_gemm")
        if w13.shape[0] > mg.MAX_EXPERTS:
            return f"{w13.shape[0]} experts: the expert scan takes at most {mg.MAX_EXPERTS}"
        return grouped_shape_reason(gg, quant, w2.shape[1], w2.shape[2])  # w2 [E, D, I]; w13 [E, 2I, D]

    def grouped_shape_reason(self, d: int, inter: int) -> str | None:
        """Why experts of hidden size ``d`` and width ``inter`` take the reference grouped op, or None."""
        return grouped_shape_reason(kernel_module("fp8_grouped_gemm"), kernel_module("fp8_quant"), d, inter)

    # ---- warm-up -------------------------------------------------------------------------------------------
    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """``fp8_quant`` at the latent width for a packed FP8 cache; for an FP8 model (``plan.quantization ==
        "fp8"``), at every row count a step can have: ``fp8_gemm``
        for each FP8 projection ``(N, K)`` of ``plan.fp8_linear_shapes`` (and of ``plan.fp8_one_row_shapes``, the
        fused q / kv_a weight: at one row, or at every row count with ``mla_prolog.fused_rows_planned``, its two
        parts then at none) and ``fp8_quant`` at its K;
        ``fp8_grouped_gemm`` for w13 / w2 and ``fp8_quant`` at D and (gated) I; ``moe_gemm``'s expert scan."""
        if plan.dtype != BF16:
            return {}
        lo, hi = step_token_bounds(plan)
        out: dict[str, list[tuple]] = {"fp8_quant": [], "fp8_gemm": [], "fp8_grouped_gemm": []}
        fq = kernel_module("fp8_quant")
        if plan.kv_cache_fp8 and self.wants("fp8_quant") and self.ks.impl("mla_prolog").rope_cache_applies(plan):
            # a packed FP8 cache's latents (MLAProlog._rope_and_fp8_cache)
            out["fp8_quant"] += [fq.config_for(plan.kv_lora_rank, m) for m in range(lo, hi + 1)]
        if plan.quantization != "fp8":
            return {name: list(dict.fromkeys(cfgs)) for name, cfgs in out.items() if cfgs}
        if self.wants("fp8_gemm"):
            fg = kernel_module("fp8_gemm")
            # the fused q / kv_a weight: at one row, and at every row count where the prolog runs it then (and
            # q_proj and kv_a_proj, its parts, nowhere)
            every_row = fused_rows_planned(plan)
            parts = fused_parts(plan) if every_row else set()
            shapes = [(n, k, range(lo, hi + 1)) for n, k in plan.fp8_linear_shapes if (n, k) not in parts]
            fused = range(lo, hi + 1) if every_row else range(1, 2 if lo <= 1 else 1)
            shapes += [(n, k, fused) for n, k in plan.fp8_one_row_shapes]
            # fp8_dense_mlp's down projections, their SwiGLU fused into the quantisation
            gated = {(plan.hidden_size, inter) for inter in plan.mlp_intermediate_sizes if fq.supported(inter)}
            for n, k, rows in shapes:
                if not fg.supported(n, k):
                    continue
                for m in rows:
                    out["fp8_gemm"] += fg.configs_for(n, k, m)
                    out["fp8_quant"] += [fq.config_for(k, m)] + ([fq.config_for(k, m, True)] if (n, k) in gated else [])
        g, inter, d = plan.moe_gating, plan.moe_intermediate_size, plan.hidden_size
        if self.wants("fp8_grouped_gemm") and g is not None and inter:
            gg = kernel_module("fp8_grouped_gemm")
            if gg.supported(2 * inter, d) and gg.supported(d, inter) and fq.supported(d) and fq.supported(inter):
                rows = range(lo * g.top_k, hi * g.top_k + 1)
                out["fp8_grouped_gemm"] += [gg.config_for(n, k, m, g.num_experts) for n, k in
                                            ((2 * inter, d), (d, inter)) for m in rows]
                out["fp8_quant"] += [c for m in rows for c in (fq.config_for(d, m), fq.config_for(inter, m, True))]
                out["moe_gemm"] = [("expert_scan", (g.num_experts,))]
        out["fp8_skinny_gemm"] = self._skinny_configs(plan, lo)
        return {name: list(dict.fromkeys(cfgs)) for name, cfgs in out.items() if cfgs}

    def _skinny_configs(self, plan: KernelWarmupPlan, lo: int) -> list[tuple]:
        """``fp8_skinny_gemm`` where ``_skinny`` can send a step of ``lo`` or more tokens: each small FP8
        projection at one row, and the small dense MLPs' gate/up with the SwiGLU fused."""
        if not (envs.FP8_SKINNY and self.wants("fp8_skinny_gemm")) or lo > SKINNY_MAX_ROWS:
            return []
        fs = kernel_module("fp8_skinny_gemm")
        d = plan.hidden_size
        gate_ups = {(2 * i, d) for i in plan.mlp_intermediate_sizes}  # launched gated (below), never plain
        cfgs = [fs.config_for(k, 1, n_out=n) for n, k in (*plan.fp8_linear_shapes, *plan.fp8_one_row_shapes)
                if fs.supported(k) and n * k <= SKINNY_MAX_WEIGHTS and (n, k) not in gate_ups]
        cfgs += [fs.config_for(d, 1, gated=True, n_out=i) for i in plan.mlp_intermediate_sizes
                 if fs.supported(d) and 2 * i * d <= SKINNY_MAX_WEIGHTS]
        return cfgs


def fused_parts(plan: KernelWarmupPlan) -> set[tuple[int, int]]:
    """The (out, in) shapes of q_proj and kv_a_proj where the plan's fused FP8 weights hold them as row slices."""
    q_rows = plan.num_heads * (plan.qk_nope_head_dim + plan.qk_rope_head_dim)
    kv_rows = plan.kv_lora_rank + plan.qk_rope_head_dim
    if (q_rows + kv_rows, plan.hidden_size) not in plan.fp8_one_row_shapes:
        return set()
    return {(q_rows, plan.hidden_size), (kv_rows, plan.hidden_size)}


def grouped_shape_reason(gg, quant, d: int, inter: int) -> str | None:
    """Why the grouped kernel (``gg``) and the quantiser cannot take experts [2I, D] / [D, I], or None."""
    return gg.reason(2 * inter, d) or gg.reason(d, inter) or quant_reason(quant, d, inter)


def quant_reason(quant, d: int, inter: int) -> str | None:
    if not quant.supported(d) or not quant.supported(inter):
        return f"D={d}, I={inter}: fp8_quant needs multiples of {quant.MULT_K}"
    return None
