"""The CUDA kernel set's FP8 ops (``fp8_linear`` / ``fp8_grouped_mlp``, backends/cuda/ops/quant.py): the FP8 kernels
where they apply, else the CPU reference op with the reason in the op report; the start-up warm-up lists the FP8
kernel configurations an FP8 model reaches. Selection and warm-up lists run everywhere; numerics on an H200."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_npu.backends.cpu import quant as ref
from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
from deepinfer_npu.backends.cuda.ops import OpConfig
from deepinfer_npu.hal.types import KernelWarmupPlan
from deepinfer_npu.model_executor.quantization.fp8 import dequantize_fp8_block, quantize_fp8_block

BF16 = torch.bfloat16


def fp8_plan(plan: KernelWarmupPlan, **extra) -> KernelWarmupPlan:
    """``plan`` with the FP8 facts the warm-up reads (``quantization``, the FP8 projections' ``(N, K)``)."""
    return dataclasses.replace(plan, **{"quantization": "fp8", **extra})


def test_host_tensors_take_the_reference_with_the_reason():
    ks = CudaKernelSet()
    ks.select(OpConfig(dtype=BF16, sm90=True))
    x = torch.randn(3, 256).to(BF16)
    w, s = quantize_fp8_block(torch.randn(192, 256))
    assert torch.equal(ks.fp8_linear(x, w, s), ref.fp8_linear(x, w, s))
    counts = torch.tensor([2, 0, 1])
    w13, s13 = quantize_fp8_block(torch.randn(3, 256, 256))
    w2, s2 = quantize_fp8_block(torch.randn(3, 256, 128))
    assert torch.equal(ks.fp8_grouped_mlp(x, counts, w13, s13, w2, s2),
                       ref.fp8_grouped_mlp(x, counts, w13, s13, w2, s2))
    report = ks.op_report()
    assert report["fp8_linear"] == "fallback (reference (tensor not on a CUDA device))", report["fp8_linear"]
    assert report["fp8_grouped_mlp"].startswith("fallback (reference (tensor not on a CUDA device)")
    assert ks.syncing_ops() == {}  # host reads of host tensors are free


def test_off_hopper_the_kernels_are_off_with_the_reason():
    ks = CudaKernelSet()
    ks.select(OpConfig(dtype=BF16, sm90=False))
    report = ks.op_report()
    assert report["fp8_linear"].startswith("fallback (kernels_cuda.fp8_gemm off: FP8 wgmma kernels are built for "
                                           "Hopper"), report["fp8_linear"]
    assert report["fp8_grouped_mlp"].startswith("fallback (kernels_cuda.fp8_grouped_gemm off")
    ks.select(OpConfig(dtype=torch.float32, sm90=True))
    assert "take bf16 activations" in ks.op_report()["fp8_linear"]


def test_decode_graphs_may_capture_fp8_only_with_its_kernels():
    ks = CudaKernelSet()
    ks.select(OpConfig(dtype=BF16, sm90=True))
    assert ks.quantization_capture_refusal(None) is None
    assert "reference" in ks.quantization_capture_refusal("w8a8")
    if ks.modules.get("fp8_gemm") is not None and ks.modules.get("fp8_grouped_gemm") is not None:
        assert ks.quantization_capture_refusal("fp8") is None
        assert ks.quantization_capture_refusal("fp8", hidden_size=2048, moe_intermediate_size=1408) is None
        # experts the grouped kernel does not take run the syncing reference op: no graphs
        assert "N=2080" in ks.quantization_capture_refusal("fp8", hidden_size=2048, moe_intermediate_size=1040)
    ks.select(OpConfig(dtype=BF16, sm90=False))
    assert "kernels_cuda.fp8_gemm off: FP8 wgmma kernels are built for Hopper" in ks.quantization_capture_refusal("fp8")


@pytest.mark.tilelang
def test_warmup_lists_the_fp8_configurations(v2_lite_plan, monkeypatch):
    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "1")
    from deepinfer_npu.kernels_cuda import fp8_gemm, fp8_grouped_gemm, fp8_quant

    # q_proj, kv_a_proj, o_proj; the dense layer's and the shared experts' down and gate/up projections
    shapes = ((3072, 2048), (576, 2048), (2048, 2048), (2048, 10944), (2048, 2816), (21888, 2048), (5632, 2048))
    base = v2_lite_plan()
    plan = fp8_plan(base, fp8_linear_shapes=shapes)
    ks = CudaKernelSet()
    ks.select(OpConfig.from_plan(plan, sm90=True))
    cfgs = ks.warmup_configs(plan, 132)
    lo, hi = 1, max(plan.max_num_batched_tokens, *plan.decode_graph_sizes)
    assert set(cfgs["fp8_gemm"]) == {c for n, k in shapes for m in range(lo, hi + 1)
                                     for c in fp8_gemm.configs_for(n, k, m)}
    assert ("reduce", (576, 4, 256)) in cfgs["fp8_gemm"]  # kv_a_proj's K slices at decode
    g, d, inter = plan.moe_gating, plan.hidden_size, plan.moe_intermediate_size
    rows = range(lo * g.top_k, hi * g.top_k + 1)
    assert set(cfgs["fp8_grouped_gemm"]) == {fp8_grouped_gemm.config_for(n, k, m, g.num_experts)
                                             for n, k in ((2 * inter, d), (d, inter)) for m in rows}
    assert fp8_quant.config_for(inter, 6, True) in cfgs["fp8_quant"]
    assert ("expert_scan", (g.num_experts,)) in cfgs["moe_gemm"]
    # fp8_dense_mlp's gated quantisation at the dense / shared-expert widths
    assert {fp8_quant.config_for(i, 1, True) for i in plan.mlp_intermediate_sizes} <= set(cfgs["fp8_quant"])
    # the fused q / kv_a projection: at every row count, in place of q_proj's and kv_a_proj's configurations
    fused_plan = fp8_plan(base, fp8_linear_shapes=shapes, fp8_one_row_shapes=((3648, 2048),))
    fused = ks.warmup_configs(fused_plan, 132)
    assert set(fused["fp8_gemm"]) == {c for n, k in ((3648, 2048), *shapes[2:]) for m in range(lo, hi + 1)
                                      for c in fp8_gemm.configs_for(n, k, m)}
    # DEEPINFER_FUSED_A_PROJ=0: at one row only, beside the two parts'
    monkeypatch.setenv("DEEPINFER_FUSED_A_PROJ", "0")
    one_row = ks.warmup_configs(fused_plan, 132)
    assert set(one_row["fp8_gemm"]) - set(cfgs["fp8_gemm"]) == set(fp8_gemm.configs_for(3648, 2048, 1))
    monkeypatch.setenv("DEEPINFER_FUSED_A_PROJ", "1")
    # one-row steps: the one-launch FP8 GEMM for each projection of at most SKINNY_MAX_WEIGHTS values (not the
    # dense layer's down projection, 2048 x 10944) and the shared experts' gated gate/up (2 x 2816 x 2048; not the
    # dense layer's 2 x 10944 x 2048)
    from deepinfer_npu.kernels_cuda import fp8_skinny_gemm as fs

    # (K, rows, gated, columns a warp): q_proj (3072) and o_proj (2048) two a warp, kv_a_proj (576) one, the
    # shared experts' down (K = 2816) two, their gate/up (2816 gated columns) one, and not plain (5632 columns:
    # four a warp), which fp8_dense_mlp never launches
    assert set(cfgs["fp8_skinny_gemm"]) == {(2048, 1, False, 2), (2048, 1, False, 1), (2816, 1, False, 2),
                                            (2048, 1, True, 1)}
    assert fs.config_for(2048, 1, True, n_out=2816) == (2048, 1, True, 1)
    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "0")
    assert "fp8_skinny_gemm" not in ks.warmup_configs(plan, 132)
    # a bf16 engine compiles none of them
    assert not {"fp8_gemm", "fp8_grouped_gemm", "fp8_quant", "fp8_skinny_gemm"} & set(ks.warmup_configs(base, 132))


