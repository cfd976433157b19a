"""kernels_cuda.fp8_skinny_gemm (one-row FP8 projections: the rows' 1 x 128 quantisation inside the kernel, e4m3
weights with 128 x 128 block scales; plain and gated SwiGLU, one, two or four output columns a warp).

Reference: the CPU backend's W8A8 arithmetic, ``quantize_per_token_group`` run on the CPU (IEEE division, as the
kernel divides), dequantised, times the dequantised weight in fp32 (TF32 off), rounded to bf16 (gated: the gate/up
outputs rounded, bf16 silu, bf16 product, as ``silu_and_mul``). The kernel's codes are the reference's bit for
bit, and its e4m3 products are exact in fp32, so only the summation order differs: every element within 2 bf16 ulp
of |ref| (gated 4) + 2**-18 of the sum of the products' magnitudes + 1e-6 * max|ref|; cosine > 0.99999. The rows
and weights carry a random magnitude per 128-value group / 128 x 128 block, so a scale taken from the wrong group,
block or row fails.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.kernels_cuda import fp8_skinny_gemm as fs
from deepinfer_npu.model_executor.quantization.fp8 import (
    dequantize_fp8_block,
    dequantize_per_token_group,
    quantize_fp8_block,
    quantize_per_token_group,
)

FP8 = torch.float8_e4m3fn
DENSE = [  # (rows, N, K, gated, rows_per_warp: None = the rule's)
    (1, 3072, 2048, False, None), (1, 576, 2048, False, None), (1, 3648, 2048, False, None),
    (1, 2048, 10944, False, None), (1, 5632, 2048, True, None), (1, 21888, 2048, True, None),
    (2, 2048, 1408, False, None), (3, 2816, 2048, True, None), (1, 576, 7168, False, None), (1, 200, 96, False, None),
    (2, 576, 96, False, None), (3, 2048, 10944, False, None),
    # every column count a warp, with N not a multiple of the CTA's 4 R columns
    (1, 200, 2048, False, 4), (1, 200, 2048, True, 4), (2, 1000, 1408, False, 2), (1, 600, 2048, True, 2),
    (1, 8000, 7168, True, 1), (3, 4100, 2816, False, 4),
]


def rows(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    mag = torch.exp2(torch.randint(-6, 7, (m, -(-k // 128)), generator=g, device="cuda").float())
    return (torch.randn(m, k, generator=g, device="cuda") * mag.repeat_interleave(128, 1)[:, :k]).bfloat16()


def weight(*lead: int, n: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    mag = torch.exp2(torch.randint(-4, 5, (*lead, -(-n // 128), -(-k // 128)), generator=g, device="cuda").float())
    mag = mag.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]
    return quantize_fp8_block(torch.randn(*lead, n, k, generator=g, device="cuda") * k**-0.5 * mag)


def reference(a, w, sw, gated) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16-rounded reference as fp32, |a| @ |w|^T of the dequantised operands)."""
    aq, sa = quantize_per_token_group(a.cpu())
    ad = dequantize_per_token_group(aq, sa).cuda()
    wd = dequantize_fp8_block(w, sw)
    y = ad @ wd.t()
    mag = ad.abs() @ wd.abs().t()
    if gated:
        gate, up = y.bfloat16().chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
        mag = torch.maximum(*mag.chunk(2, dim=-1))
    return y.bfloat16().float(), mag


def check(out, ref, mag, gated):
    tol = (4 if gated else 2) * 2.0**-8 * ref.abs() + 2.0**-18 * mag + 1e-6 * ref.abs().max()
    err = (out.float() - ref).abs()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    assert int((err > tol).sum()) == 0 and cos > 0.99999, dict(
        max_err=err.max().item(), beyond=int((err > tol).sum()), cos=cos)


# ---- everywhere ----------------------------------------------------------------------------------------------
def test_configurations_and_limits():
    assert fs.config_for(2048, 1, n_out=576) == (2048, 1, False, 1)
    assert fs.config_for(2048, 3, n_out=2048) == (2048, 2, False, 2)
    assert fs.config_for(2048, 1, gated=True, n_out=2816) == (2048, 1, True, 1)  # gated: half the plain rule's
    assert fs.config_for(7168, 1, n_out=7168) == (7168, 1, False, 4)
    assert fs.config_for(7168, 1, n_out=7168, rows_per_warp=1) == (7168, 1, False, 1)
    # the most columns a warp that leaves 256 CTAs of 4 warps
    assert [fs.rows_per_warp_for(n) for n in (200, 1023, 1024, 2048, 4095, 4096, 32768)] == [1, 1, 1, 2, 2, 4, 4]
    assert [fs.rows_per_warp_for(n, gated=True) for n in (1024, 2816, 4096, 32768)] == [1, 1, 2, 2]
    assert fs.rows_block(1) == 1 and fs.rows_block(3) == fs.MAX_ROWS
    assert fs.supported(10944) and not fs.supported(1000) and not fs.supported(fs.MAX_K + 16)


def test_reason_names_the_operand():
    a = torch.zeros(1, 256, dtype=torch.bfloat16)
    w, sw = torch.zeros(128, 256, dtype=FP8), torch.zeros(1, 2)
    assert fs.reason(a, w, sw) == "tensor not on a CUDA device"
    with pytest.raises(ValueError, match="fp8_skinny_gemm: tensor not on a CUDA device"):
        fs.fp8_skinny_gemm(a, w, sw)


# ---- GPU -----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.tilelang
def test_reason_rejects_bad_operands_gpu():
    a = torch.zeros(1, 256, dtype=torch.bfloat16, device="cuda")
    w, sw = torch.zeros(128, 256, dtype=FP8, device="cuda"), torch.zeros(1, 2, device="cuda")
    assert fs.reason(a, w, sw) is None
    assert "expected [1, 2]" in fs.reason(a, w, torch.zeros(2, 2, device="cuda"))
    assert "a has K=256, w has K=128" == fs.reason(a, w[:, :128].contiguous(), torch.zeros(1, 1, device="cuda"))
    assert "takes 2-D bf16 rows" in fs.reason(a.float(), w, sw)
    assert "multiple of 16" in fs.reason(a[:, :200], w[:, :200].contiguous(), sw)
    with pytest.raises(ValueError, match=r"out torch.bfloat16 \[1, 64\]: expected a contiguous bf16 \[1, 128\]"):
        fs.fp8_skinny_gemm(a, w, sw, out=torch.empty(1, 64, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("n,k", [(5632, 2048), (384, 96)])
def test_gated_equals_silu_and_mul_of_the_plain_kernel_gpu(n, k):
    """The gate and up sums are the plain kernel's (same order), so the gated output is bit for bit
    ``silu_and_mul`` of the plain output (the CPU reference's op, run on the device)."""
    from deepinfer_npu.backends.cpu.linear import silu_and_mul

    a = rows(1, k, seed=5)
    w, sw = weight(n=n, k=k, seed=6)
    want = silu_and_mul(fs.fp8_skinny_gemm(a, w, sw))
    assert torch.equal(fs.fp8_skinny_gemm(a, w, sw, gated=True), want)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("m,n,k,gated,rows_per_warp", DENSE, ids=lambda c: str(c))
def test_matches_the_w8a8_reference_gpu(m, n, k, gated, rows_per_warp, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    a = rows(m, k)
    w, sw = weight(n=n, k=k)
    out = fs.fp8_skinny_gemm(a, w, sw, gated=gated, rows_per_warp=rows_per_warp)
    assert out.shape == (m, n // 2 if gated else n) and out.dtype == torch.bfloat16
    check(out, *reference(a, w, sw, gated), gated)
