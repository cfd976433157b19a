"""kernels_cuda/moe_gemm.py on a CUDA device: the grouped expert GEMM against its fp32 reference (tolerance in
``moe_gemm.check``: 2 bf16 ulp of |ref| + 1e-2 absolute, NaN positions equal, cosine > 0.99999), for V2-Lite
and V3 expert shapes, batch 1 / 7 / 64 / 200 tokens, skewed routing (one expert with > 64 rows, many empty)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")
pytest.importorskip("tilelang", reason="tilelang is not installed (pip install tilelang==0.1.15)")

from kernels_cuda import moe_gemm  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
def test_moe_gemm_matches_fp32_reference():
    assert moe_gemm.check()


def test_moe_gemm_rejects_mismatched_shapes():
    a = torch.zeros(3, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=64"):
        moe_gemm.moe_gemm(a, w, torch.tensor([1, 2]))
    w = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="3 entries for 2 experts"):
        moe_gemm.moe_gemm(a, w, torch.tensor([1, 1, 1]))
