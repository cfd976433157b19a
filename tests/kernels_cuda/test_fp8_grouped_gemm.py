"""kernels_cuda.fp8_grouped_gemm (the MoE experts' FP8 GEMM over rows sorted by expert) and the FP8 grouped MLP it
serves (quant -> w13 -> gated quant -> w2), against the fp32 reference of the dequantised operands.

Tolerances: the grouped GEMM as ``fp8_gemm`` (test_fp8_gemm.py: one bf16 rounding plus the fp8 wgmma accumulation
bound, cosine >= 0.99999). The whole MLP (CudaKernelSet.fp8_grouped_mlp) against the CPU reference op on the same
device: both round the w13 output to bf16 and quantise the SwiGLU per group, but a 1-ulp difference of the w13
output moves some e4m3 values of the second quantisation by one step (2**-3 of the value), and w2 sums those
steps: ``2**-6 * |ref| + 2**-4 * max|ref|`` per element (measured on an H200: up to 0.03 * max|ref|) and cosine
>= 0.999 (measured 0.9999); a wrong expert, row or scale moves elements by their own size.
Routing: random top-k (ragged counts), a skewed one (one expert with most rows, many empty), and every row on one
expert; V2-Lite experts (64 x [2816, 2048] / [2048, 1408], top-6) and V3's expert dims (7168, I = 2048, top-8) over
32 experts (the weights of all 256 do not change what a CTA computes), at 1, 16, 64, 512 and 4096 tokens.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.kernels_cuda import fp8_grouped_gemm, fp8_quant, moe_gemm
from deepinfer_npu.kernels_cuda.bench import precompile_in_processes
from deepinfer_npu.model_executor.quantization.fp8 import FP8_DTYPE, quantize_per_token_group

from test_fp8_gemm import (  # tests/kernels_cuda is on sys.path (pytest's rootdir-less test modules)
    ROWS,
    activations,
    check_close,
    fp8_weight,
    gemm_fp32,
    selected_params,
)

MODELS = {  # name: (experts, top_k, D, I)
    "v2lite": (64, 6, 2048, 1408),
    "v3": (32, 8, 7168, 2048),
}


def routing(tokens: int, experts: int, top_k: int, kind: str, device="cuda", seed=0) -> torch.Tensor:
    """tokens per expert (int64 [experts]) for ``tokens`` x ``top_k`` dispatched rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "one-expert":
        counts = torch.zeros(experts, dtype=torch.int64, device=device)
        counts[experts // 2] = tokens * top_k
        return counts
    if kind == "skewed":  # every token's first pick is expert 0, the others among experts 1 .. 7
        ids = torch.cat([torch.zeros(tokens, dtype=torch.long, device=device),
                         torch.randint(1, 8, (tokens * (top_k - 1),), generator=g, device=device)])
    else:
        ids = torch.stack([torch.randperm(experts, generator=g, device=device)[:top_k] for _ in range(tokens)])
    return torch.bincount(ids.flatten(), minlength=experts)


def grouped_fp32(aq, a_scale, wq, w_scale, counts, magnitude: bool = False) -> torch.Tensor:
    out = torch.zeros(aq.shape[0], wq.shape[1], device=aq.device)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out[start : start + c] = gemm_fp32(aq[start : start + c], a_scale[start : start + c], wq[e], w_scale[e],
                                               magnitude)
        start += c
    return out


# ---- everywhere --------------------------------------------------------------------------------------------------
def test_rejects_bad_operands_with_the_parameter_named():
    a, sa = torch.zeros(3, 256, dtype=FP8_DTYPE), torch.zeros(3, 2)
    w, sw = torch.zeros(2, 128, 256, dtype=FP8_DTYPE), torch.zeros(2, 1, 2)
    starts = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="K=256 but w is"):
        fp8_grouped_gemm.fp8_grouped_gemm(a, sa, w[..., :128], sw, starts)
    with pytest.raises(ValueError, match=r"w_scale \[2, 1, 2\]"):
        fp8_grouped_gemm.fp8_grouped_gemm(a, sa, w, sw[:1], starts)
    with pytest.raises(ValueError, match=r"\[2E\+1\] = \[5\]"):
        fp8_grouped_gemm.fp8_grouped_gemm(a, sa, w, sw, starts[:4])
    assert "multiple of 64" in fp8_grouped_gemm.reason(100, 256)