@pytest.mark.gpu
@pytest.mark.tilelang
# 48 and 300: partial 64- and 128-row tiles; past 64 rows M % 4 = 1, 2, 3 and K / 128 = 11 (not a multiple of 4):
# the forms cuBLASLt's block-scaled GEMM is checked in (scaled_mm.py)
@pytest.mark.parametrize("rows,k", [(1, 2048), (48, 2048), (300, 2048), (97, 2048), (98, 1408), (299, 1408)])
def test_fp8_linear_runs_the_kernels_and_matches_the_reference_gpu(rows, k, monkeypatch):
    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "1")
    ks = CudaKernelSet()
    x = (torch.randn(rows, k, device="cuda") * 0.3).to(BF16)
    w, s = quantize_fp8_block(torch.randn(3072, k, device="cuda") * 0.02)
    bias = torch.randn(3072, device="cuda").to(BF16)
    # The reference runs on the CPU: torch on CUDA divides by a scalar through its reciprocal, one ulp off the IEEE
    # quotient the kernel (and the CPU) computes, which moves some e4m3 codes by a step. The kernel path rounds the
    # product to bf16, adds the bias in fp32 and rounds again; the reference rounds once. Bound per element: each
    # run's final rounding (2**-8 of its value), the kernel's rounding of the product before the bias (2**-8 of
    # it), and the fp8 wgmma accumulation (2**-12 of the products' magnitudes, as tests/kernels_cuda/
    # test_fp8_gemm.py); a wrong scale or row moves an element by its own size.
    xc, wc, sc = x.cpu().view(1, rows, k), w.cpu(), s.cpu()
    product = ref.fp8_linear(xc, wc, sc).float()
    magnitude = ref.quantize_activations(x.cpu()).abs() @ dequantize_fp8_block(wc, sc).abs().t()
    for b in (None, bias):
        got = ks.fp8_linear(x.view(1, rows, k), w, s, b)
        want = ref.fp8_linear(xc, wc, sc, None if b is None else b.cpu())
        assert got.shape == want.shape == (1, rows, 3072) and got.dtype == BF16
        got, want = got.float().cpu(), want.float()
        bound = 2.0**-8 * (got.abs() + want.abs() + product.abs()) + 2.0**-12 * magnitude.view_as(want)
        excess = ((got - want).abs() - bound).flatten()
        i = int(excess.argmax())
        assert excess[i] <= 0, dict(bias=b is not None, beyond=int((excess > 0).sum()), got=got.flatten()[i].item(),
                                    want=want.flatten()[i].item(), product=product.flatten()[i].item(),
                                    magnitude=magnitude.flatten()[i].item(), bound=bound.flatten()[i].item())
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999
    report = ks.op_report()["fp8_linear"]
    if rows == 1:  # the quantisation inside the one-row GEMM (kernels_cuda.fp8_skinny_gemm)
        assert report == "native (kernels_cuda.fp8_skinny_gemm (one row: the quantisation inside the GEMM))", report
    elif rows <= 64:
        assert report == "native (kernels_cuda.fp8_quant + kernels_cuda.fp8_gemm)", report
    else:  # cuBLASLt's block-scaled GEMM where its check agreed with the tile kernel (scaled_mm.py)
        assert report.startswith("native (kernels_cuda.fp8_quant + ") and "torch._scaled_mm" in report, report
    assert ks.syncing_ops() == {}


