"""``MLAWeights.fused_a_proj``: the MLA layer allocates the query's first projection (q_proj or q_a_proj) and
kv_a_proj as row slices of one tensor, and the CUDA kernel set runs both as one ``skinny_gemm`` launch for one row.
Anywhere: the layer's sharing (and its loss when a weight is replaced or the layer is biased), and the kernel
set's choice with a stand-in skinny module (outputs identical to the two-launch path, which is the reference's
arithmetic). On a GPU: the real kernel, bit-identical to the two separate launches (skinny_gemm computes each output
column alone), for q_proj (V2-Lite) and q_a_proj (V3) layouts. FP8 (block-scaled) projections share their weights and
scales the same way where the first projection's rows are whole 128-row blocks; the CUDA kernel set then runs one
``fp8_linear`` for one row (on a GPU: close to the reference prolog and to the two-GEMM path)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepinfer_npu.backends.cpu import mla as ref_mla
from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
from deepinfer_npu.model_executor.layers.linear import QuantLinear
from deepinfer_npu.model_executor.layers.mla import MLAAttention
from deepinfer_npu.model_executor.quantization.config import QuantConfig


def _layer(q_lora_rank=None, attention_bias=False, dtype=torch.float32, device="cpu", d=256, heads=4, seed=0,
           dims=(32, 16, 32, 64)):
    """dims: (nope, rope, v, kv_lora); DeepSeek's are (128, 64, 128, 512)."""
    nope, rope, v, lrank = dims
    cfg = SimpleNamespace(num_attention_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
                          kv_lora_rank=lrank, softmax_scale=(nope + rope) ** -0.5, hidden_size=d,
                          attention_bias=attention_bias, q_lora_rank=q_lora_rank, qk_head_dim=nope + rope, quant=None)
    layer = MLAAttention(cfg, SimpleNamespace(), CpuKernelSet(), dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed)
    for p in layer.parameters():  # as the loader does: a copy into each parameter
        p.data.copy_((torch.randn(p.shape, generator=g) * 0.05).to(dtype))
    return layer


@pytest.mark.parametrize("q_lora_rank", [None, 96])
def test_layer_weights_are_slices_of_one_tensor(q_lora_rank):
    layer = _layer(q_lora_rank)
    w = layer.weights()
    first = w.q_proj if q_lora_rank is None else w.q_a_proj
    assert w.fused_a_proj is not None and torch.equal(w.fused_a_proj, torch.cat([first, w.kv_a_proj]))
    assert sum(p.numel() for p in layer.parameters()) == sum(  # no extra parameter, no copy
        p.numel() for p in _layer(q_lora_rank, attention_bias=True).parameters()) - 64 - 16 - (
        0 if q_lora_rank is None else q_lora_rank) - 256  # the biased layer's kv_a / q_a / o biases
    layer.kv_a_proj_with_mqa.weight = torch.nn.Parameter(w.kv_a_proj.clone(), requires_grad=False)
    assert layer.weights().fused_a_proj is None  # no longer its slice: the backend runs two GEMMs
    assert _layer(q_lora_rank, attention_bias=True).weights().fused_a_proj is None


class _StandInSkinny:
    DENSE_MAX_ROWS = 1

    def __init__(self):
        self.calls = []

    def skinny_gemm(self, x, w):
        self.calls.append(tuple(w.shape))
        return x @ w.t()


