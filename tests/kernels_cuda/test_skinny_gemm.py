"""kernels_cuda.skinny_gemm (CUDA-core GEMM for decode row counts: dense, gated SwiGLU epilogue, grouped over the
experts hit): host-side functions and the CUDA kernel set's routing without a GPU; on a CUDA device, against
the fp32 GEMM rounded like the reference (bf16 within 2 ulp of |ref| + 1e-2, gated 4; fp32 within 1e-5 relative +
1e-5; NaN positions equal; cosine > 0.99999)."""

import pytest
import torch
import torch.nn.functional as F

from deepinfer_npu.kernels_cuda import skinny_gemm as sk
from deepinfer_npu.kernels_cuda._testing import close_to, dense_rows, expert_rows

CASES = [  # (rows, N, K, experts, gated, a dtype, w dtype)
    (1, 3072, 2048, 0, False, "bfloat16", "bfloat16"), (1, 576, 2048, 0, False, "bfloat16", "bfloat16"),
    (3, 2048, 2816, 0, False, "bfloat16", "bfloat16"), (8, 5632, 2048, 0, True, "bfloat16", "bfloat16"),
    (6, 1000, 968, 0, False, "bfloat16", "bfloat16"), (5, 64, 2048, 0, False, "float32", "float32"),
    (2, 64, 2048, 0, False, "bfloat16", "float32"), (1, 21888, 2048, 0, True, "bfloat16", "bfloat16"),
    (6, 2816, 2048, 64, True, "bfloat16", "bfloat16"), (6, 2048, 1408, 64, False, "bfloat16", "bfloat16"),
    (96, 2816, 2048, 64, True, "bfloat16", "bfloat16"), (384, 2048, 1408, 64, False, "bfloat16", "bfloat16"),
]


def reference(a, w, gated=False, tokens_per_expert=None) -> torch.Tensor:
    """The CPU reference's arithmetic on the same device: F.linear (and silu_and_mul) per expert, in the output
    dtype (bf16 GEMM outputs are rounded, as the unfused path rounds them)."""

    def one(x, wt):
        y = F.linear(x.float(), wt.float())
        if gated:
            g, u = y.to(torch.bfloat16).chunk(2, dim=-1)
            return F.silu(g) * u
        return y.to(torch.float32 if wt.dtype == torch.float32 else x.dtype)

    if tokens_per_expert is None:
        return one(a, w)
    outs, start = [], 0
    for e, c in enumerate(tokens_per_expert.tolist()):
        outs.append(one(a[start : start + c], w[e]))
        start += c
    return torch.cat(outs)


def tolerance(ref: torch.Tensor, gated: bool, bf16_out: bool) -> torch.Tensor:
    """bf16 output: one rounding can flip (2 ulp of |ref|), gated two more (4); fp32 output: the sum order only."""
    if bf16_out:
        return (4 if gated else 2) * 2.0**-8 * ref.abs() + 1e-2
    return 1e-5 * ref.abs() + 1e-5


def test_rows_block_is_the_next_power_of_two_up_to_max_rows():
    assert [sk.rows_block(m) for m in (1, 2, 3, 5, 6, 8, 9, 64)] == [1, 2, 4, 8, 8, 8, 8, 8]


def test_config_is_the_engine_variant():
    assert sk.config_for(2048, 6, True, False, torch.bfloat16, torch.bfloat16, torch.bfloat16) == (
        2048, 8, True, False, "bfloat16", "bfloat16", "bfloat16", sk.ROWS_PER_WARP, sk.UNROLL)


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
    """run_parallel's stream choice: one token row keeps the branches in order (a stream fork would break the
    programmatic launch chain), more rows fork a second stream; never without a device."""
    from deepinfer_npu.backends.cuda import kernels as ck

    ks = ck.CudaKernelSet()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [ks.branches.parallel(r) for r in (1, 2, 16, None)] == [False, True, True, True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not ks.branches.parallel(16)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}-E{c[3]}-g{int(c[4])}-{c[5]}x{c[6]}")
