"""kernels_cuda/moe_gemm_swap.py: the swapped-operand expert GEMM (weight tile on wgmma's M side, SwiGLU fused into
w13) against its fp32 reference on a CUDA device (``moe_gemm_swap.check``: bf16 within 2 ulp of |ref| + 1e-2,
gated 4 ulp; NaN positions equal; cosine > 0.99999); on the CPU: its gated reference equals the CPU backend's
expert MLP arithmetic, bad shapes are rejected with the dims named, and the backend keeps it gated."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")
pytest.importorskip("tilelang", reason="tilelang is not installed (pip install tilelang==0.1.15)")

from kernels_cuda import moe_gemm_swap as sw  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
def test_moe_gemm_swap_matches_fp32_reference():
    assert sw.check()


def test_gated_reference_is_the_cpu_expert_mlp():
    """Small integers keep every GEMM exact, so the reference's roundings must equal the CPU backend's
    silu_and_mul(bf16 GEMM) bit for bit."""
    from deepinfer_npu.backends.cpu.linear import silu_and_mul

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([2, 0, 3, 1])
    a = torch.randint(-2, 3, (6, 64), generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (4, 2 * 64, 64), generator=g).to(torch.bfloat16) * 0.125
    got = sw.moe_gemm_swap_ref(a, w, counts, gated=True)
    want, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            want.append(silu_and_mul(a[start : start + c] @ w[e].t()).float())
        start += c
    assert torch.equal(got, torch.cat(want))


def test_rejects_bad_shapes_with_the_dims_named():
    a = torch.zeros(3, 64, dtype=torch.bfloat16)
    scan = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="K=64"):
        sw.moe_gemm_swap(a, torch.zeros(2, 128, 128, dtype=torch.bfloat16), scan)
    with pytest.raises(ValueError, match=r"int32 \[2E\+1\]"):
        sw.moe_gemm_swap(a, torch.zeros(2, 128, 64, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="N=96"):
        sw.moe_gemm_swap(a, torch.zeros(2, 96, 64, dtype=torch.bfloat16), scan, gated=True)


def test_row_tiles():
    assert [sw.rows_tile(m) for m in (1, 6, 8, 9, 48)] == [8, 8, 8, 16, 16]
    assert sw.config_for(2816, 2048, 6, True) == (2816, 2048, 8, True, 64)