@pytest.mark.parametrize("fused_multi_row", ["1", "0"])
@pytest.mark.parametrize("q_lora_rank", [None, 96])
def test_cuda_kernel_set_runs_one_gemm(q_lora_rank, fused_multi_row, monkeypatch):
    """One row: one GEMM for both projections. More rows: one GEMM too where the query is q_proj's and
    DEEPINFER_FUSED_A_PROJ is on (q and kv then strided column slices of its output), else two."""
    monkeypatch.setenv("DEEPINFER_FUSED_A_PROJ", fused_multi_row)
    layer = _layer(q_lora_rank)
    w = layer.weights()
    ks = CudaKernelSet()
    stand_in = _StandInSkinny()
    monkeypatch.setattr(ks.impl("linear"), "skinny", lambda x, weight, *a, **k: (stand_in, None))
    rope = SimpleNamespace(cos_sin_cache=torch.randn(64, 16), interleaved=True)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3):
        hidden = torch.randn(rows, 256, generator=g)
        cache, ref_cache = torch.zeros(4, 16, 80), torch.zeros(4, 16, 80)
        pos, slots = torch.arange(rows), torch.arange(rows) + 16
        stand_in.calls.clear()
        ql, qr = ks.mla_prolog(hidden, w, pos, rope, cache, slots)
        rl, rr = ref_mla.mla_prolog(hidden, w, pos, rope, ref_cache, slots)
        torch.testing.assert_close(ql, rl, rtol=1e-6, atol=1e-6)  # fp32: x @ w.t() vs F.linear
        assert torch.equal(qr, rr) or torch.allclose(qr, rr, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6)
        fused_shape = tuple(w.fused_a_proj.shape)
        fused_here = rows == 1 or (q_lora_rank is None and fused_multi_row == "1")
        assert (fused_shape in stand_in.calls) == fused_here, (rows, stand_in.calls)
        assert len(stand_in.calls) == (1 if fused_here else 2) + (q_lora_rank is not None), stand_in.calls  # + q_b
    report = ks.op_report()["mla_prolog"]
    assert "one kernels_cuda.skinny_gemm launch (fused_a_proj)" in report
    assert ("of more than one row: one GEMM (fused_a_proj)" in report) == (q_lora_rank is None and
                                                                         fused_multi_row == "1"), report


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("q_lora_rank", [None, 1536])
def test_fused_launch_bit_identical_to_two_launches_gpu(q_lora_rank):
    from deepinfer_npu.kernels_cuda import skinny_gemm as sk

    layer = _layer(q_lora_rank, dtype=torch.bfloat16, device="cuda", d=2048, heads=16)
    w = layer.weights()
    first = w.q_proj if q_lora_rank is None else w.q_a_proj
    hidden = (torch.randn(1, 2048, device="cuda") * 0.5).to(torch.bfloat16)
    ks = CudaKernelSet()
    got_first, got_kv = ks.impl("mla_prolog").fused_a_proj(hidden, w)
    assert torch.equal(got_first, sk.skinny_gemm(hidden, first))
    assert torch.equal(got_kv, sk.skinny_gemm(hidden, w.kv_a_proj))
    assert got_kv.is_contiguous() and got_kv.stride() == (w.kv_a_proj.shape[0], 1)