def test_configurations_by_rows():
    assert fp8_grouped_gemm.config_for(2816, 2048, 6, 64) == (2816, 2048, True, 8, 64, 4)
    assert fp8_grouped_gemm.config_for(2816, 2048, 96, 64) == (2816, 2048, True, 8, 64, 4)  # batch 16, top-6
    # batch 64, top-6: ~6 rows an expert, some past 8: 16-row tiles stream each expert's weights once
    assert fp8_grouped_gemm.config_for(2816, 2048, 384, 64) == (2816, 2048, True, 16, 64, 4)
    assert fp8_grouped_gemm.config_for(4096, 7168, 8, 256) == (4096, 7168, True, 8, 64, 6)  # V3 w13: K >= 4096
    assert fp8_grouped_gemm.config_for(7168, 2048, 8, 256) == (7168, 2048, True, 8, 64, 4)  # V3 w2
    assert fp8_grouped_gemm.config_for(2816, 2048, 3072, 64) == (2816, 2048, False, 64, 128)
    assert fp8_grouped_gemm.config_for(4096, 7168, 32768, 32) == (4096, 7168, False, 128, 128)


# ---- GPU ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled(request):
    """The configurations the selected GPU cases launch, compiled in parallel once."""
    jobs = []
    for p in selected_params(request):
        e, top_k, d, inter = MODELS[p["model"]]
        m = p["tokens"] * top_k
        jobs += [("fp8_grouped_gemm", fp8_grouped_gemm.config_for(n, k, m, e)) for n, k in ((2 * inter, d), (d, inter))]
        jobs += [("fp8_quant", fp8_quant.config_for(d, m)), ("fp8_quant", fp8_quant.config_for(inter, m, True))]
    precompile_in_processes(jobs)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("kind", ["random", "skewed", "one-expert"])
@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("model", list(MODELS))
def test_grouped_gemm_matches_fp32_reference_gpu(compiled, model, tokens, kind):
    experts, top_k, d, inter = MODELS[model]
    counts = routing(tokens, experts, top_k, kind, seed=tokens)
    assert kind == "random" or int((counts == 0).sum()) > 0  # empty experts on the skewed routings
    starts = moe_gemm.expert_starts(counts)
    for n, k, seed in ((2 * inter, d, 1), (d, inter, 2)):
        aq, sa = quantize_per_token_group(activations(tokens * top_k, k, seed=tokens))
        wq, sw = fp8_weight(experts, n=n, k=k, seed=seed)
        out = fp8_grouped_gemm.fp8_grouped_gemm(aq, sa, wq, sw, starts)
        check_close(out, grouped_fp32(aq, sa, wq, sw, counts),
                    magnitude=grouped_fp32(aq, sa, wq, sw, counts, magnitude=True))


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("tokens", [1, 64, 512])
@pytest.mark.parametrize("model", list(MODELS))
def test_fp8_grouped_mlp_op_matches_the_reference_op_gpu(compiled, model, tokens):
    from deepinfer_npu.backends.cpu import quant as ref
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    experts, top_k, d, inter = MODELS[model]
    counts = routing(tokens, experts, top_k, "skewed" if tokens == 64 else "random", seed=tokens)
    hidden = activations(tokens * top_k, d, seed=tokens) * 0.05
    w13, s13 = fp8_weight(experts, n=2 * inter, k=d, seed=1)
    w2, s2 = fp8_weight(experts, n=d, k=inter, seed=2)
    ks = CudaKernelSet()
    out = ks.fp8_grouped_mlp(hidden, counts, w13, s13, w2, s2)
    assert ks.op_report()["fp8_grouped_mlp"].startswith("native (kernels_cuda.fp8_quant"), ks.op_report()
    check_close(out, ref.fp8_grouped_mlp(hidden, counts, w13, s13, w2, s2), rel=2.0**-6, floor=2.0**-4, cos=0.999)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("tokens,rows", [(1, 8), (16, 8), (64, 16)])
def test_staged_scales_give_the_same_bits_as_global_reads_gpu(tokens, rows):
    """The swapped grouped form with its scales staged in shared memory (a tuning variant) against the heuristic's
    form reading them from global memory: bit-equal, on skewed routings whose experts get several row tiles."""
    experts, top_k, d, inter = MODELS["v2lite"]
    counts = routing(tokens, experts, top_k, "skewed", seed=tokens)
    starts = moe_gemm.expert_starts(counts)
    for n, k, seed in ((2 * inter, d, 1), (d, inter, 2)):
        plain, staged = (n, k, True, rows, 64, 4), (n, k, True, rows, 64, 4, True)
        precompile_in_processes([("fp8_grouped_gemm", c) for c in (plain, staged)])
        aq, sa = quantize_per_token_group(activations(tokens * top_k, k, seed=tokens))
        wq, sw = fp8_weight(experts, n=n, k=k, seed=seed)
        a = fp8_grouped_gemm.fp8_grouped_gemm(aq, sa, wq, sw, starts, config=plain)
        b = fp8_grouped_gemm.fp8_grouped_gemm(aq, sa, wq, sw, starts, config=staged)
        assert torch.equal(a, b), (n, k, int((a != b).sum()))
