"""kernels_cuda/silu_mul.py (fused SwiGLU activation) and its use by the CUDA kernel set (``silu_and_mul`` and the
activation between ``grouped_mlp``'s two grouped GEMMs).

Tolerances (the kernel is bf16-only; fp32 / fp16 inputs take the reference op): within 1 bf16 ulp of the fp32
reference computed with the reference's roundings (silu in fp32 -> bf16, product in fp32 -> bf16) and of the
torch op itself, NaN / inf at the same positions. Bit-exact is expected (same expf, IEEE division; 0 ulp
observed on an H200); 1 ulp is allowed for a CUDA math-library expf that differs between torch's toolkit and
nvcc 13. The GPU tests skip without a CUDA device; the selection tests run anywhere.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

from kernels_cuda import silu_mul  # noqa: E402 (importable without tilelang)

HAS_CUDA = torch.cuda.is_available()


def _has_tilelang():
    try:
        import tilelang  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


gpu = pytest.mark.skipif(
    not (HAS_CUDA and _has_tilelang()), reason="no CUDA device (or no tilelang): GPU numerics run on the H200 only"
)


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
    from deepinfer_npu.backends.cpu import linear as ref_linear
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    assert ks.op_report()["silu_and_mul"].startswith("pending (kernels_cuda.silu_mul")
    x = torch.randn(3, 2 * 64).to(torch.bfloat16)
    assert torch.equal(ks.silu_and_mul(x), ref_linear.silu_and_mul(x))
    assert ks.op_report()["silu_and_mul"] == "fallback (reference (tensor not on a CUDA device))"


# ---- on a CUDA device --------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("case", silu_mul.CHECK_CASES, ids=lambda c: f"rows{c[0]}-I{c[1]}")
def test_silu_mul_matches_reference_gpu(case):
    rows, inter, special = case
    ok, stats = silu_mul.check_case(rows, inter, seed=7 + rows, special=special, verbose=False)
    assert ok, stats


@gpu
def test_backend_silu_and_mul_selection_gpu():
    from deepinfer_npu.backends.cpu import linear as ref_linear
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    x = (torch.randn(2, 5, 2 * 1408, device="cuda") * 3).to(torch.bfloat16)  # leading dims kept
    y = ks.silu_and_mul(x)
    assert y.shape == (2, 5, 1408)
    assert silu_mul.bf16_ulps(y, ref_linear.silu_and_mul(x)).max().item() <= 1
    xf = torch.randn(4, 2 * 64, device="cuda")
    assert torch.equal(ks.silu_and_mul(xf), ref_linear.silu_and_mul(xf))
    ks.silu_and_mul(torch.randn(4, 2 * 12, device="cuda").to(torch.bfloat16))  # I = 12: not a multiple of 8
    rep = ks.op_report()["silu_and_mul"]
    assert rep.startswith("native (kernels_cuda.silu_mul (bf16, I=1408)"), rep
    assert "reference (torch.float32: kernels_cuda.silu_mul is bf16-only)" in rep, rep
    assert "reference (width 24: kernel needs 2*I with I a multiple of 8)" in rep, rep


@gpu
def test_grouped_mlp_activation_goes_through_the_kernel_gpu():
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    g = torch.Generator(device="cuda").manual_seed(0)
    E, D, inter, T, k = 8, 256, 128, 37, 3
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
