"""Norms, SwiGLU and RoPE on torch_npu fused ops.

Each call cites the op's documentation (Ascend/pytorch repository, ``docs/.../torch_npu-<op>.md``; the same
pages
are published at hiascend.com "Ascend Extension for PyTorch 自定义API") and where vllm-ascend uses it.
"""

from __future__ import annotations

import torch

from . import runtime


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch_npu.npu_rms_norm(x, gamma, epsilon=1e-06) -> (y, rstd); y has x's dtype, statistics in fp32.
    # Doc: torch_npu-npu_rms_norm.md; usage: vllm_ascend/ops/layernorm.py (AscendRMSNorm.forward_oot).
    y, _rstd = runtime.load().npu_rms_norm(x, weight, epsilon=eps)
    return y


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x) with x = x1 + x2 and
    # y = rms_norm(x) * gamma. Doc: torch_npu-npu_add_rms_norm.md; usage: vllm_ascend/ops/layernorm.py.
    y, _rstd, summed = runtime.load().npu_add_rms_norm(x, residual, weight, epsilon=eps)
    return y, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # torch_npu.npu_swiglu(x, dim=-1): splits x in two halves along dim, returns silu(first) * second — our
    # [gate | up] order. Doc: torch_npu-npu_swiglu.md; usage: vllm_ascend/ops/activation.py
    # (AscendSiluAndMul).
    return runtime.load().npu_swiglu(x, dim=-1)


def cos_sin_halves(cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """``(cos, sin)`` [T, R] in the "halves" form both rope ops take (``[c_0..c_{R/2-1}, c_0..c_{R/2-1}]``),
    gathered on the device (no host round trip) and cast to the activation dtype as the ops require."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos, sin = cs[:, :half], cs[:, half:]
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


def deinterleaved_to_interleaved(y: torch.Tensor) -> torch.Tensor:
    """[..., R] halves order (y_0..y_{R/2-1}, y'_0..) -> pairs order (y_0, y'_0, y_1, y'_1, ...)."""
    half = y.shape[-1] // 2
    return torch.stack((y[..., :half], y[..., half:]), dim=-1).flatten(-2)


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """HAL ``rope``: ``x`` [T, H, R] -> rotated, in ``x``'s layout."""
    npu = runtime.load()
    t, h, r = x.shape
    cos, sin = cos_sin_halves(cos_sin_cache, positions, x.dtype)
    if interleaved:
        # torch_npu.npu_interleave_rope(x [B, N, S, D], cos [B, 1, S, D], sin [B, 1, S, D]): takes pairs
        # (x[2i], x[2i+1]), de-interleaves them and applies x*cos + rotate_half(x)*sin, so the result is in
        # halves order (as npu_kv_rmsnorm_rope_cache writes k_rope). We re-interleave to keep the HAL layout
        # contract; a later version can keep halves order end to end for q and k alike (dot products agree).
        # Doc: torch_npu-npu_interleave_rope.md; usage: vllm_ascend/attention/mla_v1.py (rope_single: B=T,
        # S=1).
        y = npu.npu_interleave_rope(x.reshape(t, h, 1, r), cos.reshape(t, 1, 1, r), sin.reshape(t, 1, 1, r))
        return deinterleaved_to_interleaved(y.reshape(t, h, r))
    # torch_npu.npu_rotary_mul(x, r1=cos, r2=sin): x*cos + rotate_half(x)*sin, broadcasting cos/sin [B, S, 1,
    # D]
    # over x [B, S, N, D]. Doc: torch_npu-npu_rotary_mul.md; usage: vllm_ascend/ops/rotary_embedding.py.
    y = npu.npu_rotary_mul(x.reshape(t, 1, h, r), cos.reshape(t, 1, 1, r), sin.reshape(t, 1, 1, r))
    return y.reshape(t, h, r)
