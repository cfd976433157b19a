"""kernels_cuda/skinny_gemm.py (CUDA-core GEMM for decode row counts: dense, gated SwiGLU epilogue, grouped over the
experts hit): host helpers and the CUDA kernel set's routing without a GPU; on a CUDA device, ``check()`` against
the fp32 GEMM rounded like the reference (bf16 within 2 ulp of |ref| + 1e-2, gated 4; fp32 within 1e-5 relative +
1e-5; NaN positions equal; cosine > 0.99999)."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kernels_cuda import skinny_gemm as sk  # noqa: E402 (importable without tilelang)

HAS_CUDA = torch.cuda.is_available()


def test_rows_block_is_the_next_power_of_two_up_to_max_rows():
    assert [sk.rows_block(m) for m in (1, 2, 3, 5, 6, 8, 9, 64)] == [1, 2, 4, 8, 8, 8, 8, 8]


def test_variant_env(monkeypatch):
    monkeypatch.delenv(sk.VARIANT_ENV, raising=False)
    assert sk.default_variant() == (sk.ROWS_PER_WARP, sk.UNROLL)
    monkeypatch.setenv(sk.VARIANT_ENV, "1,8")
    assert sk.default_variant() == (1, 8)
    assert sk.config_for(2048, 6, True, False, torch.bfloat16, torch.bfloat16, torch.bfloat16) == (
        2048, 8, True, False, "bfloat16", "bfloat16", "bfloat16", 1, 8)
    for bad in ("8", "3,4", "1,x"):
        monkeypatch.setenv(sk.VARIANT_ENV, bad)
        with pytest.raises(ValueError, match=sk.VARIANT_ENV):
            sk.default_variant()


def test_reason_rejects_cpu_tensors_and_bad_shapes():
    a, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    assert sk.reason(a, w) == "tensor not on a CUDA device"
    assert sk.engine_reason(a, w) == "tensor not on a CUDA device"
    with pytest.raises(ValueError, match="skinny_gemm: tensor not on a CUDA device"):
        sk.skinny_gemm(a, w)


def test_cuda_kernel_set_keeps_the_reference_linear_off_cuda():
    """CPU tensors (and the gate) keep the reference op; the composite dense_mlp equals the composition."""
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    x = torch.randn(3, 64)
    gate_up, down = torch.randn(32, 64), torch.randn(64, 16)
    ref = torch.nn.functional.linear(x, gate_up)
    want = torch.nn.functional.linear(torch.nn.functional.silu(ref[:, :16]) * ref[:, 16:], down)
    assert torch.allclose(ks.dense_mlp(x, gate_up, down), want)
    assert ks.op_report()["linear"].startswith("fallback")
    h, wr = torch.randn(2, 64).bfloat16(), torch.randn(8, 64)
    assert torch.equal(ks.router_logits(h, wr), torch.nn.functional.linear(h.float(), wr))
    out = ks.run_parallel(lambda: 1, lambda: 2, lambda: 3)
    assert out == [1, 2, 3]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_skinny_gemm_matches_fp32_reference_gpu():
    pytest.importorskip("tilelang", reason="tilelang is not installed")
    assert sk.check()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_skinny_gemm_rejects_bad_scan_gpu():
    pytest.importorskip("tilelang", reason="tilelang is not installed")
    a = torch.zeros(6, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(4, 16, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="scan must be expert_starts"):
        sk.skinny_gemm(a, w, scan=torch.zeros(3, dtype=torch.int32, device="cuda"))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_kernel_set_one_row_paths_match_reference_gpu():
    """The CUDA kernel set's 1-row linear, dense_mlp (SwiGLU in the gate/up epilogue) and router_logits (bf16 row x
    fp32 router) with the default variant, against the reference ops in fp32 (bf16 outputs: 2 ulp of |ref| + 1e-2;
    the gated path 4)."""
    pytest.importorskip("tilelang", reason="tilelang is not installed")
    import torch.nn.functional as F
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(1, 2048, device="cuda", generator=g).to(bf)
    w = (torch.randn(3072, 2048, device="cuda", generator=g) * 2048**-0.5).to(bf)
    ref = F.linear(x.float(), w.float())
    assert ((ks.linear(x, w).float() - ref).abs() <= 2 * 2.0**-8 * ref.abs() + 1e-2).all()
    gate_up = (torch.randn(2 * 1408, 2048, device="cuda", generator=g) * 2048**-0.5).to(bf)
    down = (torch.randn(2048, 1408, device="cuda", generator=g) * 1408**-0.5).to(bf)
    h = F.linear(x.float(), gate_up.float()).to(bf)
    want = F.linear((F.silu(h[:, :1408]) * h[:, 1408:]).float(), down.float())
    got = ks.dense_mlp(x, gate_up, down).float()
    assert ((got - want).abs() <= 4 * 2.0**-8 * want.abs() + 2e-2).all()
    router = torch.randn(64, 2048, device="cuda", generator=g) * 2048**-0.5
    want = F.linear(x.float(), router)
    assert torch.allclose(ks.router_logits(x, router), want, rtol=1e-5, atol=1e-5)
    assert ks.op_report()["linear"].startswith("native (kernels_cuda.skinny_gemm"), ks.op_report()["linear"]
