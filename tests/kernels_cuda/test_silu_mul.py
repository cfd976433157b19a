"""kernels_cuda.silu_mul (fused SwiGLU activation) and its use by the CUDA kernel set (``silu_and_mul`` and the
activation between ``grouped_mlp``'s two grouped GEMMs).

Tolerances (the kernel is bf16-only; fp32 / fp16 inputs take the reference op): within 1 bf16 ulp of the fp32
reference computed with the reference's roundings (silu in fp32 -> bf16, product in fp32 -> bf16) and of the
torch op itself, NaN / inf at the same positions. Bit-exact is expected (same expf, IEEE division; 0 ulp
observed on an H200); 1 ulp is allowed for a CUDA math-library expf that differs between torch's toolkit and
nvcc 13. The GPU tests skip without a CUDA device; the selection tests run anywhere.
"""

import pytest
import torch

from deepinfer_npu.backends.cpu.linear import silu_and_mul as cpu_silu_and_mul
from deepinfer_npu.kernels_cuda import silu_mul
from deepinfer_npu.kernels_cuda._testing import bf16_ulps, bf16_within

CASES = [  # rows, I, special values
    (1, 1408, False),
    (7, 1408, True),
    (64, 1408, False),
    (384, 1408, False),  # 64 tokens x top-6 (V2-Lite grouped MLP)
    (1000, 2816, True),  # V2-Lite shared experts
    (33, 10944, False),  # V2-Lite dense layer (BN 64)
    (4097, 2048, False),  # V3 experts, rows not a multiple of BM
    (5, 352, True),  # V2-Lite experts over tensor parallel 4 (BN 32)
    (300, 8, False),  # smallest supported I (BN 8, BM 256)
    (3, 24, False),
    (128, 1408, True),  # largest row-variant call
    (129, 1408, False),  # smallest tile-variant call (rows not a multiple of BM)
    (200, 10944, True),
]


def silu_and_mul_fp32(x):
    """The CPU op's roundings spelled out in fp32: silu rounded to bf16, then the product rounded to bf16."""
    gate, up = x.float().chunk(2, dim=-1)
    s = (gate / (1.0 + torch.exp(-gate))).to(x.dtype)
    return (s.float() * up).to(x.dtype)


def make_input(rows, inter, seed=0, special=False, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, 2 * inter, generator=g, device=device) * 4
    if rows > 1:
        x[1, :inter] = torch.linspace(-100, 100, inter, device=device)  # exp overflow / underflow of the gate
    x = x.to(torch.bfloat16)
    if special and rows >= 3:
        x[2, 0] = float("nan")
        x[2, 1] = float("inf")  # silu(inf) = inf
        x[2, 2] = float("-inf")  # silu(-inf) = -inf / inf = NaN, as torch
        x[2, inter + 3] = float("inf")  # up = inf
        x[2, 3] = 0.0  # 0 * inf = NaN
    return x


# ---- anywhere ----------------------------------------------------------------------------------------------------
def test_tile_choice():
    assert silu_mul.tile_for(1408) == (16, 128)
    assert silu_mul.tile_for(2048) == (8, 256)
    assert silu_mul.tile_for(10944) == (32, 64)
    assert silu_mul.tile_for(352) == (64, 32)
    assert silu_mul.tile_for(8) == (256, 8)
    assert silu_mul.tile_for(1408, row_variant=True) == (1, 128)
    assert not silu_mul.supported(1404) and not silu_mul.supported(0)


def test_silu_and_mul_on_host_tensors_is_the_reference_with_a_reason():
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    assert ks.op_report()["silu_and_mul"].startswith("pending (kernels_cuda.silu_mul")
    x = torch.randn(3, 2 * 64).to(torch.bfloat16)
    assert torch.equal(ks.silu_and_mul(x), cpu_silu_and_mul(x))
    assert ks.op_report()["silu_and_mul"] == "fallback (reference (tensor not on a CUDA device))"


# ---- on a CUDA device --------------------------------------------------------------------------------------------
def test_fp32_spelling_is_the_cpu_op():
    """The fp32 spelling the kernel is checked against rounds as the CPU op does (both within 1 ulp of the kernel)."""
    x = make_input(64, 136, seed=3, special=True, device="cpu")
    ok, stats = bf16_within(silu_and_mul_fp32(x), cpu_silu_and_mul(x), 1)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rows{c[0]}-I{c[1]}")
def test_silu_mul_matches_reference_gpu(case):
    """<= 1 bf16 ulp against the fp32 spelling and against the CPU op (bit-exact expected against both); the
    output poisoned with NaN first."""
    rows, inter, special = case
    x = make_input(rows, inter, 7 + rows, special)
    y = torch.full((rows, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    silu_mul.silu_and_mul(x, out=y)
    for ref in (silu_and_mul_fp32(x), cpu_silu_and_mul(x)):
        ok, stats = bf16_within(y, ref, 1)
        assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
def test_backend_silu_and_mul_selection_gpu():
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    x = (torch.randn(2, 5, 2 * 1408, device="cuda") * 3).to(torch.bfloat16)  # leading dims kept
    y = ks.silu_and_mul(x)
    assert y.shape == (2, 5, 1408)
    assert bf16_ulps(y, cpu_silu_and_mul(x)).max().item() <= 1
    xf = torch.randn(4, 2 * 64, device="cuda")
    assert torch.equal(ks.silu_and_mul(xf), cpu_silu_and_mul(xf))
    ks.silu_and_mul(torch.randn(4, 2 * 12, device="cuda").to(torch.bfloat16))  # I = 12: not a multiple of 8
    rep = ks.op_report()["silu_and_mul"]
    assert rep.startswith("native (kernels_cuda.silu_mul (bf16, I=1408)"), rep
    assert "reference (torch.float32: kernels_cuda.silu_mul is bf16-only)" in rep, rep
    assert "reference (width 24: kernel needs 2*I with I a multiple of 8)" in rep, rep


@pytest.mark.gpu
@pytest.mark.tilelang
def test_grouped_mlp_activation_goes_through_the_kernel_gpu():
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.backends.cuda.ops.grouped_mlp import MOE_GEMM_MAX_ROWS

    ks = CudaKernelSet()
    g = torch.Generator(device="cuda").manual_seed(0)
    # 2100 rows: above moe_gemm's limit (MOE_GEMM_MAX_ROWS), where torch._grouped_mm runs and the activation
    # is a separate kernel
    E, D, inter, T, k = 8, 256, 128, 700, 3
    assert T * k > MOE_GEMM_MAX_ROWS
    hidden = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), device="cuda", generator=g).to(torch.int32)
    w13 = (torch.randn(E, 2 * inter, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, D, inter, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    sh, counts, _ = ks.moe_dispatch(hidden, ids, E)
    out = ks.grouped_mlp(sh, counts, w13, w2)
    ref = ref_moe.grouped_mlp(sh.float(), counts, w13.float(), w2.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    rep = ks.op_report()
    assert rep["grouped_mlp"].startswith("native (torch._grouped_mm"), rep["grouped_mlp"]
    assert rep["silu_and_mul"].startswith(f"native (kernels_cuda.silu_mul (bf16, I={inter})"), rep["silu_and_mul"]
