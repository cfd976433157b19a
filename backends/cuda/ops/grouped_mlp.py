"""``grouped_mlp``: the routed experts' SwiGLU MLP over contiguous row groups, by the step's row count (tokens x
top-k, a host int): up to ``DEEPINFER_MOE_SWAP_MAX_ROWS`` ``kernels_cuda.moe_gemm_swap`` (weight tiles on wgmma's M
side, the SwiGLU in the w13 epilogue); up to ``MOE_GEMM_MAX_ROWS`` ``kernels_cuda.moe_gemm`` (one CTA per expert and N
tile streaming the hit experts' weights, the SwiGLU in the w13 epilogue unless ``DEEPINFER_MOE_GEMM_GATED=0``; at
most ``MAX_EXPERTS`` experts); above, ``torch._grouped_mm`` (CUTLASS,
device offsets); else the reference, which loops over experts after ``tokens_per_expert.tolist()`` (a sync)."""

from __future__ import annotations

import torch

from deepinfer_npu import envs
from deepinfer_npu.hal.types import KernelWarmupPlan

from .base import BF16, OpImpl, kernel_module, known_syncing_fallback, logger, ref, step_token_bounds
from .linear import silu_mul_row_configs

# moe_gemm re-reads an expert's weight tile per 64-row block, so prefill-sized batches go to the library GEMM
MOE_GEMM_MAX_ROWS = 2048
# moe_gemm_swap (the weight tile as wgmma's M side, 8-32 rows as its N side, the SwiGLU fused) up to this mean of rows
# an expert: on an H200 (V2-Lite experts, 64 of them, top-6) it ran 1.07-1.01x moe_gemm + silu_mul from 16 to 200
# tokens (up to 18.75 rows an expert), 0.99x at 256 (24 rows)
SWAP_MAX_ROWS_AN_EXPERT = 20


def swap_max_rows(num_experts: int, setting: int | None) -> int:
    """Dispatched rows up to which grouped_mlp takes moe_gemm_swap: ``setting`` (``DEEPINFER_MOE_SWAP_MAX_ROWS``,
    read when the kernel set is made), None (auto) for 20 an expert."""
    return SWAP_MAX_ROWS_AN_EXPERT * num_experts if setting is None else setting


