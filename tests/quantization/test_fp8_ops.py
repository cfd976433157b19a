"""The CPU reference FP8 ops: fp8_linear / fp8_grouped_mlp / the MLA FP8 prolog and epilogue against fp32 math on
the dequantised operands, and against the unquantised ops within FP8 error."""

from __future__ import annotations

import torch

from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.hal.types import MLAWeights
from deepinfer_npu.model_executor.quantization import (
    dequantize_fp8_block,
    dequantize_per_token_group,
    quantize_fp8_block,
    quantize_per_token_group,
)

K = CpuKernelSet()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_linear_is_fp32_matmul_of_dequantised_operands():
    torch.manual_seed(0)
    x, w, bias = torch.randn(2, 7, 300), torch.randn(200, 300) * 0.05, torch.randn(200)
    wq, ws = quantize_fp8_block(w)
    got = K.fp8_linear(x, wq, ws, bias)
    xq, xs = quantize_per_token_group(x.reshape(-1, 300))
    want = dequantize_per_token_group(xq, xs) @ dequantize_fp8_block(wq, ws).t() + bias
    assert got.shape == (2, 7, 200) and got.dtype == x.dtype
    # tolerance: fp32 accumulation order only
    torch.testing.assert_close(got, want.view(2, 7, 200), rtol=1e-5, atol=1e-5)
    # and within FP8 (e4m3, 3 mantissa bits) error of the unquantised product: ~2-3 % relative in norm
    assert _rel(got, x @ w.t() + bias) < 0.05


def test_fp8_linear_bf16_activations_return_bf16():
    torch.manual_seed(1)
    x, w = torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(128, 256) * 0.05
    wq, ws = quantize_fp8_block(w)
    out = K.fp8_linear(x, wq, ws)
    assert out.dtype == torch.bfloat16 and _rel(out, x.float() @ w.t()) < 0.05


def test_fp8_grouped_mlp_matches_per_expert_composition():
    torch.manual_seed(2)
    e, i, d = 3, 64, 160
    w13, w2 = torch.randn(e, 2 * i, d) * 0.05, torch.randn(e, d, i) * 0.05
    (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    counts = torch.tensor([4, 0, 3])
    x = torch.randn(7, d)
    got = K.fp8_grouped_mlp(x, counts, q13, s13, q2, s2)
    rows = [(0, x[:4]), (2, x[4:])]
    want = torch.cat([K.fp8_linear(K.silu_and_mul(K.fp8_linear(r, q13[ex], s13[ex])), q2[ex], s2[ex])
                      for ex, r in rows])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _rel(got, K.grouped_mlp(x, counts, w13, w2)) < 0.06


def _mla_weights(q_lora: bool):
    torch.manual_seed(3)
    h, n, r, v, lrank, d, qr = 2, 16, 8, 16, 32, 64, 48
    mk = lambda *s: torch.randn(*s) * 0.1
    w = MLAWeights(num_heads=h, qk_nope_head_dim=n, qk_rope_head_dim=r, v_head_dim=v, kv_lora_rank=lrank,
                   kv_a_proj=mk(lrank + r, d), kv_a_layernorm=torch.rand(lrank) + 0.5, w_uk=mk(h, n, lrank),
                   w_uv=mk(h, v, lrank), o_proj=mk(d, h * v))
    if q_lora:
        w.q_a_proj, w.q_a_layernorm, w.q_b_proj = mk(qr, d), torch.rand(qr) + 0.5, mk(h * (n + r), qr)
    else:
        w.q_proj = mk(h * (n + r), d)
    return w


class _Rope:
    def __init__(self, r: int) -> None:
        inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
        ang = torch.arange(64).float()[:, None] * inv[None]
        self.cos_sin_cache, self.interleaved = torch.cat((ang.cos(), ang.sin()), -1), True


def test_mla_prolog_and_epilogue_quant_match_the_dequantised_ops():
    for q_lora in (False, True):
        w = _mla_weights(q_lora)
        fields = ["kv_a_proj", "o_proj"] + (["q_a_proj", "q_b_proj"] if q_lora else ["q_proj"])
        wq, scales, wd = MLAWeights(**vars(w)), {}, MLAWeights(**vars(w))
        for f in fields:
            q, s = quantize_fp8_block(getattr(w, f))
            setattr(wq, f, q)
            scales[f] = s
            setattr(wd, f, dequantize_fp8_block(q, s))
        t, rope = 5, _Rope(w.qk_rope_head_dim)
        hidden, pos, slots = torch.randn(t, 64), torch.arange(t), torch.tensor([0, 1, 2, -1, 5])
        cache_q, cache_d = torch.zeros(2, 4, 40), torch.zeros(2, 4, 40)
        ql, qr = K.mla_prolog_quant(hidden, wq, scales, pos, rope, cache_q, slots)
        ql_d, qr_d = K.mla_prolog(hidden, wd, pos, rope, cache_d, slots)
        # the only difference left is the activations' 1 x 128 quantisation
        assert _rel(ql, ql_d) < 0.05 and _rel(qr, qr_d) < 0.05 and _rel(cache_q, cache_d) < 0.05
        assert (cache_q.view(-1, 40)[[3, 4, 6, 7]] == 0).all()  # slot -1 skipped
        out_latent = torch.randn(t, 2, 32)
        assert _rel(K.mla_epilogue_quant(out_latent, wq, scales), K.mla_epilogue(out_latent, wd)) < 0.05


def test_op_reports_list_the_fp8_ops():
    from deepinfer_npu.backends.ascend.kernels import AscendKernelSet

    assert all(K.op_report()[op] == "native" for op in ("fp8_linear", "fp8_grouped_mlp", "mla_prolog_quant"))
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    report = AscendKernelSet().op_report()
    assert report["fp8_linear"].startswith("fallback (FP8 not supported")
    assert report["w8a8_linear"].startswith("pending")  # decided at the first call from the dtype (profile)
    assert CudaKernelSet().op_report()["fp8_grouped_mlp"].startswith(("pending (kernels_cuda.fp8_quant", "fallback ("))
