"""kernels_cuda.fp8_skinny_gemm (one-row FP8 projections: the rows' 1 x 128 quantisation inside the kernel, e4m3
weights with 128 x 128 block scales; dense, gated SwiGLU, grouped over the experts hit).

Reference: the CPU backend's W8A8 arithmetic, ``quantize_per_token_group`` run on the CPU (IEEE division, as the
kernel divides), dequantised, times the dequantised weight in fp32 (TF32 off), rounded to bf16 (gated: the gate/up
outputs rounded, bf16 silu, bf16 product, as ``silu_and_mul``). The kernel's codes are the reference's bit for
bit, and its e4m3 products are exact in fp32, so only the summation order differs: every element within 2 bf16 ulp
of |ref| (gated 4) + 2**-18 of the sum of the products' magnitudes + 1e-6 * max|ref|; cosine > 0.99999. The rows
and weights carry a random magnitude per 128-value group / 128 x 128 block, so a scale taken from the wrong group,
block, row or expert fails.
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
DENSE = [  # (rows, N, K, gated)
    (1, 3072, 2048, False), (1, 576, 2048, False), (1, 3648, 2048, False), (1, 2048, 10944, False),
    (1, 5632, 2048, True), (1, 21888, 2048, True), (2, 2048, 1408, False), (3, 2816, 2048, True),
    (1, 576, 7168, False), (1, 200, 96, False), (2, 576, 96, False), (3, 2048, 10944, False),
]
GROUPED = [  # (tokens, top_k, experts, N, K, gated, skew)
    (1, 6, 64, 2816, 2048, True, False), (1, 6, 64, 2048, 1408, False, False),
    (4, 6, 16, 2816, 2048, True, True), (3, 8, 8, 2048, 1408, False, True), (2, 4, 8, 384, 96, True, True),
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
    assert fs.config_for(2048, 1) == (2048, 1, False, False)
    assert fs.config_for(1408, 2, gated=True, grouped=True) == (1408, 2, True, True)
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
@pytest.mark.parametrize("m,n,k,gated", DENSE, ids=lambda c: str(c))
def test_dense_matches_the_w8a8_reference_gpu(m, n, k, gated, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    a = rows(m, k)
    w, sw = weight(n=n, k=k)
    out = fs.fp8_skinny_gemm(a, w, sw, gated=gated)
    assert out.shape == (m, n // 2 if gated else n) and out.dtype == torch.bfloat16
    check(out, *reference(a, w, sw, gated), gated)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("tokens,top_k,experts,n,k,gated,skew", GROUPED, ids=lambda c: str(c))
def test_grouped_matches_the_w8a8_reference_per_expert_gpu(tokens, top_k, experts, n, k, gated, skew, monkeypatch):
    """Rows sorted by expert with the engine's scan; ``skew``: one expert with a row per token (row blocks in a
    loop), many with none."""
    from deepinfer_npu.kernels_cuda._testing import expert_rows
    from deepinfer_npu.kernels_cuda.moe_gemm import expert_starts

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    _, _, counts = expert_rows(tokens, top_k, experts, 16, 16, skew=skew)
    a = rows(tokens * top_k, k, seed=3)
    w, sw = weight(experts, n=n, k=k, seed=4)
    out = fs.fp8_skinny_gemm(a, w, sw, gated=gated, scan=expert_starts(counts))
    start, refs, mags = 0, [], []
    for e, c in enumerate(counts.tolist()):
        if c:
            r, mg = reference(a[start : start + c], w[e], sw[e], gated)
            refs.append(r)
            mags.append(mg)
        start += c
    check(out, torch.cat(refs), torch.cat(mags), gated)