class GroupedMLP(OpImpl):
    KERNELS = ("moe_gemm", "moe_gemm_swap")
    PRIMARY = {"grouped_mlp": "moe_gemm"}
    PLANNED = {"grouped_mlp": f"kernels_cuda.moe_gemm for bf16 with rows <= {MOE_GEMM_MAX_ROWS}; torch._grouped_mm "
               "for larger bf16 batches; else the reference (syncs)"}
    SYNCING = {"grouped_mlp": "tokens_per_expert.tolist()"}

    def __init__(self, ks) -> None:
        super().__init__(ks)
        self._grouped_mm_error: str | None = None
        self.swap_setting: int | None = envs.MOE_SWAP_MAX_ROWS  # once: the warm-up and the steps agree
        self.gated_setting: bool = envs.MOE_GEMM_GATED

    def _grouped_mm_reason(self, sorted_hidden, w13, w2) -> str | None:
        if not sorted_hidden.is_cuda:
            return "tensor not on a CUDA device"
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        if self._grouped_mm_error is not None:
            return self._grouped_mm_error
        if sorted_hidden.dtype != BF16 or w13.dtype != BF16 or w2.dtype != BF16:
            return f"{sorted_hidden.dtype}: torch._grouped_mm path is bf16-only"
        d, inter = w13.shape[2], w2.shape[2]
        if d % 8 or inter % 8:  # 16-byte row alignment of A, B and the intermediate
            return f"D={d}, I={inter}: grouped GEMM needs multiples of 8"
        return None

    def moe_gemm_for(self, sorted_hidden, w13, w2):
        """``kernels_cuda.moe_gemm`` when it fits (bf16 on CUDA, decode-sized row counts, tile-aligned dims)."""
        rows = sorted_hidden.shape[0]
        if not (sorted_hidden.is_cuda and 0 < rows <= MOE_GEMM_MAX_ROWS):
            return None
        if not (sorted_hidden.dtype == w13.dtype == w2.dtype == BF16):
            return None
        mod = self.use("moe_gemm")[0]
        if mod is None or not (mod.supported(w13.shape[1], w13.shape[2]) and mod.supported(w2.shape[1], w2.shape[2])):
            return None
        if w13.shape[0] > getattr(mod, "MAX_EXPERTS", w13.shape[0]):  # expert_scan: one thread an expert
            return None
        return mod

    def expert_starts(self, mg, tokens_per_expert):
        """``moe_gemm.expert_starts(tokens_per_expert)``, or the scan the dispatch wrote with these very counts
        (one launch a layer fewer)."""
        stash, self.ks.dispatch_scan = self.ks.dispatch_scan, None  # used once: nothing kept alive past the layer
        if stash is not None and stash[0] is tokens_per_expert:
            return stash[1]
        return mg.expert_starts(tokens_per_expert)

    def _moe_gemm_swap_for(self, w13, w2):
        mod = self.use("moe_gemm_swap")[0]
        if mod is None or not (mod.supported(w13.shape[1], w13.shape[2], True)
                               and mod.supported(w2.shape[1], w2.shape[2], False)):
            return None
        return mod

    def gated(self, mg, gate_up_rows: int, hidden: int) -> bool:
        """Whether moe_gemm's w13 launch ([E, 2I, D]: ``gate_up_rows`` = 2I, ``hidden`` = D) fuses the SwiGLU
        (``DEEPINFER_MOE_GEMM_GATED`` and the kernel's dims)."""
        return self.gated_setting and mg.supported(gate_up_rows, hidden, True)

    def grouped_mlp(self, sorted_hidden, tokens_per_expert, w13, w2):
        rows = sorted_hidden.shape[0]  # host int: the dispatched rows (tokens x top-k)
        mg = self.moe_gemm_for(sorted_hidden, w13, w2)
        cap = swap_max_rows(w13.shape[0], self.swap_setting)
        sw = self._moe_gemm_swap_for(w13, w2) if mg is not None and rows <= cap else None
        if sw is not None:  # a few rows an expert: weight tiles on wgmma's M side, SwiGLU fused (2 launches + scan)
            starts = self.expert_starts(mg, tokens_per_expert)
            h = sw.moe_gemm_swap(sorted_hidden, w13, starts, gated=True)
            out = sw.moe_gemm_swap(h, w2, starts)
            self.note("grouped_mlp", f"kernels_cuda.moe_gemm_swap (bf16, rows <= {cap}, SwiGLU "
                      "in the w13 epilogue)", True)
            return out
        if mg is not None:
            starts = self.expert_starts(mg, tokens_per_expert)  # once for both GEMMs
            if self.gated(mg, w13.shape[1], w13.shape[2]):
                h = mg.moe_gemm(sorted_hidden, w13, tokens_per_expert, starts=starts, gated=True)
                form = ", SwiGLU in the w13 epilogue"
            else:
                h = self.ks.silu_and_mul(mg.moe_gemm(sorted_hidden, w13, tokens_per_expert, starts=starts))
                form = ", then silu_mul"
            out = mg.moe_gemm(h, w2, tokens_per_expert, starts=starts)
            self.note("grouped_mlp", f"kernels_cuda.moe_gemm (bf16, rows <= {MOE_GEMM_MAX_ROWS}{form})", True)
            return out
        why = self._grouped_mm_reason(sorted_hidden, w13, w2)
        if why is None and rows > 0:
            try:
                offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
                h = torch._grouped_mm(sorted_hidden.contiguous(), w13.transpose(1, 2), offs=offs)
                h = self.ks.silu_and_mul(h)
                out = torch._grouped_mm(h.contiguous(), w2.transpose(1, 2), offs=offs)
                self.note("grouped_mlp", "torch._grouped_mm (bf16 grouped GEMM, device offsets)", True)
                return out
            except Exception as e:  # noqa: BLE001 - disable for good, run the reference
                self._grouped_mm_error = f"torch._grouped_mm failed: {type(e).__name__}: {str(e)[:160]}"
                logger.warning("cuda backend: %s; grouped_mlp falls back to the reference", self._grouped_mm_error)
                why = self._grouped_mm_error
        self.note("grouped_mlp", f"reference ({why or 'empty'})", False, syncs=sorted_hidden.is_cuda)
        with known_syncing_fallback():
            return ref("moe").grouped_mlp(sorted_hidden, tokens_per_expert, w13, w2)

    # ---- warm-up -------------------------------------------------------------------------------------------
    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """``silu_mul`` at the expert width where a step's rows reach it (:meth:`_expert_silu_rows`); ``moe_gemm``:
        ``("gemm", get_kernel's arguments)`` for w13 [E, 2I, D] (gated: ``(2I, D, 64, 3, True)``) and w2 [E, D, I]
        at the row counts routed to it and ``("expert_scan", (E,))`` (compiled by its first launch);
        ``moe_gemm_swap``: w13 (gated) and w2 at the row counts up to :func:`swap_max_rows`, where moe_gemm (whose
        scan it shares) applies. Nothing for a quantised model: its experts never reach these kernels."""
        g = plan.moe_gating
        out: dict[str, list[tuple]] = {}
        if plan.quantization is not None:  # quantised experts run the scheme's grouped MLP (DeepseekMoE.experts_mlp)
            return out
        gemm = self._moe_gemm_configs(plan, self.gated_setting) if self.wants("moe_gemm") else []
        swap = self._moe_gemm_swap_configs(plan, self.swap_setting) if gemm and self.wants("moe_gemm_swap") else []
        if g is not None and plan.moe_intermediate_size and self.ks.impl("linear").wants("silu_mul"):
            lo, hi = self._expert_silu_rows(plan, bool(gemm), bool(swap))
            cfgs = silu_mul_row_configs(plan, plan.moe_intermediate_size, lo, hi) if lo is not None else []
            if cfgs:
                out["silu_mul"] = cfgs
        if gemm:
            out["moe_gemm"] = gemm
        if swap:
            out["moe_gemm_swap"] = swap
        return out

    def _expert_silu_rows(self, plan: KernelWarmupPlan, gemm: bool, swap: bool) -> tuple[int | None, int | None]:
        """(fewest, most) dispatched rows a step that run ``silu_mul`` at the expert width, or (None, None): every
        row count where neither moe_gemm_swap nor the gated moe_gemm applies (``grouped_mlp``'s routing)."""
        g = plan.moe_gating
        lo, hi = step_token_bounds(plan)
        lo, hi = lo * g.top_k, hi * g.top_k
        if not gemm:  # torch._grouped_mm or the reference at every size, then silu_mul
            return lo, hi
        gated = self.gated(kernel_module("moe_gemm"), 2 * plan.moe_intermediate_size, plan.hidden_size)
        fused_up_to = MOE_GEMM_MAX_ROWS if gated else (
            min(swap_max_rows(g.num_experts, self.swap_setting), MOE_GEMM_MAX_ROWS) if swap else 0)
        first = max(lo, fused_up_to + 1)
        return (first, hi) if first <= hi else (None, None)

    def _moe_gemm_configs(self, plan: KernelWarmupPlan, gated: bool) -> list[tuple]:
        """w13 (gated where :meth:`gated` takes it) and w2 at the row counts moe_gemm runs: past moe_gemm_swap's
        (where that applies), up to ``MOE_GEMM_MAX_ROWS``."""
        g = plan.moe_gating
        if g is None or plan.dtype != BF16 or not plan.moe_intermediate_size:
            return []
        mg = kernel_module("moe_gemm")
        d, inter = plan.hidden_size, plan.moe_intermediate_size
        if not (mg.supported(2 * inter, d) and mg.supported(d, inter)):
            return []
        if g.num_experts > mg.MAX_EXPERTS:  # grouped_mlp takes torch._grouped_mm (the expert scan's limit)
            return []
        lo, hi = step_token_bounds(plan)
        rows = range(lo * g.top_k, min(hi * g.top_k, MOE_GEMM_MAX_ROWS) + 1)
        if gated and mg.supported(2 * inter, d, True):  # the launch's own key: get_kernel's arguments
            items = [("gemm", (2 * inter, d, mg.pick_block_n(2 * inter, 0, True), 3, True))]
        else:
            items = [("gemm", (2 * inter, d, bn)) for bn in sorted({mg.pick_block_n(2 * inter, r) for r in rows})]
        items += [("gemm", (d, inter, bn)) for bn in sorted({mg.pick_block_n(d, r) for r in rows})]
        items.append(("expert_scan", (g.num_experts,)))
        return items

    @staticmethod
    def _moe_gemm_swap_configs(plan: KernelWarmupPlan, setting: int | None) -> list[tuple]:
        g, inter, d = plan.moe_gating, plan.moe_intermediate_size, plan.hidden_size
        sw = kernel_module("moe_gemm_swap")
        if not (sw.supported(2 * inter, d, True) and sw.supported(d, inter, False)):
            return []
        lo, hi = step_token_bounds(plan)
        rows = range(lo * g.top_k, min(hi * g.top_k, swap_max_rows(g.num_experts, setting), MOE_GEMM_MAX_ROWS) + 1)
        e = g.num_experts
        cfgs = [c for r in rows
                for c in (sw.config_for(2 * inter, d, r, True, e), sw.config_for(d, inter, r, False, e))]
        return list(dict.fromkeys(cfgs))
