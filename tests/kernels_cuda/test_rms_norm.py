"""kernels_cuda.rms_norm (RMSNorm and the fused residual add) against the CPU backend's ops on the same CUDA tensors.

Tolerance (bf16 only): y within 1 bf16 ulp of ``backends.cpu.norm`` (the rsqrt and the mean square's summation
order may flip one rounding), the new residual bit-exact, no NaN left in the NaN-poisoned output.
"""

import pytest
import torch

from deepinfer_npu.backends.cpu import norm as ref
from deepinfer_npu.kernels_cuda import rms_norm

CASES = [  # rows, width, with the residual add
    (1, 2048, True),
    (7, 7168, True),
    (130, 7168, True),
    (64, 2048, False),
    (1000, 512, False),
    (33, 1536, True),
]


def ulps_of(a, b):
    """Largest difference in bf16 ulps of b (a, b bf16)."""
    a, b = a.float(), b.float()
    ulp = torch.where(b == 0, torch.full_like(b, 2.0**-133), 2.0 ** (torch.floor(torch.log2(b.abs())) - 7))
    return ((a - b).abs() / ulp).max().item()


def test_ulps_of_sees_one_rounding():
    b = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    assert ulps_of(b, b) == 0
    assert ulps_of(b.float().mul(1 + 2.0**-7).bfloat16(), b) == 1


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rows{c[0]}-N{c[1]}-res{int(c[2])}")
def test_matches_cpu_reference(case):
    rows, hidden, with_residual = case
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g, device="cuda", dtype=torch.bfloat16) * 3
    r = torch.randn(rows, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (torch.rand(hidden, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    if with_residual:
        ro = torch.full_like(x, float("nan"))
        rms_norm.add_rms_norm(x, r, w, 1e-6, out=y, residual_out=ro)
        want, want_r = ref.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(ro, want_r)
    else:
        rms_norm.rms_norm(x, w, 1e-6, out=y)
        want = ref.rms_norm(x, w, 1e-6)
    assert not torch.isnan(y).any()
    assert ulps_of(y, want) <= 1.0
