"""``MLAWeights.fused_a_proj``: the MLA layer allocates the query's first projection (q_proj or q_a_proj) and
kv_a_proj as row slices of one tensor, and the CUDA kernel set runs both as one ``skinny_gemm`` launch for one row.
Anywhere: the layer's sharing (and its loss when a weight is replaced or the layer is biased), and the kernel
set's choice with a stand-in skinny module (outputs identical to the two-launch path, which is the reference's
arithmetic). On a GPU: the real kernel, bit-identical to the two separate launches (skinny_gemm computes each output
column alone), for q_proj (V2-Lite) and q_a_proj (V3) layouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepinfer_npu.backends.cpu import mla as ref_mla
from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
from deepinfer_npu.model_executor.layers.mla import MLAAttention


def _layer(q_lora_rank=None, attention_bias=False, dtype=torch.float32, device="cpu", d=256, heads=4, seed=0):
    cfg = SimpleNamespace(num_attention_heads=heads, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                          kv_lora_rank=64, softmax_scale=48**-0.5, hidden_size=d, attention_bias=attention_bias,
                          q_lora_rank=q_lora_rank, qk_head_dim=48, quant=None)
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


@pytest.mark.parametrize("q_lora_rank", [None, 96])
def test_cuda_kernel_set_runs_one_gemm_for_one_row(q_lora_rank, monkeypatch):
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
        assert (fused_shape in stand_in.calls) == (rows == 1), (rows, stand_in.calls)
    assert "one kernels_cuda.skinny_gemm launch (fused_a_proj)" in ks.op_report()["mla_prolog"]


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
