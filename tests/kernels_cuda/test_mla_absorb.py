"""kernels_cuda.mla_absorb (W_UK of one decode token).

Tolerance (bf16 in, fp32 sums, one rounding): within 1 bf16 ulp of the fp32 reference rounded to bf16, NaN / inf at
the same positions (the kernel's summation order is not cuBLAS', so no bit-exactness is asked). Anywhere: the dims
and operand checks, and the fp32 reference against the backend's absorption arithmetic; on a CUDA device the kernel
against that reference, and a graph replay.
"""

import pytest
import torch

from deepinfer_npu.backends.cuda.ops.mla_prolog import absorb_heads
from deepinfer_npu.kernels_cuda import mla_absorb as ma
from deepinfer_npu.kernels_cuda._testing import absorb as make_inputs
from deepinfer_npu.kernels_cuda._testing import bf16_ulps

CASES = [(16, 128, 512, 192, False), (16, 128, 512, 192, True), (128, 128, 512, 192, False),
         (1, 128, 512, 192, False), (8, 64, 256, 96, True), (16, 128, 512, 128, False)]  # H, N, L, QD, special


def absorb_ref(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """fp32 reference: ``einsum("thn,hnl->thl")`` on the nope part, fp32 throughout (rounded by the caller)."""
    return torch.einsum("thn,hnl->thl", q[..., : w_uk.shape[1]].float(), w_uk.float())


def within_tolerance(out: torch.Tensor, q: torch.Tensor, w_uk: torch.Tensor) -> tuple[bool, dict]:
    """Within 1 bf16 rounding of the fp32 result plus the fp32 sum's own error bound, NaN / inf at the same
    positions; -> (ok, stats)."""
    ref32 = absorb_ref(q, w_uk)
    ref = ref32.to(torch.bfloat16)
    same_nan = torch.equal(torch.isnan(out), torch.isnan(ref))
    same_inf = torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = torch.isfinite(ref)
    bound = torch.einsum("thn,hnl->thl", q[..., : w_uk.shape[1]].float().abs(), w_uk.float().abs())
    tol = ref32.abs() * 2.0**-7 + w_uk.shape[1] * 2.0**-23 * bound
    err = (out.float() - ref32).abs()
    within = bool((err[finite] <= tol[finite]).all()) if finite.any() else True
    ulps = float(bf16_ulps(out[finite], ref[finite]).max()) if finite.any() else 0.0
    stats = dict(ulps=ulps, within=within, same_nan=same_nan, same_inf=same_inf)
    return same_nan and same_inf and within, stats


def test_supported_dims():
    assert ma.supported(16, 128, 512, 192) is None and ma.supported(128, 128, 512, 192) is None
    assert "32 groups" in ma.supported(16, 48, 512, 192)
    assert "multiple of 64" in ma.supported(16, 128, 500, 192)
    assert "query width" in ma.supported(16, 128, 512, 64)


def test_reason_names_the_problem():
    q, w = torch.zeros(1, 16, 192, dtype=torch.bfloat16), torch.zeros(16, 128, 512, dtype=torch.bfloat16)
    assert ma.reason(q, w) == "tensor not on a CUDA device"
    with pytest.raises(ValueError, match="mla_absorb: tensor not on a CUDA device"):
        ma.absorb_q(q, w)


def test_reference_is_the_backends_absorption():
    """absorb_ref (what the GPU test compares with) is the arithmetic of the path it replaces, absorb_heads, in fp32."""
    q, w = make_inputs(4, 64, 128, 96, device="cpu")
    q, w = q.float(), w.float()
    torch.testing.assert_close(absorb_ref(q, w), absorb_heads(q[..., :64], w), rtol=1e-6, atol=1e-6)


def test_tolerance_accepts_another_summation_order_and_rejects_errors():
    """within_tolerance (what the GPU test applies): an fp32 sum in another order, rounded once, passes; a result two
    bf16 ulps off, a NaN where the reference has a number, or a lost inf fails."""
    q, w = make_inputs(4, 64, 128, 96, seed=3, special=True, device="cpu")
    terms = q[..., :64].float().transpose(0, 1)[:, 0, :, None] * w.float()  # [H, N, L] products
    reordered = terms.flip(1).sum(1)[None].to(torch.bfloat16)  # the sum over N backwards
    ok, stats = within_tolerance(reordered, q, w)
    assert ok and stats["same_nan"] and stats["same_inf"], stats
    bad = reordered.clone()
    h, col = 3, 5
    assert torch.isfinite(bad[0, h, col]) and bad[0, h, col] != 0
    bad[0, h, col] = (bad[0, h, col].float() * (1 + 2.0**-5)).to(torch.bfloat16)  # ~4 ulps off
    assert not within_tolerance(bad, q, w)[0]
    nan = reordered.clone()
    nan[0, h, col] = float("nan")
    assert not within_tolerance(nan, q, w)[0]


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}-N{c[1]}-L{c[2]}-QD{c[3]}-sp{int(c[4])}")
def test_matches_reference_gpu(case):
    """The output poisoned with NaN first, then within_tolerance of the fp32 reference."""
    heads, nope, lrank, q_dim, special = case
    q, w = make_inputs(heads, nope, lrank, q_dim, 7, special)
    out = torch.full((1, heads, lrank), float("nan"), dtype=torch.bfloat16, device="cuda")
    ma.absorb_q(q, w, out=out)
    ok, stats = within_tolerance(out, q, w)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
def test_graph_replay_gpu():
    """Captured once, replayed on a new query: the result follows the new input."""
    q, w = make_inputs(16, seed=5)
    out = torch.empty(1, 16, 512, dtype=torch.bfloat16, device="cuda")
    ma.absorb_q(q, w, out=out)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        ma.absorb_q(q, w, out=out)
    q.copy_(make_inputs(16, seed=6)[0])
    gr.replay()
    ok, stats = within_tolerance(out, q, w)
    assert ok, stats