def test_skinny_gemm_matches_fp32_reference_gpu(case):
    """Against the fp32 GEMM rounded like the reference (fp32 sums in another order): bf16 outputs within 2 bf16
    ulp of |ref| + 1e-2 (gated: 4, the gate/up roundings can flip too), fp32 outputs within 1e-5 relative + 1e-5;
    NaN positions equal; cosine > 0.99999."""
    from deepinfer_npu.kernels_cuda.moe_gemm import expert_starts

    m, n, k, e, gated, ad, wd = case
    if e:
        a, w, counts = expert_rows(max(1, m // 6), 6, e, n, k)
    else:
        (a, w), counts = dense_rows(m, n, k, getattr(torch, ad), getattr(torch, wd)), None
    got = sk.skinny_gemm(a, w, gated=gated, scan=expert_starts(counts) if e else None)
    ref = reference(a, w, gated, counts).float()
    ok, stats = close_to(got, ref, tolerance(ref, gated, bf16_out=(ad, wd) == ("bfloat16", "bfloat16")))
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("m,n,k,e,gated", [(1, 3072, 2048, 0, False), (6, 2816, 2048, 64, True)])
def test_column_groups_variant_gpu(m, n, k, e, gated):
    """col_iters = 4 (a CTA takes four column groups in turn; a benchmark variant) computes the same GEMM."""
    from deepinfer_npu.kernels_cuda.moe_gemm import expert_starts

    a, w, counts = expert_rows(1, 6, e, n, k) if e else (*dense_rows(m, n, k), None)
    cfg = sk.config_for(k, min(m, 2) if e else m, gated, e > 0, "bfloat16", "bfloat16", "bfloat16")[:7] + (1, 4, 4)
    out = torch.empty(a.shape[0], n // 2 if gated else n, dtype=torch.bfloat16, device="cuda")
    kern = sk.get_kernel(*cfg)
    kern(a, w, expert_starts(counts), out) if e else kern(a, w, out)
    ref = reference(a, w, gated, counts).float()
    assert bool(((out.float() - ref).abs() <= tolerance(ref, gated, bf16_out=True)).all())


@pytest.mark.gpu
@pytest.mark.tilelang
def test_skinny_gemm_rejects_bad_scan_gpu():
    a = torch.zeros(6, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(4, 16, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="scan must be expert_starts"):
        sk.skinny_gemm(a, w, scan=torch.zeros(3, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
@pytest.mark.tilelang
def test_kernel_set_one_row_paths_match_reference_gpu():
    """The CUDA kernel set's 1-row linear, dense_mlp (SwiGLU in the gate/up epilogue) and router_logits (bf16 row x
    fp32 router) with the default variant, against the reference ops in fp32 (bf16 outputs: 2 ulp of |ref| + 1e-2;
    the gated path 4)."""
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
    for rows in (1, 5, 16, 17):  # skinny_gemm up to 16 rows (two row blocks of 8 at 16), tensor cores above
        xr = torch.randn(rows, 2048, device="cuda", generator=g).to(bf)
        want = F.linear(xr.float(), router)
        # past 16 rows: the bf16 split on the tensor cores (tests/cuda/test_router_tensor_cores.py's tolerance)
        tol = 1e-5 * want.abs() + 1e-5 + (2.0**-15 * (xr.float().abs() @ router.abs().t()) if rows > 16 else 0)
        assert ((ks.router_logits(xr, router) - want).abs() <= tol).all(), rows
    assert "the fp32 router on up to 16 bf16 rows" in ks.op_report()["linear"]
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
    """mla_epilogue's W_UV through skinny_gemm applies to one token on a CUDA device; on host tensors the
    reference arithmetic runs. The per-head scan is not made inside a graph capture (None: cuBLAS then).
    (The warm-up's W_UV configuration: tests/cuda/test_kernel_warmup_configs.py.)"""
    from deepinfer_npu.backends.cuda import kernels as ck

    ks = ck.CudaKernelSet()
    epilogue = ks.impl("mla_epilogue")
    w = _mla_weights()
    lat = torch.randn(1, 16, 512).bfloat16()
    assert epilogue.w_uv_skinny(lat, w) is None  # host tensor
    out = ks.mla_epilogue(lat, w)
    want = torch.nn.functional.linear(torch.einsum("thl,hvl->thv", lat, w.w_uv).reshape(1, -1), w.o_proj)
    assert torch.equal(out, want)
    assert "reference arithmetic" in ks.op_report()["mla_epilogue"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert epilogue.head_scan(16, "cpu") is None and not epilogue._head_scans
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert epilogue.head_scan(4, "cpu").tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert epilogue.head_scan(4, "cpu") is epilogue._head_scans[(4, "cpu")]  # made once


@pytest.mark.gpu
@pytest.mark.tilelang
def test_w_uv_skinny_matches_reference_gpu(monkeypatch):
    """W_UV of one token on skinny_gemm (the heads as experts) against the fp32 reference: bf16 within 2 ulp of
    |ref| + 1e-3, the same rows; more tokens keep cuBLAS."""
    from deepinfer_npu.backends.cuda import kernels as ck

    ks = ck.CudaKernelSet()
    w = _mla_weights(device="cuda")
    lat = (torch.randn(1, 16, 512, device="cuda") * 0.5).bfloat16()
    got = ks.impl("mla_epilogue").w_uv_skinny(lat, w)
    assert got is not None and got.shape == (1, 16 * 128)
    ref = torch.einsum("thl,hvl->thv", lat.float(), w.w_uv.float()).reshape(1, -1)
    tol = 2 * 2.0**-8 * ref.abs() + 1e-3
    assert bool(((got.float() - ref).abs() <= tol).all()), float((got.float() - ref).abs().max())
    assert ks.impl("mla_epilogue").w_uv_skinny(lat.expand(2, 16, 512).contiguous(), w) is None
    ks.mla_epilogue(lat, w)
    assert "skinny_gemm grouped" in ks.op_report()["mla_epilogue"]
