"""kernels_cuda/sampling.py (seeded greedy / temperature sampling) and its gated use by the CUDA kernel set.

Everywhere: the argument checks (top-k / top-p, logprobs and bans go to the reference), the kernel set's gate and op
report, and a NumPy mirror of the kernel's per-element noise (uint32 hash words in the kernel's order) against
rng.hash_uniform_py, the scalar specification. On a CUDA device: every ``--check`` case (token ids equal to the
reference op on the same CUDA tensors) and a CUDA-graph replay with new logits and offsets. Not yet run on a GPU.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

from kernels_cuda import _argmax as am  # noqa: E402 (importable without tilelang)
from kernels_cuda import sampling as ks_sampling  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _has_tilelang():
    try:
        import tilelang  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


gpu = pytest.mark.skipif(
    not (HAS_CUDA and _has_tilelang()), reason="no CUDA device (or no tilelang): GPU numerics run on the H200 only"
)


def _mix(x):
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * am._C1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * am._C2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def kernel_order_uniform(seed, offset, col, stream=0):
    """The kernel's statement order (_row_key, _gumbel): h0 = lo ^ salt, mix, ^ hi, mix, ^ offset lo, mix,
    ^ offset hi, mix; h1 = col + COL_ADD, mix, ^ h0, mix; u = (2 * (h1 >> 9) + 1) * 2**-24."""
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    h0 = _mix((seed & 0xFFFFFFFF) ^ am.stream_salt(stream))
    h0 = _mix(h0 ^ (seed >> 32))
    h0 = _mix(h0 ^ (offset & 0xFFFFFFFF))
    h0 = _mix(h0 ^ (offset >> 32))
    h1 = _mix((col + am._COL_ADD) & 0xFFFFFFFF)
    h1 = _mix(h1 ^ h0)
    return (2 * (h1 >> 9) + 1) * 2.0**-24


@pytest.mark.parametrize("stream", [0, 1, 2])
def test_kernel_hash_order_is_the_rng_spec(stream):
    from deepinfer_npu.sampling.rng import hash_uniform_py

    for seed, offset, col in [(0, 0, 0), (-1, 5, 129279), (2**63 - 1, 2**40 + 3, 7), (-(2**63), 2**64 - 1, 65535),
                              (123456789, 17, 102399)]:
        assert kernel_order_uniform(seed, offset, col, stream) == hash_uniform_py(seed, offset, col, stream)


def test_reason_routes_what_the_kernel_does_not_cover():
    t = ks_sampling.make_sampling(4, 0.5, device="cpu")
    x = torch.zeros(4, 64)
    assert ks_sampling.reason(x, t) is None
    t.need_top_k = True
    assert "top-k" in ks_sampling.reason(x, t)
    t = ks_sampling.make_sampling(4, 1.0, device="cpu")
    t.need_top_k = True  # ignored on all-greedy batches, as the reference does
    assert ks_sampling.reason(x, t) is None
    t.max_num_logprobs = 0
    assert "logprobs" in ks_sampling.reason(x, t)
    t = ks_sampling.make_sampling(4, 0.0, device="cpu")
    t.banned_rows, t.banned_token_ids = torch.tensor([0]), torch.tensor([3])
    assert "bans" in ks_sampling.reason(x, t)
    assert "no rows" in ks_sampling.reason(x[:0], ks_sampling.make_sampling(0, 1.0, device="cpu"))
    assert "fp32" in ks_sampling.reason(x.bfloat16(), ks_sampling.make_sampling(4, 1.0, device="cpu"))


def test_split_choice():
    assert am.num_splits(1, 129280) == am.tiles_per_row(129280) == 64
    assert am.tiles_per_row(129280, noise=True) == 127
    assert am.num_splits(1024, 129280) == 1
    assert am.num_splits(64, 102400, 132) == 9
    assert am.num_splits(3, 7) == 1


def test_kernel_set_gate(monkeypatch):
    """Verified on an H200 (session 3): on by default; back in UNVERIFIED_KERNELS it keeps the reference."""
    from deepinfer_npu.backends.cpu import sampling as ref_sampling
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.delenv(ck.UNVERIFIED_ENV, raising=False)
    assert ck.unverified_kernel_enabled("sampling")
    x = torch.randn(6, 128)
    t = ks_sampling.make_sampling(6, 0.5, device="cpu")
    ks = ck.CudaKernelSet()
    assert ks.op_report()["sample"].startswith("pending (kernels_cuda.sampling")
    ks.sample(x, t)
    assert ks.op_report()["sample"] == "fallback (reference (tensor not on a CUDA device))"
    monkeypatch.setattr(ck, "UNVERIFIED_KERNELS", {"sampling"})
    ks = ck.CudaKernelSet()
    assert torch.equal(ks.sample(x, t).token_ids, ref_sampling.sample(x, t).token_ids)
    assert "kernels_cuda.sampling not yet verified on a GPU" in ks.op_report()["sample"]
    monkeypatch.setenv(ck.UNVERIFIED_ENV, "1")
    ks = ck.CudaKernelSet()
    ks.sample(x, t)
    assert ks.op_report()["sample"] == "fallback (reference (tensor not on a CUDA device))"


# ---- GPU ---------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("case", ks_sampling.CHECK_CASES, ids=lambda c: f"B{c[0]}-V{c[1]}-g{c[2]}-{c[3]}-T{c[4][0]}")
def test_sample_matches_reference_gpu(case):
    assert ks_sampling.check_case(*case, seed=case[0], verbose=False)


@gpu
def test_sample_graph_replay_gpu():
    assert ks_sampling.check_graph(verbose=False)


@gpu
def test_sampling_check_script_gpu():
    """``python kernels_cuda/sampling.py --check`` as the lead runs it."""
    import subprocess

    out = subprocess.run([sys.executable, os.path.join(ROOT, "kernels_cuda", "sampling.py"), "--check"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "CHECK PASS" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@gpu
def test_kernel_set_runs_the_kernels_when_enabled_gpu(monkeypatch):
    from deepinfer_npu.backends.cpu import sampling as ref_sampling
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.setenv(ck.UNVERIFIED_ENV, "1")
    ks = ck.CudaKernelSet()
    x = torch.randn(32, 129280, device="cuda")
    for frac in (1.0, 0.5, 0.0):
        t = ks_sampling.make_sampling(32, frac, seed=5)
        assert torch.equal(ks.sample(x, t).token_ids, ref_sampling.sample(x, t).token_ids)
    rep = ks.op_report()["sample"]
    assert rep.startswith("native (kernels_cuda.sampling (greedy;") and "seeded" in rep, rep
