"""INT8 W8A8 numerics (symmetric): weights per output channel, activations per token, scales ``amax / 127`` (the
dynamic W8A8 scheme of vllm-ascend / msmodelslim, ``torch_npu.npu_dynamic_quant``)."""

from __future__ import annotations

import torch

INT8_MAX = 127.0
AMAX_EPS = 1e-10


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., N, K] -> ``(int8 [..., N, K], scale fp32 [..., N])``, one scale per row (a weight's output channel
    or an activation's token), ``x ~= q * scale``."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_EPS) / INT8_MAX
    q = torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.squeeze(-1).contiguous()


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_int8_rows`: fp32."""
    return q.float() * scale.float().unsqueeze(-1)
