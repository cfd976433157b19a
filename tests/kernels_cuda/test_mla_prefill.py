"""kernels_cuda.mla_decode.mla_prefill (the decode kernel compiled with a causal tile bound, for prefill chunks):
on a CUDA device against the fp32 reference with the decode kernel's tolerances (out within 2 bf16 ulp of
|ref| + rms, cosine deficit < 1e-5; lse within 0.25 of that; NaN-poisoned outputs), whole prompts, chunked
prefill and varlen batches at 16 and 128 heads. Everywhere: the bucket rule and the kernel set's gate."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")
pytest.importorskip("tilelang", reason="tilelang is not installed (pip install tilelang==0.1.15)")

from kernels_cuda import mla_decode  # noqa: E402


def test_prefill_buckets():
    assert [mla_decode.bucket_prefill_q(q) for q in (1, 17, 32, 33, 1000, 8192)] == [32, 32, 32, 64, 1024, 8192]
    with pytest.raises(ValueError, match="outside 1..8192"):
        mla_decode.bucket_prefill_q(8193)


def test_prefill_kernel_on_after_its_gpu_check(monkeypatch):
    """mla_prefill passed its check on an H200 (session 3): on by default, named in the planned report."""
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.delenv(ck.UNVERIFIED_ENV, raising=False)
    assert ck.unverified_kernel_enabled("mla_prefill")
    assert "kernels_cuda.mla_decode.mla_prefill" in ck.CudaKernelSet.PLANNED["mla_attention"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
def test_mla_prefill_matches_fp32_reference():
    assert mla_decode.run_prefill_checks()
