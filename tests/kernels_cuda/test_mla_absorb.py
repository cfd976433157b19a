"""kernels_cuda/mla_absorb.py (W_UK of one decode token) and the CUDA kernel set's use of it in ``mla_prolog``.

Tolerance (bf16 in, fp32 sums, one rounding): within 1 bf16 ulp of the fp32 reference rounded to bf16, NaN / inf at
the same positions (the kernel's summation order is not cuBLAS', so no bit-exactness is asked). Anywhere: the dims
and operand checks, the reference against the reference ops' einsum, and the kernel set's choice with a stand-in
module (gate shut: cuBLAS' batched GEMM; open: the kernel for one token only). The GPU tests skip without a device.
"""

from types import SimpleNamespace

import pytest
import torch
from deepinfer_npu.backends.cuda import kernels as ck
from deepinfer_npu.kernels_cuda import mla_absorb as ma

HAS_GPU = torch.cuda.is_available() and ck.tilelang_importable()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and tilelang==0.1.15")


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
    """absorb_ref (what --check compares with) is the arithmetic of the path it replaces, absorb_heads, in fp32."""
    q, w = ma.make_inputs(4, 64, 128, 96, device="cpu")
    q, w = q.float(), w.float()
    torch.testing.assert_close(ma.absorb_ref(q, w), ck.absorb_heads(q[..., :64], w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ma.absorb_cublas(q, w), ck.absorb_heads(q[..., :64], w), rtol=0, atol=0)


class _StandIn:
    def __init__(self):
        self.calls = 0

    def reason(self, q, w_uk):
        return None

    def absorb_q(self, q, w_uk):
        self.calls += 1
        return ma.absorb_ref(q, w_uk).to(q.dtype)


def test_kernel_set_takes_it_for_one_token_with_the_gate_open(monkeypatch):
    ks = ck.CudaKernelSet()
    stand_in = _StandIn()
    monkeypatch.setattr(ks, "_gated_kernel", lambda name, x: (stand_in, None) if ck.unverified_kernel_enabled(
        name) else (None, f"reference (kernels_cuda.{name} not yet verified on a GPU)"))
    w = SimpleNamespace(qk_nope_head_dim=64, w_uk=ma.make_inputs(4, 64, 128, 96, device="cpu")[1])
    monkeypatch.delenv(ck.UNVERIFIED_ENV, raising=False)
    assert "mla_absorb" in ck.UNVERIFIED_KERNELS
    q1 = ma.make_inputs(4, 64, 128, 96, seed=1, device="cpu")[0]
    want = ck.absorb_heads(q1[..., :64], w.w_uk)
    assert torch.equal(ks._absorb_q(q1, w), want) and stand_in.calls == 0  # gate shut: cuBLAS' path
    assert "W_UK of one token: cuBLAS batched GEMM (reference (kernels_cuda.mla_absorb not yet verified" in \
        ks.op_report()["mla_prolog"]
    monkeypatch.setenv(ck.UNVERIFIED_ENV, "mla_absorb")
    got = ks._absorb_q(q1, w)
    assert stand_in.calls == 1 and got.shape == want.shape
    assert "W_UK of one token: kernels_cuda.mla_absorb; unverified" in ks.op_report()["mla_prolog"]
    q3 = torch.cat([q1, q1, q1])  # three tokens: never the kernel
    assert torch.equal(ks._absorb_q(q3, w), ck.absorb_heads(q3[..., :64], w.w_uk)) and stand_in.calls == 1


@gpu
@pytest.mark.parametrize("case", ma.CHECK_CASES, ids=lambda c: f"H{c[0]}-N{c[1]}-L{c[2]}-QD{c[3]}-sp{int(c[4])}")
def test_matches_reference_gpu(case):
    ok, stats = ma.check_case(*case, seed=7, verbose=False)
    assert ok, stats


@gpu
def test_graph_replay_gpu():
    assert ma.check_graph(verbose=False)
