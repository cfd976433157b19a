"""``linear`` (with the composites ``router_logits`` and ``dense_mlp``) and ``silu_and_mul``.

One row (batch-1 decode; ``skinny_gemm.engine_reason``: K <= DENSE_MAX_K, no bias) runs ``kernels_cuda.skinny_gemm``
(weights streamed by CUDA cores, one launch), the dense MLP with the SwiGLU in its gate/up GEMM's epilogue; more
rows run cuBLAS (the reference op). ``silu_and_mul``: ``kernels_cuda.silu_mul`` for bf16 with I a multiple of 8.
"""

from __future__ import annotations

import torch

from deepinfer_npu import envs
from deepinfer_npu.hal.types import KernelWarmupPlan

from .base import BF16, NOT_ON_DEVICE, OpImpl, kernel_module, ref, step_token_bounds
from .router_gemm import RouterGemm

# The router's fp32 GEMM on bf16 rows takes skinny_gemm up to this many rows: measured on an H200 (V2-Lite router,
# 64 x 2048, graph replays) 7.3 us at 16 rows against 9.9 us for cuBLAS' fp32 GEMM, which also needs the rows cast
# to fp32 first (one more launch); at 64 rows skinny_gemm took 27 us against 11.6.
ROUTER_SKINNY_MAX_ROWS = 16


