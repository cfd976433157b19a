"""``mla_epilogue``: W_UV, then o_proj through the kernel set's ``linear``. One bf16 token: W_UV on
``kernels_cuda.skinny_gemm``'s grouped mode, the heads as its experts (a TileLang kernel keeps the programmatic
launch chain that cuBLAS' batched GEMM breaks); else the reference's arithmetic (W_UV per head on cuBLAS)."""

from __future__ import annotations

import torch

from deepinfer_npu.hal.types import KernelWarmupPlan, MLAWeights

from .base import BF16, OpImpl, kernel_module, step_token_bounds
from .mla_prolog import absorb_heads


class MLAEpilogue(OpImpl):
    FALLBACK = {"mla_epilogue": "reference op on CUDA tensors: einsum (bmm) + F.linear; sync-free"}

    def __init__(self, ks) -> None:
        super().__init__(ks)
        self._head_scans: dict[tuple, torch.Tensor] = {}  # (heads, device) -> constant scan

    def head_scan(self, num_heads: int, device) -> torch.Tensor | None:
        """``moe_gemm.expert_starts``' layout for one row a head ([0 .. H], then heads 0 .. H-1), made once per
        (H, device) outside graph capture (the capture's eager warm-up run makes it); None inside a capture."""
        key = (num_heads, str(device))
        scan = self._head_scans.get(key)
        if scan is None and not torch.cuda.is_current_stream_capturing():  # built on the device: no host copy (sync)
            idx = torch.arange(num_heads + 1, dtype=torch.int32, device=device)
            scan = self._head_scans[key] = torch.cat([idx, idx[:-1]])
        return scan

    def w_uv_skinny(self, out_latent: torch.Tensor, w: MLAWeights):
        """W_UV for one token through skinny_gemm's grouped mode (one row a head); None where it does not apply."""
        if not (out_latent.is_cuda and out_latent.shape[0] == 1):
            return None
        a = out_latent.reshape(out_latent.shape[1], out_latent.shape[2])  # [H, L]: one row a head, head-major
        sk, _why = self.ks.impl("linear").skinny(a, w.w_uv, grouped=True)
        scan = self.head_scan(a.shape[0], a.device) if sk is not None and a.dtype == BF16 else None
        if scan is None:
            return None
        self.note("mla_epilogue", "W_UV: kernels_cuda.skinny_gemm grouped (the heads as experts, 1 token) + "
                  "linear (o_proj)", True)
        return sk.skinny_gemm(a, w.w_uv, scan=scan).view(1, -1)

    def mla_epilogue(self, out_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
        values = self.w_uv_skinny(out_latent, w)
        if values is None:
            self.note("mla_epilogue", "reference arithmetic: W_UV per head (cuBLAS) + linear (o_proj)", False)
            values = absorb_heads(out_latent, w.w_uv.transpose(1, 2))
        return self.ks.linear(values.reshape(values.shape[0], -1), w.o_proj, w.o_bias)

    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """skinny_gemm's grouped configuration at K = kv_lora_rank for W_UV at one token: the key the launch of
        one row a head takes (a cold engine built it at its first decode step, 5.5 s on an H200, when the warm-up
        listed the one-row block instead)."""
        lo, _hi = step_token_bounds(plan)
        if not (self.ks.impl("linear").wants("skinny_gemm") and plan.dtype == BF16 and lo <= 1
                and plan.kv_lora_rank % 8 == 0):
            return {}
        sk = kernel_module("skinny_gemm")
        return {"skinny_gemm": [sk.launch_config(plan.kv_lora_rank, plan.num_heads, False, True, BF16, BF16, BF16)]}