def _fp8_layer(q_lora_rank=None, heads=8, attention_bias=False, dims=None, device="cpu", seed=0):
    """An MLA layer with FP8 projections quantised at load from random values (as the loader does: each
    projection's ``load_checkpoint_tensor``). Default dims: q_proj 8 x 48 = 384 rows (three 128-row blocks)."""
    nope, rope, v, lrank, d = dims or (32, 16, 32, 64, 256)
    cfg = SimpleNamespace(num_attention_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
                          kv_lora_rank=lrank, softmax_scale=(nope + rope) ** -0.5, hidden_size=d,
                          attention_bias=attention_bias, q_lora_rank=q_lora_rank, qk_head_dim=nope + rope,
                          quant=QuantConfig(method="fp8"))
    layer = MLAAttention(cfg, SimpleNamespace(), CpuKernelSet(), dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for mod in layer.modules():
        if isinstance(mod, QuantLinear):
            value = torch.randn(mod.weight.shape, generator=g, device=device) * mod.weight.shape[1] ** -0.5
            mod.load_checkpoint_tensor("weight", value)
    for name, p in layer.named_parameters():
        if p.dtype == torch.bfloat16:
            p.data.copy_(torch.rand(p.shape, generator=g, device=device) + 0.5 if "norm" in name
                         else torch.randn(p.shape, generator=g, device=device) * 0.05)
    return layer


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("q_lora_rank", [None, 128])
def test_fp8_weights_and_scales_are_slices_of_one_tensor(q_lora_rank):
    layer = _fp8_layer(q_lora_rank)
    w, scales = layer.weights(), layer.quant_scales()
    first = "q_proj" if q_lora_rank is None else "q_a_proj"
    assert w.fused_a_proj is not None and w.fused_a_proj.dtype == torch.float8_e4m3fn
    assert torch.equal(_bytes(w.fused_a_proj), _bytes(torch.cat([getattr(w, first), w.kv_a_proj])))
    # the first projection's rows are whole blocks: its scale rows, then kv_a's (80 rows: one partial block)
    assert scales["fused_a_proj"].shape == (getattr(w, first).shape[0] // 128 + 1, 2)
    assert torch.equal(scales["fused_a_proj"], torch.cat([scales[first], scales["kv_a_proj"]]))
    kv = layer.kv_a_proj_with_mqa
    assert kv.weight.quant_scheme == "fp8"  # kept on the re-registered slices: dummy weights find the scheme
    kv.weight_scale_inv = torch.nn.Parameter(kv.weight_scale_inv.clone(), requires_grad=False)
    assert layer.weights().fused_a_proj is None and "fused_a_proj" not in layer.quant_scales()


def test_fp8_layers_whose_query_rows_are_not_whole_blocks_keep_two_weights():
    assert _fp8_layer(heads=4).weights().fused_a_proj is None  # q_proj 4 x 48 = 192 rows
    assert _fp8_layer(attention_bias=True).weights().fused_a_proj is None


@pytest.mark.gpu
@pytest.mark.tilelang
def test_fp8_fused_projection_of_one_row_gpu():
    """V2-Lite dims: q_proj [3072, 2048] and kv_a [576, 2048] as one FP8 GEMM [3648, 2048] for one row. Against the
    reference prolog (relative Frobenius error < 1e-2, the bound of test_fp8_quant_ops.py's MLA test) and against
    the two-GEMM path (the same dot products; only the fp32 order of the K slices differs for kv_a's columns:
    < 1e-2 too, measured near bf16's rounding)."""
    from deepinfer_npu.backends.cpu import quant as ref

    layer = _fp8_layer(heads=16, dims=(128, 64, 128, 512, 2048), device="cuda")
    w, scales = layer.weights(), layer.quant_scales()
    assert tuple(w.fused_a_proj.shape) == (3648, 2048)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    ang = torch.arange(64, device="cuda").float()[:, None] * inv[None]
    rope = SimpleNamespace(cos_sin_cache=torch.cat((ang.cos(), ang.sin()), -1), interleaved=True)
    hidden = (torch.randn(1, 2048, device="cuda") * 0.5).to(torch.bfloat16)
    pos, slots = torch.tensor([7], device="cuda"), torch.tensor([70], device="cuda")
    caches = [torch.zeros(4, 64, 576, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ks = CudaKernelSet()
    fused = ks.mla_prolog_quant(hidden, w, scales, pos, rope, caches[0], slots)
    assert "one fp8_linear (fused_a_proj)" in ks.op_report()["mla_prolog_quant"]
    unfused_scales = {k: v for k, v in scales.items() if k != "fused_a_proj"}
    two = ks.mla_prolog_quant(hidden, w, unfused_scales, pos, rope, caches[1], slots)
    want = ref.mla_prolog_quant(hidden, w, unfused_scales, pos, rope, caches[2], slots)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for got in (fused, two):
        assert rel(got[0], want[0]) < 1e-2 and rel(got[1], want[1]) < 1e-2
    assert rel(fused[0], two[0]) < 1e-2 and rel(fused[1], two[1]) < 1e-2
    assert rel(caches[0], caches[2]) < 1e-2 and rel(caches[0], caches[1]) < 1e-2


def _rope_table(device="cuda"):
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=device).float() / 64))
    ang = torch.arange(4096, device=device).float()[:, None] * inv[None]
    return SimpleNamespace(cos_sin_cache=torch.cat((ang.cos(), ang.sin()), -1), interleaved=True)


def _decode_step(rows):
    """A V2-Lite-dims decode step of ``rows`` tokens on the device: (rope table, hidden, positions, slots, three
    zeroed caches: the path under test's, the two-GEMM path's, the reference's)."""
    hidden = (torch.randn(rows, 2048, device="cuda") * 0.5).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (rows,), device="cuda")
    slots = torch.randperm(16 * 64, device="cuda")[:rows] + 64
    caches = [torch.zeros(17, 64, 576, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    return _rope_table(), hidden, pos, slots, caches


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("rows", [2, 64, 256])
def test_fused_projection_of_more_rows_gpu(rows, monkeypatch):
    """V2-Lite dims, bf16, decode steps of more than one row: one cuBLAS GEMM [T, 3648] whose slices W_UK and
    mla_rope_cache read in place, against the two-GEMM path (DEEPINFER_FUSED_A_PROJ=0) and the reference prolog.
    Each output column is the same dot product; cuBLAS may sum K in another order for another N, so the bound is
    bf16's: relative Frobenius error < 1e-2 (measured near one bf16 rounding), the written cache rows too."""
    layer = _layer(None, dtype=torch.bfloat16, device="cuda", d=2048, heads=16, dims=(128, 64, 128, 512))
    w = layer.weights()
    assert tuple(w.fused_a_proj.shape) == (3648, 2048)
    rope, hidden, pos, slots, caches = _decode_step(rows)
    fused_ks = CudaKernelSet()
    got = fused_ks.mla_prolog(hidden, w, pos, rope, caches[0], slots)
    assert "of more than one row: one GEMM (fused_a_proj)" in fused_ks.op_report()["mla_prolog"]
    assert "kernels_cuda.mla_rope_cache" in fused_ks.op_report()["mla_prolog"]
    monkeypatch.setenv("DEEPINFER_FUSED_A_PROJ", "0")
    two = CudaKernelSet().mla_prolog(hidden, w, pos, rope, caches[1], slots)
    want = ref_mla.mla_prolog(hidden, w, pos, rope, caches[2], slots)  # the reference ops in bf16 on the device
    for a, b in zip(got, two):
        assert _rel(a, b) < 1e-2
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-2
    assert _rel(caches[0], caches[1]) < 1e-2 and _rel(caches[0], caches[2]) < 1e-2


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("rows", [2, 16, 64, 100])
def test_fp8_fused_projection_of_more_rows_gpu(rows, monkeypatch):
    """The FP8 prolog at more rows: one fp8_linear [T, 3648] (its slices read in place) against the two-GEMM path
    and the reference prolog, within test_fp8_fused_projection_of_one_row_gpu's bound (1e-2)."""
    from deepinfer_npu.backends.cpu import quant as ref

    layer = _fp8_layer(heads=16, dims=(128, 64, 128, 512, 2048), device="cuda")
    w, scales = layer.weights(), layer.quant_scales()
    rope, hidden, pos, slots, caches = _decode_step(rows)
    ks = CudaKernelSet()
    fused = ks.mla_prolog_quant(hidden, w, scales, pos, rope, caches[0], slots)
    assert "of more than one row: one fp8_linear (fused_a_proj)" in ks.op_report()["mla_prolog_quant"]
    monkeypatch.setenv("DEEPINFER_FUSED_A_PROJ", "0")
    two = CudaKernelSet().mla_prolog_quant(hidden, w, scales, pos, rope, caches[1], slots)
    unfused_scales = {k: v for k, v in scales.items() if k != "fused_a_proj"}
    want = ref.mla_prolog_quant(hidden, w, unfused_scales, pos, rope, caches[2], slots)
    for got in (fused, two):
        assert _rel(got[0], want[0]) < 1e-2 and _rel(got[1], want[1]) < 1e-2
    assert _rel(fused[0], two[0]) < 1e-2 and _rel(fused[1], two[1]) < 1e-2
    assert _rel(caches[0], caches[2]) < 1e-2 and _rel(caches[0], caches[1]) < 1e-2
