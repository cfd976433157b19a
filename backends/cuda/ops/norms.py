"""``rms_norm`` / ``add_rms_norm``: ``kernels_cuda.rms_norm`` (one row in registers) for bf16 rows of the widths it
was checked at, else the CPU reference op on CUDA tensors (sync-free).

FP8 models with ``DEEPINFER_FP8_NORM_QUANT=1``: the norms before FP8 projections (the decoder's hidden-size norms
and the q-LoRA norm, as the warm-up lists and builds them: width, residual add, eps) also write their outputs' FP8
codes and scales in the same launch and hand them to the quantised ops (``QuantOps.offer``), so the projections
after them launch no quantisation. Up to ``CODES_MAX_ROWS`` rows: decode-sized steps, where a launch is a visible
share of a step and the held outputs are small. The model's final norm has the decoder norms' configuration and
writes codes nothing reads (T x N bytes)."""

from __future__ import annotations

import torch

from deepinfer_npu import envs
from deepinfer_npu.hal.types import KernelWarmupPlan

from .base import BF16, NOT_ON_DEVICE, OpConfig, OpImpl, ref

NORM_MIN, NORM_MAX, NORM_MULT = 512, 7168, 256  # widths kernels_cuda.rms_norm was checked at (one row in regs)
QUANT_GROUP = 128  # the FP8 activation groups (fp8_quant's)
CODES_MAX_ROWS = 1024  # rows up to this: the norm writes the FP8 codes (decode-sized steps)


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

    def __init__(self, ks) -> None:
        super().__init__(ks)
        self.codes_wanted = False  # an FP8 model with DEEPINFER_FP8_NORM_QUANT=1 (read at selection)
        # (width, with_residual, eps) of the norms that write FP8 codes: those the warm-up listed (and so built)
        self.quant_configs: set[tuple[int, bool, float]] = set()

    def select(self, cfg: OpConfig) -> None:
        super().select(cfg)
        # quant_configs stays as the last warm-up listed it: a selection after the warm-up (a module that failed
        # to build) keeps what was built
        self.codes_wanted = cfg.quantization == "fp8" and envs.FP8_NORM_QUANT

    def _quantised(self, x: torch.Tensor, with_residual: bool, eps: float) -> bool:
        """Whether this norm also writes its output's FP8 codes (module docstring)."""
        return (self.codes_wanted and x.dim() == 2 and x.shape[0] <= CODES_MAX_ROWS
                and (x.shape[-1], with_residual, float(eps)) in self.quant_configs
                and self.ks.impl("quant").takes_norm_codes(x))

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
        if self._quantised(x, False, eps):
            self.note("rms_norm", f"kernels_cuda.rms_norm + FP8 codes (bf16, N={x.shape[-1]})", True)
            y, codes, scales = mod.rms_norm_quant(x.contiguous(), weight.contiguous(), float(eps))
            self.ks.impl("quant").offer(y, codes, scales)
            return y
        self.note("rms_norm", f"kernels_cuda.rms_norm (bf16, N={x.shape[-1]})", True)
        return mod.rms_norm(x.contiguous(), weight.contiguous(), float(eps))

    def add_rms_norm(self, x, residual, weight, eps):
        mod, why = self._reason(x, weight)
        if mod is not None and residual.dtype != BF16:
            mod, why = None, f"residual {residual.dtype}: kernel is bf16-only"
        if mod is None:
            self.note("add_rms_norm", f"reference ({why})", False)
            return ref("norm").add_rms_norm(x, residual, weight, eps)
        if self._quantised(x, True, eps):
            self.note("add_rms_norm", f"kernels_cuda.rms_norm fused add + FP8 codes (bf16, N={x.shape[-1]})", True)
            y, summed, codes, scales = mod.add_rms_norm_quant(x.contiguous(), residual.contiguous(),
                                                              weight.contiguous(), float(eps))
            self.ks.impl("quant").offer(y, codes, scales)
            return y, summed
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
        configs = norm_configs(want)
        if self.codes_wanted and plan.quantization == "fp8" and self.ks.impl("quant").wants("fp8_quant"):
            # the decoder's norms before FP8 projections, and the q-LoRA norm (the MLA prolog lists its plain one);
            # the calls take the codes form only for these (a drafter's norm with its own eps keeps the plain one)
            quantised = [(plan.hidden_size, False, plan.rms_norm_eps), (plan.hidden_size, True, plan.rms_norm_eps)]
            if plan.q_lora_rank:
                quantised.append((plan.q_lora_rank, False, plan.latent_norm_eps))
            listed = [c for c in norm_configs(quantised) if c[0] % QUANT_GROUP == 0]
            self.quant_configs = set(listed)
            configs += [(*c, True) for c in listed]
        return {"rms_norm": configs}
