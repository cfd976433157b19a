"""``rms_norm`` / ``add_rms_norm``: ``kernels_cuda.rms_norm`` (one row in registers) for bf16 rows of the widths it
was checked at, else the CPU reference op on CUDA tensors (sync-free)."""

from __future__ import annotations

import torch

from deepinfer_npu.hal.types import KernelWarmupPlan

from .base import BF16, NOT_ON_DEVICE, OpImpl, ref

NORM_MIN, NORM_MAX, NORM_MULT = 512, 7168, 256  # widths kernels_cuda.rms_norm was checked at (one row in regs)


def width_ok(n: int) -> bool:
    return NORM_MIN <= n <= NORM_MAX and n % NORM_MULT == 0


def norm_configs(want: list[tuple[int, bool, float]]) -> list[tuple]:
    """``(width, with_residual, eps)`` as ``kernels_cuda.rms_norm.get_kernel`` takes them, for the widths it serves."""
    return list(dict.fromkeys((n, r, float(eps)) for n, r, eps in want if width_ok(n)))


class Norms(OpImpl):
    KERNELS = ("rms_norm",)
    PRIMARY = {"rms_norm": "rms_norm", "add_rms_norm": "rms_norm"}
    PLANNED = {
        "rms_norm": "kernels_cuda.rms_norm for bf16, width 512..7168 (x256); else the reference",
        "add_rms_norm": "kernels_cuda.rms_norm (fused add) for bf16, width 512..7168 (x256); else the reference",
    }

    def _reason(self, x: torch.Tensor, weight: torch.Tensor):
        n = x.shape[-1]
        if not x.is_cuda:
            return None, NOT_ON_DEVICE
        if x.dtype != BF16 or weight.dtype != BF16:
            return None, f"{x.dtype}: kernels_cuda.rms_norm is bf16-only"
        if not width_ok(n):
            return None, f"width {n}: kernel checked for {NORM_MIN}..{NORM_MAX}, multiples of {NORM_MULT}"
        if x.numel() == 0:
            return None, "empty input"
        return self.use("rms_norm")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        mod, why = self._reason(x, weight)
        if mod is None:
            self.note("rms_norm", f"reference ({why})", False)
            return ref("norm").rms_norm(x, weight, eps)
        self.note("rms_norm", f"kernels_cuda.rms_norm (bf16, N={x.shape[-1]})", True)
        return mod.rms_norm(x.contiguous(), weight.contiguous(), float(eps))

    def add_rms_norm(self, x, residual, weight, eps):
        mod, why = self._reason(x, weight)
        if mod is not None and residual.dtype != BF16:
            mod, why = None, f"residual {residual.dtype}: kernel is bf16-only"
        if mod is None:
            self.note("add_rms_norm", f"reference ({why})", False)
            return ref("norm").add_rms_norm(x, residual, weight, eps)
        self.note("add_rms_norm", f"kernels_cuda.rms_norm fused add (bf16, N={x.shape[-1]})", True)
        return mod.add_rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), float(eps))

    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """The decoder's hidden-size norms, plain and fused with the residual add; a drafter's own plain ones
        (DFlash). The attention's latent norms are the MLA prolog's."""
        if plan.dtype != BF16 or not self.wants("rms_norm"):
            return {}
        want = [(plan.hidden_size, False, plan.rms_norm_eps), (plan.hidden_size, True, plan.rms_norm_eps)]
        if plan.drafter_rms_norm_eps is not None:
            want.append((plan.hidden_size, False, plan.drafter_rms_norm_eps))
        return {"rms_norm": norm_configs(want)}