class Linear(OpImpl):
    KERNELS = ("skinny_gemm", "silu_mul")
    PRIMARY = {"linear": "skinny_gemm", "silu_and_mul": "silu_mul"}
    PLANNED = {
        "linear": "kernels_cuda.skinny_gemm for 1-row steps (K <= 8192, no bias); else F.linear on cuBLAS",
        "silu_and_mul": "kernels_cuda.silu_mul for bf16 with I a multiple of 8; else the reference (sync-free)",
    }
    FALLBACK = {"linear": "reference op on CUDA tensors: F.linear -> cuBLAS; sync-free"}

    def __init__(self, ks) -> None:
        super().__init__(ks)
        self.router_gemm = RouterGemm()

    def skinny(self, x2d: torch.Tensor, weight: torch.Tensor, gated: bool = False, grouped: bool = False):
        """(kernels_cuda.skinny_gemm, None) when it takes these operands, else (None, why); also the MLA prolog's
        and epilogue's one-token GEMMs."""
        if not x2d.is_cuda:
            return None, NOT_ON_DEVICE
        mod, why = self.use("skinny_gemm")
        if mod is None:
            return None, why
        why = mod.reason(x2d, weight, gated, grouped) if grouped else mod.engine_reason(x2d, weight, gated)
        return (mod, None) if why is None else (None, why)

    def note_skinny_linear(self, mod) -> None:
        self.note("linear", f"kernels_cuda.skinny_gemm (rows <= {mod.DENSE_MAX_ROWS})", True)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if bias is not None or x.dtype != weight.dtype:  # the reference's contract (F.linear): one dtype
            mod = None
        else:
            mod, _why = self.skinny(x2d, weight)
        if mod is None:
            self.note("linear", "reference", False)
            return ref("linear").linear(x, weight, bias)
        self.note_skinny_linear(mod)
        return mod.skinny_gemm(x2d, weight).view(*x.shape[:-1], weight.shape[0])

    def router_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Up to ROUTER_SKINNY_MAX_ROWS bf16 rows and an fp32 router: skinny_gemm on the bf16 rows (exact fp32
        conversion in the kernel, fp32 out), no cast launch; more rows with ``DEEPINFER_ROUTER_TENSOR_CORES=1``:
        bf16 tensor-core GEMMs of the weight's exact bf16 split (``router_gemm.py``); else
        ``linear(hidden.float(), weight)``."""
        mod = self.router_skinny(hidden, weight)
        if mod is None:
            if envs.ROUTER_TENSOR_CORES and hidden.is_cuda:
                out = self.router_gemm.logits(hidden, weight)
                if out is not None:
                    self.note("linear", "cuBLAS bf16 GEMM, fp32 out (the fp32 router on bf16 rows skinny_gemm does "
                              "not take, its weight split into exact bf16 parts)", True)
                    return out
                why = self.router_gemm.reason(hidden, weight)
                if why is not None:
                    self.note("linear", f"reference (the fp32 router: {why})", False)
            return self.ks.linear(hidden.float(), weight)
        self.note("linear", f"kernels_cuda.skinny_gemm (the fp32 router on up to {ROUTER_SKINNY_MAX_ROWS} bf16 rows)",
                  True)
        return mod.skinny_gemm(hidden, weight)

    def router_skinny(self, hidden: torch.Tensor, weight: torch.Tensor):
        """kernels_cuda.skinny_gemm when it takes the router's GEMM (2-D bf16 rows on the device, at most
        ROUTER_SKINNY_MAX_ROWS, K <= its DENSE_MAX_K), else None."""
        if not hidden.is_cuda or hidden.dim() != 2 or not 0 < hidden.shape[0] <= ROUTER_SKINNY_MAX_ROWS:
            return None
        mod, _why = self.use("skinny_gemm")
        if mod is None or weight.shape[-1] > mod.DENSE_MAX_K or mod.reason(hidden, weight, False, False) is not None:
            return None
        return mod

    def dense_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        mod, _why = self.skinny(x, gate_up, gated=True) if x.dim() == 2 else (None, "not 2-D")
        if mod is None:
            ks = self.ks
            return ks.linear(ks.silu_and_mul(ks.linear(x, gate_up)), down)
        self.note("silu_and_mul", f"kernels_cuda.skinny_gemm gated (SwiGLU in the gate/up GEMM, rows <= "
                  f"{mod.DENSE_MAX_ROWS})", True)
        self.note_skinny_linear(mod)
        return self.ks.linear(mod.skinny_gemm(x, gate_up, gated=True), down)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        inter = x.shape[-1] // 2
        mod = None
        if not x.is_cuda:
            why = NOT_ON_DEVICE
        elif x.dtype != BF16:
            why = f"{x.dtype}: kernels_cuda.silu_mul is bf16-only"
        elif x.numel() == 0:
            why = "empty input"
        elif (found := self.use("silu_mul"))[0] is None:
            why = found[1]
        elif x.shape[-1] % 2 or not found[0].supported(inter):
            why = f"width {x.shape[-1]}: kernel needs 2*I with I a multiple of {found[0].MULT}"
        else:
            mod, why = found[0], None
        if why is not None:
            self.note("silu_and_mul", f"reference ({why})", False)
            return ref("linear").silu_and_mul(x)
        self.note("silu_and_mul", f"kernels_cuda.silu_mul (bf16, I={inter})", True)
        return mod.silu_and_mul(x)

    # ---- warm-up -------------------------------------------------------------------------------------------
    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        out = {}
        if self.wants("skinny_gemm"):
            out["skinny_gemm"] = self.skinny_configs(plan)
        if self.wants("silu_mul"):
            out["silu_mul"] = silu_mul_configs(plan, [(i, 1) for i in plan.mlp_intermediate_sizes])
        return out

    @staticmethod
    def skinny_configs(plan: KernelWarmupPlan) -> list[tuple]:
        """``linear`` on every (in_features, dtype) of the model's weights (K <= DENSE_MAX_K) at each row block up
        to DENSE_MAX_ROWS tokens (fp32 weights: the router, fed bf16 rows, up to ROUTER_SKINNY_MAX_ROWS); the dense
        MLPs' gated gate/up GEMM."""
        sk = kernel_module("skinny_gemm")
        lo, hi = step_token_bounds(plan)
        blocks = sorted({sk.rows_block(m) for m in range(lo, min(hi, sk.DENSE_MAX_ROWS) + 1)})
        name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
        cfgs = []
        router_blocks = sorted({sk.rows_block(m) for m in range(lo, min(hi, ROUTER_SKINNY_MAX_ROWS) + 1)})
        for k, dt in plan.linear_weights:
            if dt in name and k % sk.vec_for(name[dt]) == 0 and k <= sk.DENSE_MAX_K:
                if dt == plan.dtype:  # linear on the model's own dtype
                    cfgs += [sk.config_for(k, rb, False, False, dt, dt, dt) for rb in blocks]
                elif dt == torch.float32 and plan.dtype == BF16:  # the fp32 router on bf16 rows (router_logits)
                    cfgs += [sk.config_for(k, rb, False, False, BF16, dt, dt) for rb in router_blocks]
        if plan.dtype == BF16 and plan.mlp_intermediate_sizes and plan.hidden_size % 8 == 0 \
                and plan.hidden_size <= sk.DENSE_MAX_K:
            cfgs += [sk.config_for(plan.hidden_size, rb, True, False, BF16, BF16, BF16) for rb in blocks]
        return cfgs


def silu_mul_configs(plan: KernelWarmupPlan, widths: list[tuple[int, int]]) -> list[tuple]:
    """``(I, row_variant)`` for each ``(I, rows a token)``: the row variant where a step has <= SMALL_ROWS rows,
    the tile variant where it has more."""
    if plan.dtype != BF16:
        return []
    lo, hi = step_token_bounds(plan)
    cfgs = [c for inter, per_token in widths for c in silu_mul_row_configs(plan, inter, lo * per_token, hi * per_token)]
    return list(dict.fromkeys(cfgs))


def silu_mul_row_configs(plan: KernelWarmupPlan, inter: int, lo_rows: int, hi_rows: int) -> list[tuple]:
    """``(I, row_variant)`` for steps of ``lo_rows`` .. ``hi_rows`` rows of width ``inter``: the row variant where
    some have <= SMALL_ROWS rows, the tile variant where some have more."""
    sm = kernel_module("silu_mul")
    if plan.dtype != BF16 or not sm.supported(inter):
        return []
    return ([(inter, True)] if lo_rows <= sm.SMALL_ROWS else []) + ([(inter, False)] if hi_rows > sm.SMALL_ROWS else [])
