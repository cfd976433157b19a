"""CPU implementations of torch_npu's norm, SwiGLU and RoPE ops, each from its documentation.

Docs (Ascend/pytorch repository, docs/*/torch_npu-<op>.md; same text on hiascend.com "自定义API"):
npu_rms_norm, npu_add_rms_norm, npu_swiglu, npu_interleave_rope, npu_rotary_mul. Math in fp32, result in the
input dtype; argument names, keyword-only markers and returned tuples as documented.
"""

from __future__ import annotations

import torch

from .contract import check, record


def npu_rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y, rstd): y = x / sqrt(mean(x^2) + eps) * gamma over the last ``gamma.dim()`` dims; rstd fp32."""
    record("npu_rms_norm")
    check(gamma.shape == x.shape[x.dim() - gamma.dim() :], "npu_rms_norm: gamma must match x's trailing dims")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32), "npu_rms_norm: dtype")
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    y = (xf * rstd).to(x.dtype) * gamma.to(x.dtype)
    return y, rstd


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (y, rstd, x) with x = x1 + x2 (in the input dtype) and y = rms_norm(x) * gamma."""
    record("npu_add_rms_norm")
    check(x1.shape == x2.shape and x1.dtype == x2.dtype, "npu_add_rms_norm: x1/x2 shape and dtype must match")
    x = x1 + x2
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    y = (xf * rstd).to(x.dtype) * gamma.to(x.dtype)
    return y, rstd, x


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Splits ``x`` into halves A, B along ``dim``; returns Swish(A) * B (A = first half)."""
    record("npu_swiglu")
    check(x.shape[dim] % 2 == 0, "npu_swiglu: the split dim must be even")
    a, b = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(a.float()).to(x.dtype) * b


def _rotate_half(v: torch.Tensor) -> torch.Tensor:
    half = v.shape[-1] // 2
    return torch.cat((-v[..., half:], v[..., :half]), dim=-1)


def npu_interleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, S, D], cos/sin [B, 1, S, D]: pairs (x[2i], x[2i+1]) are de-interleaved to halves order, then
    y = x*cos + rotate_half(x)*sin (the same RoPE as npu_kv_rmsnorm_rope_cache's doc spells out); y is in
    halves order."""
    record("npu_interleave_rope")
    check(x.dim() == 4 and cos.dim() == 4 and sin.dim() == 4, "npu_interleave_rope: 4-D x, cos, sin (BNSD)")
    b, _n, s, d = x.shape
    check(
        tuple(cos.shape) == (b, 1, s, d) and cos.shape == sin.shape, "npu_interleave_rope: cos/sin [B,1,S,D]"
    )
    check(cos.dtype == x.dtype, "npu_interleave_rope: cos/sin take x's dtype")
    xf = x.float()
    de = torch.cat((xf[..., 0::2], xf[..., 1::2]), dim=-1)
    return (de * cos.float() + _rotate_half(de) * sin.float()).to(x.dtype)


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """y = x * r1 + rotate_half(x) * r2 with r1/r2 broadcast to x (halves layout)."""
    record("npu_rotary_mul")
    check(x.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape, "npu_rotary_mul: 4-D x, r1, r2")
    xf = x.float()
    return (xf * r1.float() + _rotate_half(xf) * r2.float()).to(x.dtype)
