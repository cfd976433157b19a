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
    assert ks.run_parallel(lambda: 1, lambda: 2, rows=1) == [1, 2]


def test_parallel_branches_in_order_at_one_row_with_pdl(monkeypatch):
    """run_parallel's stream choice (measured on an H200, session 6): with PDL on one token row keeps the branches
    in order, more rows fork a second stream (PDL on is the default); without PDL every size forks; never without
    a device or with DEEPINFER_CUDA_PARALLEL_BRANCHES=0."""
    from deepinfer_npu.backends.cuda import kernels as ck

    ks = ck.CudaKernelSet()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    assert [ks.parallel_branches(r) for r in (1, 2, 16, None)] == [False, True, True, True]
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    assert [ks.parallel_branches(r) for r in (1, 2, None)] == [True, True, True]
    monkeypatch.setattr(ck, "PARALLEL_BRANCHES", False)
    assert not ks.parallel_branches(16)
    monkeypatch.setattr(ck, "PARALLEL_BRANCHES", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not ks.parallel_branches(16)


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


def _mla_weights(h=16, v=128, lat=512, d=2048, device="cpu"):
    from deepinfer_npu.hal.types import MLAWeights

    g = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).bfloat16().to(device)

    return MLAWeights(num_heads=h, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=v, kv_lora_rank=lat,
                      kv_a_proj=rnd(lat + 64, d), kv_a_layernorm=rnd(lat), w_uk=rnd(h, 128, lat),
                      w_uv=rnd(h, v, lat), o_proj=rnd(d, h * v), q_proj=rnd(h * 192, d))


def test_w_uv_skinny_only_for_one_cuda_token(monkeypatch):
    """mla_epilogue's W_UV through skinny_gemm applies to one token on a CUDA device with SKINNY_W_UV on; on host
    tensors the reference arithmetic runs. The per-head scan is not made inside a graph capture (None: cuBLAS then).
    (The warm-up's W_UV configuration: tests/cuda/test_cuda_kernel_warmup.py.)"""
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.setattr(ck, "SKINNY_W_UV", True)
    ks = ck.CudaKernelSet()
    w = _mla_weights()
    lat = torch.randn(1, 16, 512).bfloat16()
    assert ks._w_uv_skinny(lat, w) is None  # host tensor
    out = ks.mla_epilogue(lat, w)
    want = torch.nn.functional.linear(torch.einsum("thl,hvl->thv", lat, w.w_uv).reshape(1, -1), w.o_proj)
    assert torch.equal(out, want)
    assert "reference arithmetic" in ks.op_report()["mla_epilogue"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert ks._head_scan(16, "cpu") is None and not ks._head_scans
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert ks._head_scan(4, "cpu").tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert ks._head_scan(4, "cpu") is ks._head_scans[(4, "cpu")]  # made once


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_w_uv_skinny_matches_reference_gpu(monkeypatch):
    """W_UV of one token on skinny_gemm (the heads as experts) against the fp32 reference: bf16 within 2 ulp of
    |ref| + 1e-3, the same rows; more tokens keep cuBLAS."""
    pytest.importorskip("tilelang", reason="tilelang is not installed")
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.setattr(ck, "SKINNY_W_UV", True)
    ks = ck.CudaKernelSet()
    w = _mla_weights(device="cuda")
    lat = (torch.randn(1, 16, 512, device="cuda") * 0.5).bfloat16()
    got = ks._w_uv_skinny(lat, w)
    assert got is not None and got.shape == (1, 16 * 128)
    ref = torch.einsum("thl,hvl->thv", lat.float(), w.w_uv.float()).reshape(1, -1)
    tol = 2 * 2.0**-8 * ref.abs() + 1e-3
    assert bool(((got.float() - ref).abs() <= tol).all()), float((got.float() - ref).abs().max())
    assert ks._w_uv_skinny(lat.expand(2, 16, 512).contiguous(), w) is None
    assert "skinny_gemm grouped" in ks.op_report()["mla_epilogue"]
