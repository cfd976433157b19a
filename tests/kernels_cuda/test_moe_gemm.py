"""kernels_cuda.moe_gemm (grouped expert GEMM over the rows sorted by expert) and its expert scan.

Tolerances: the scan equal to the host reference; the GEMM's bf16 output within 2 bf16 ulp of the fp32 reference's
|ref| + 1e-2 absolute, NaN positions equal, cosine > 0.99999; V2-Lite and V3 expert shapes at 1 / 7 / 64 / 200
tokens, skewed routing (one expert with more than 64 rows, many empty). The gated w13 (SwiGLU in the epilogue): within
4 ulp + 1e-2 of the fp32 reference with the CPU SwiGLU's roundings, at batch-decode and small-prefill sizes.
"""

import pytest
import torch

from deepinfer_npu.kernels_cuda import moe_gemm
from deepinfer_npu.kernels_cuda._testing import (
    close_to,
    expert_rows,
    expert_starts_ref,
    grouped_gemm_fp32,
    grouped_mlp_gate_fp32,
)

CASES = [  # tokens, top_k, experts, N, K, skew
    (1, 6, 64, 2816, 2048, False), (1, 6, 64, 2048, 1408, False), (7, 6, 64, 2816, 2048, False),
    (64, 6, 64, 2048, 1408, False), (64, 6, 64, 2816, 2048, True), (5, 8, 256, 4096, 7168, False),
    (200, 2, 16, 256, 512, True),
]


def test_scan_reference_layout():
    """The scan's host reference: exclusive prefix sum, then the experts with rows, -1 padded."""
    assert expert_starts_ref(torch.tensor([2, 0, 3, 1])).tolist() == [0, 2, 2, 5, 6, 0, 2, 3, -1]


GATED_CASES = [  # tokens, top_k, experts, N (= 2I), K, skew: 24 rows an expert (batch 256), more than 64 rows of one
    (256, 6, 64, 2816, 2048, False), (341, 6, 64, 2816, 2048, True), (3, 6, 64, 2816, 2048, False),
    (40, 8, 32, 4096, 7168, False), (200, 2, 16, 256, 512, True),
]


def test_moe_gemm_gated_rejects_an_unpaired_width():
    a = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gated N=192"):
        moe_gemm.moe_gemm(a, torch.zeros(1, 192, 64, dtype=torch.bfloat16), torch.tensor([3]), gated=True)
    assert moe_gemm.supported(256, 64, True) and not moe_gemm.supported(192, 64, True)


def test_moe_gemm_rejects_mismatched_shapes():
    a = torch.zeros(3, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=64"):
        moe_gemm.moe_gemm(a, w, torch.tensor([1, 2]))
    w = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="3 entries for 2 experts"):
        moe_gemm.moe_gemm(a, w, torch.tensor([1, 1, 1]))


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("experts,density", [(64, 0.1), (64, 1.0), (256, 0.03), (256, 0.6), (16, 0.5), (1, 1.0),
                                             (200, 0.0)])
def test_expert_scan_matches_reference_gpu(experts, density):
    g = torch.Generator().manual_seed(experts)
    counts = torch.randint(0, 9, (experts,), generator=g) * (torch.rand(experts, generator=g) < density)
    assert torch.equal(moe_gemm.expert_starts(counts.cuda()).cpu(), expert_starts_ref(counts))


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-N{c[3]}-K{c[4]}-skew{int(c[5])}")
def test_moe_gemm_matches_fp32_reference_gpu(case):
    tokens, top_k, experts, n, k, skew = case
    a, w, counts = expert_rows(tokens, top_k, experts, n, k, skew=skew)
    ref = grouped_gemm_fp32(a, w, counts)
    for bn in (64, 128) if n % 128 == 0 else (64,):
        ok, stats = close_to(moe_gemm.moe_gemm(a, w, counts, block_n=bn), ref, 2 * 2.0**-8 * ref.abs() + 1e-2)
        assert ok, (bn, stats)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", GATED_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-N{c[3]}-K{c[4]}-skew{int(c[5])}")
def test_moe_gemm_gated_matches_fp32_swiglu_reference_gpu(case):
    tokens, top_k, experts, n, k, skew = case
    a, w, counts = expert_rows(tokens, top_k, experts, n, k, skew=skew)
    ref = grouped_mlp_gate_fp32(a, w, counts)
    out = moe_gemm.moe_gemm(a, w, counts, gated=True)
    assert out.shape == (a.shape[0], n // 2)
    ok, stats = close_to(out, ref, 4 * 2.0**-8 * ref.abs() + 1e-2)
    assert ok, stats