def test_mla_quant_ops_on_host_tensors_take_the_reference():
    ks = CudaKernelSet()
    w, scales = _mla_fp8_weights("cpu", q_lora=False, dtype=torch.float32, heads=2, hidden=256)
    t = 3
    out = torch.randn(t, 2, 512)
    assert torch.equal(ks.mla_epilogue_quant(out, w, scales), ref.mla_epilogue_quant(out, w, scales))
    assert ks.op_report()["mla_epilogue_quant"] == "fallback (reference (tensor not on a CUDA device))"


def _mla_fp8_weights(device, q_lora: bool, dtype=BF16, heads: int = 16, hidden: int = 2048):
    """DeepSeek MLA weights (nope 128, rope 64, v 128, kv_lora 512; q_lora 1536) with FP8 projections."""
    from deepinfer_npu.hal.types import MLAWeights

    g = torch.Generator(device=device).manual_seed(5)
    h, n, r, v, lrank, qr = heads, 128, 64, 128, 512, 1536

    def mk(*s):
        return (torch.randn(*s, generator=g, device=device) * s[-1] ** -0.5).to(dtype)

    w = MLAWeights(num_heads=h, qk_nope_head_dim=n, qk_rope_head_dim=r, v_head_dim=v, kv_lora_rank=lrank,
                   kv_a_proj=mk(lrank + r, hidden), kv_a_layernorm=(torch.rand(lrank, device=device) + 0.5).to(dtype),
                   w_uk=mk(h, n, lrank), w_uv=mk(h, v, lrank), o_proj=mk(hidden, h * v))
    if q_lora:
        w.q_a_proj, w.q_b_proj = mk(qr, hidden), mk(h * (n + r), qr)
        w.q_a_layernorm = (torch.rand(qr, device=device) + 0.5).to(dtype)
    else:
        w.q_proj = mk(h * (n + r), hidden)
    scales = {}
    for f in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "o_proj"):
        if getattr(w, f) is not None:
            q, scales[f] = quantize_fp8_block(getattr(w, f))
            setattr(w, f, q)
    return w, scales


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("q_lora", [False, True])
@pytest.mark.parametrize("tokens", [1, 40])
def test_mla_quant_ops_match_the_reference_ops_gpu(q_lora, tokens, monkeypatch):
    """Same quantised projections, the same activation quantisation: close to the reference op on the device
    (bf16 roundings of intermediate results differ): relative Frobenius error < 1e-2; with a q-LoRA, q (its latent
    and rope parts) goes through two quantised GEMMs with a requantisation between them, where a bf16 ulp moves
    some e4m3 values by a step: < 2.5e-2 (measured on an H200: 0.0115-0.0142)."""
    from types import SimpleNamespace

    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "1")
    w, scales = _mla_fp8_weights("cuda", q_lora)
    hidden = (torch.randn(tokens, 2048, device="cuda") * 0.5).to(BF16)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    ang = torch.arange(4096, device="cuda").float()[:, None] * inv[None]
    rope = SimpleNamespace(cos_sin_cache=torch.cat((ang.cos(), ang.sin()), -1), interleaved=True)
    pos = torch.arange(tokens, device="cuda") + 7
    slots = torch.arange(tokens, device="cuda") + 64  # block 1 onwards: block 0 is the reserved padding block
    ks = CudaKernelSet()
    cache, cache_ref = (torch.zeros(4, 64, 576, device="cuda", dtype=BF16) for _ in range(2))
    got = ks.mla_prolog_quant(hidden, w, scales, pos, rope, cache, slots)
    want = ref.mla_prolog_quant(hidden, w, scales, pos, rope, cache_ref, slots)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    q_limit = 2.5e-2 if q_lora else 1e-2
    assert rel(got[0], want[0]) < q_limit and rel(got[1], want[1]) < q_limit and rel(cache, cache_ref) < 1e-2
    out_latent = torch.randn(tokens, 16, 512, device="cuda").to(BF16)
    assert rel(ks.mla_epilogue_quant(out_latent, w, scales), ref.mla_epilogue_quant(out_latent, w, scales)) < 1e-2
    report = ks.op_report()
    assert report["mla_prolog_quant"].startswith("native (fp8_linear projections"), report["mla_prolog_quant"]
    # the bf16 prolog's tail: kv_a layernorm, both ropes and the cache write in one launch
    assert "kernels_cuda.mla_rope_cache" in report["mla_prolog_quant"], report["mla_prolog_quant"]
    one_row = "native (kernels_cuda.fp8_skinny_gemm (one row: the quantisation inside the GEMM))"
    assert report["fp8_linear"] == (one_row if tokens == 1 else "native (kernels_cuda.fp8_quant + "
                                    "kernels_cuda.fp8_gemm)"), report["fp8_linear"]


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("rows", [1, 16, 100])
def test_fp8_dense_mlp_is_the_composition_gpu(rows, monkeypatch):
    """The shared experts' width (2 x 1408): the gated quantisation (SwiGLU fused) gives exactly the composition
    ``fp8_linear(silu_and_mul(fp8_linear(x)))`` on the same kernels (same roundings, same GEMMs)."""
    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "1")
    ks = CudaKernelSet()
    ks.select(OpConfig(dtype=BF16, sm90=True))
    x = (torch.randn(rows, 2048, device="cuda") * 0.3).to(BF16)
    w13, s13 = quantize_fp8_block(torch.randn(2 * 2816, 2048, device="cuda") * 0.02)
    w2, s2 = quantize_fp8_block(torch.randn(2048, 2816, device="cuda") * 0.02)
    got = ks.fp8_dense_mlp(x, w13, s13, w2, s2)
    want = ks.fp8_linear(ks.silu_and_mul(ks.fp8_linear(x, w13, s13)), w2, s2)
    assert got.shape == (rows, 2048) and torch.equal(got, want)
    want_path = "SwiGLU in the gate/up GEMM" if rows == 1 else "SwiGLU fused into the down projection's quantisation"
    assert want_path in ks.op_report()["silu_and_mul"], ks.op_report()["silu_and_mul"]
