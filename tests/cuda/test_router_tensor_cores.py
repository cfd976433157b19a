"""The MoE router's fp32 logits as bf16 GEMMs of the weight's exact bf16 split (``backends/cuda/ops/router_gemm.py``,
``DEEPINFER_ROUTER_TENSOR_CORES=1``).

Tolerances: the split is exact (the parts sum to the weight in float64, bit for bit). The logits against
``F.linear(hidden.float(), weight)``: on the CPU stand-in (exact products, an exact sum) within 1e-6 of the largest
|logit| plus 1e-6 relative; on the GPU, where the tensor cores' fp32 sums round in their own way, within 2**-15 of
the sum of the products' magnitudes, and the top-k experts of rows whose logits are apart at the cut are the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_npu.backends.cuda.ops.router_gemm import RouterGemm, split_bf16


def _mm_float64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A CPU stand-in for ``torch.mm(a, b, out_dtype=torch.float32)``: exact products, an exact sum, fp32 out."""
    return (a.double() @ b.double()).float()


def _weight(e: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-12, 4, (e, d), generator=g).float())  # magnitudes over 16 binades
    return torch.randn(e, d, generator=g) * scales


def test_the_split_sums_to_the_weight_exactly():
    w = _weight(64, 2048, 0)
    parts = split_bf16(w)
    assert len(parts) == 3 and all(p.dtype == torch.bfloat16 for p in parts)
    assert torch.equal(sum(p.double() for p in parts), w.double())
    # a bf16-valued weight (checkpoints ship the gate in bf16) is its own split: one part
    wb = w.to(torch.bfloat16).float()
    one = split_bf16(wb)
    assert len(one) == 1 and torch.equal(one[0].float(), wb)


def test_logits_follow_the_fp32_linear():
    gemm = RouterGemm(mm=_mm_float64)
    hidden = (torch.randn(48, 2048) * 0.5).to(torch.bfloat16)
    for w in (_weight(64, 2048, 1), _weight(64, 2048, 2).to(torch.bfloat16).float()):
        got = gemm.logits(hidden, w)
        want = F.linear(hidden.float(), w)
        assert got.shape == (48, 64) and got.dtype == torch.float32
        assert ((got - want).abs() <= 1e-6 * want.abs() + 1e-6 * want.abs().max()).all()
    assert gemm.parts(w)[1] == 1  # the bf16-valued weight: one GEMM, no reduction


def test_the_split_is_made_once_per_weight_and_tied_to_it():
    gemm = RouterGemm(mm=_mm_float64)
    w = _weight(8, 256, 3)
    first = gemm.parts(w)[0]
    assert gemm.parts(w)[0] is first
    other = _weight(8, 256, 4)
    gemm._parts[id(other)] = (w, w.data_ptr(), first, 3)  # an entry at a reused id: another weight's
    assert torch.equal(sum(p.double() for p in gemm.parts(other)[0].view(3, 8, 256)), other.double())


def test_refusals_name_the_operands_and_a_failed_gemm_turns_the_form_off():
    gemm = RouterGemm(mm=_mm_float64)
    w = _weight(8, 256, 5)
    assert "bf16 rows and an fp32 router" in gemm.reason(torch.zeros(2, 256), w)
    assert "not [T, D] x [E, D]" in gemm.reason(torch.zeros(2, 128, dtype=torch.bfloat16), w)
    assert gemm.logits(torch.zeros(2, 128, dtype=torch.bfloat16), w) is None

    def broken(a, b):
        raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")

    failing = RouterGemm(mm=broken)
    assert failing.logits(torch.zeros(2, 256, dtype=torch.bfloat16), w) is None
    assert "out_dtype" in failing.error and failing.reason(torch.zeros(2, 256, dtype=torch.bfloat16), w)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 64, 256])
@pytest.mark.parametrize("bf16_valued", [False, True])
def test_router_on_tensor_cores_matches_the_fp32_gemm_gpu(rows, bf16_valued, monkeypatch):
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.backends.cuda.ops import OpConfig

    monkeypatch.setenv("DEEPINFER_ROUTER_TENSOR_CORES", "1")
    ks = CudaKernelSet()
    ks.select(OpConfig(dtype=torch.bfloat16, sm90=True))
    w = _weight(64, 2048, 6).cuda() * 0.05
    if bf16_valued:
        w = w.to(torch.bfloat16).float()
    hidden = (torch.randn(rows, 2048, device="cuda") * 0.5).to(torch.bfloat16)
    got = ks.router_logits(hidden, w)
    want = F.linear(hidden.float(), w)
    # exact products; the tensor cores' fp32 sums round inside blocks of products in a way NVIDIA does not
    # document (truncation after alignment): within 2**-15 of the sum of the products' magnitudes
    magnitude = F.linear(hidden.float().abs(), w.abs())
    assert ((got - want).abs() <= 2.0**-15 * magnitude + 1e-30).all(), (got - want).abs().max().item()
    assert "fp32 router on bf16 rows" in ks.op_report()["linear"], ks.op_report()["linear"]
    # rows whose 6th and 7th logits are apart (no near-tie at the cut) route to the same experts
    top = want.topk(7).values
    rows_apart = (top[:, 5] - top[:, 6]) > 1e-4
    assert rows_apart.sum() > rows // 2
    got_ids = got.topk(6).indices.sort(dim=1).values[rows_apart]
    assert torch.equal(got_ids, want.topk(6).indices.sort(dim=1).values[rows_apart])
