"""kernels_cuda/spec_verify.py (greedy draft verification; temperature rows without drafts) and its gated use by the
CUDA kernel set.

Everywhere: the argument checks (what is routed to the reference), the kernel set's gate and op report, and NumPy
mirrors of the two kernels' logic against the CPU reference op: the 64-bit arg-max key (torch's order: NaN largest,
ties and +-0 to the lowest index) and the accept kernel's per-row bit words (accepted = trailing ones,
``popc(x & ~(x + 1))``). The mirrors check the algorithm, not the TileLang code.
On a CUDA device: every ``--check`` case (emitted, num_emitted, accepted, target_tokens equal to the reference op on
the same CUDA tensors, int64), the hash-RNG noise bit for bit, a CUDA-graph replay. Not yet run on a GPU.
"""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

from kernels_cuda import spec_verify as sv  # noqa: E402 (importable without tilelang)

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


# ---- mirrors -----------------------------------------------------------------------------------------------------
def argmax_by_key(x):
    """Row arg-max through the kernel's key: sortable(value) * 2**32 + (0xFFFFFFFF - index), int64 max."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = np.where(x == 0, np.int32(0), x.view(np.int32)).astype(np.int64)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)
    s = np.where(np.isnan(x), 0x7FFFFFFF, s)
    idx = np.arange(x.shape[1], dtype=np.int64)
    key = s * (1 << 32) + (0xFFFFFFFF - idx)
    return 0xFFFFFFFF - (key.max(axis=1) & 0xFFFFFFFF)


def accept_mirror(greedy, draft, row, j, num_rows, max_q):
    bits = np.zeros(num_rows, dtype=np.uint64)
    for r in range(len(draft)):
        if draft[r] == greedy[r]:
            bits[row[r]] += np.uint64(1) << np.uint64(j[r])
    acc = np.array([bin(int(x) & ~(int(x) + 1)).count("1") for x in bits], dtype=np.int64)
    target = np.where(j < acc[row], draft, greedy)
    emitted = np.full((num_rows, max_q), -1, dtype=np.int64)
    live = j <= acc[row]
    emitted[row[live], j[live]] = target[live]
    return emitted, acc + 1, acc, target


@pytest.mark.parametrize("kind", ["randn", "ties", "special", "equal"])
def test_argmax_key_matches_torch_argmax(kind):
    g = torch.Generator().manual_seed(0)
    x = sv.make_logits(64, 1001, kind, g, device="cpu")
    assert np.array_equal(argmax_by_key(x.numpy()), x.argmax(-1).numpy())


@pytest.mark.parametrize("layout", ["worker", "prefill", "shuffled", "full"])
@pytest.mark.parametrize("max_q", [1, 3, 16, 32])
def test_accept_mirror_matches_reference_cpu(layout, max_q):
    if layout == "prefill" and max_q != 1:
        pytest.skip("prefill steps have one token a row")
    step = sv.make_step(37, max_q, 64, "ties", layout=layout, seed=max_q, device="cpu")
    n = step["logits"].shape[0]
    t = sv.make_sampling(n, 1.0, device="cpu")
    assert sv.reason(**step, t=t) is None
    ref = sv.spec_verify_ref(**step, t=t)
    got = accept_mirror(step["logits"].argmax(-1).numpy(), step["draft_next"].numpy(), step["row_of_token"].numpy(),
                        step["j_of_token"].numpy(), step["num_rows"], max_q)
    for a, b in zip(got, ref):
        assert np.array_equal(a, b.numpy())


# ---- routing -----------------------------------------------------------------------------------------------------
def test_reason_routes_what_the_kernels_do_not_cover():
    step = sv.make_step(4, 3, 64, seed=0, device="cpu")
    n = step["logits"].shape[0]
    greedy = sv.make_sampling(n, 1.0, device="cpu")
    mixed = sv.make_sampling(n, 0.5, seed=1, device="cpu")
    assert sv.reason(**step, t=greedy) is None
    assert "drafts" in sv.reason(**step, t=mixed)
    assert "ban mask" in sv.reason(**step, t=greedy, ban_mask=torch.zeros(n, 64, dtype=torch.bool))
    lp = sv.make_sampling(n, 1.0, device="cpu")
    lp.max_num_logprobs = 2
    assert "logprobs" in sv.reason(**step, t=lp)
    one = sv.make_step(4, 1, 64, layout="prefill", device="cpu")
    t1 = sv.make_sampling(4, 0.5, seed=2, device="cpu")
    assert sv.reason(**one, t=t1) is None  # temperature rows without drafts
    t1.need_top_p = True
    assert "top-k / top-p" in sv.reason(**one, t=t1)
    assert "fp32" in sv.reason(**{**step, "logits": step["logits"].half()}, t=greedy)
    assert "max_q" in sv.reason(**{**step, "max_q": 33}, t=greedy)
    assert "rows" in sv.reason(**{**step, "num_rows": sv.MAX_ROWS + 1}, t=greedy)
    empty = sv.make_step(1, 1, 64, layout="prefill", device="cpu")
    empty.update(logits=empty["logits"][:0], draft_next=empty["draft_next"][:0],
                 row_of_token=empty["row_of_token"][:0], j_of_token=empty["j_of_token"][:0])
    assert "empty" in sv.reason(**empty, t=sv.make_sampling(0, 1.0, device="cpu"))


def test_kernel_set_gate(monkeypatch):
    """Verified on an H200 (session 3): on by default; back in UNVERIFIED_KERNELS it keeps the reference."""
    from deepinfer_npu.backends.cpu import spec_verify as ref_sv
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.delenv(ck.UNVERIFIED_ENV, raising=False)
    assert ck.unverified_kernel_enabled("spec_verify")
    step = sv.make_step(5, 3, 64, seed=4, device="cpu")
    t = sv.make_sampling(step["logits"].shape[0], 1.0, device="cpu")
    ks = ck.CudaKernelSet()
    assert ks.op_report()["spec_verify"].startswith("pending (kernels_cuda.spec_verify")
    ks.spec_verify(**step, t=t)
    assert ks.op_report()["spec_verify"] == "fallback (reference (tensor not on a CUDA device))"
    monkeypatch.setattr(ck, "UNVERIFIED_KERNELS", {"spec_verify"})
    ks = ck.CudaKernelSet()
    vo = ks.spec_verify(**step, t=t)
    rv = ref_sv.spec_verify(**step, t=t)
    assert torch.equal(vo.emitted, rv.emitted) and torch.equal(vo.accepted, rv.accepted)
    assert "kernels_cuda.spec_verify not yet verified on a GPU" in ks.op_report()["spec_verify"]
    monkeypatch.setenv(ck.UNVERIFIED_ENV, "1")
    ks = ck.CudaKernelSet()
    ks.spec_verify(**step, t=t)
    assert ks.op_report()["spec_verify"] == "fallback (reference (tensor not on a CUDA device))"


# ---- GPU ---------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("case", sv.CHECK_CASES,
                         ids=lambda c: f"B{c[0]}-q{c[1]}-V{c[2]}-{c[3]}-{c[4]}-g{c[5]}")
def test_spec_verify_matches_reference_gpu(case):
    ok, same = sv.check_case(*case, seed=case[0] + case[1], verbose=False)
    assert ok, same


@gpu
def test_hash_noise_bit_exact_gpu():
    assert sv.check_noise(verbose=False)


@gpu
def test_spec_verify_graph_replay_gpu():
    assert sv.check_graph(verbose=False)


@gpu
def test_spec_verify_check_script_gpu():
    """``python kernels_cuda/spec_verify.py --check`` as the lead runs it."""
    import subprocess

    out = subprocess.run([sys.executable, os.path.join(ROOT, "kernels_cuda", "spec_verify.py"), "--check"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "CHECK PASS" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@gpu
def test_kernel_set_runs_the_kernels_when_enabled_gpu(monkeypatch):
    from deepinfer_npu.backends.cpu import spec_verify as ref_sv
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.setenv(ck.UNVERIFIED_ENV, "1")
    ks = ck.CudaKernelSet()
    step = sv.make_step(16, 4, 102400, seed=8)
    n = step["logits"].shape[0]
    for t in (sv.make_sampling(n, 1.0), sv.make_sampling(n, 0.5, seed=3)):  # greedy: kernel; mixed: reference
        vo, rv = ks.spec_verify(**step, t=t), ref_sv.spec_verify(**step, t=t)
        for f in ("emitted", "num_emitted", "accepted", "target_tokens"):
            assert torch.equal(getattr(vo, f), getattr(rv, f)), f
    pre = sv.make_step(16, 1, 102400, layout="prefill", seed=9)
    t = sv.make_sampling(16, 0.5, seed=4)
    vo, rv = ks.spec_verify(**pre, t=t), ref_sv.spec_verify(**pre, t=t)
    assert torch.equal(vo.emitted, rv.emitted) and torch.equal(vo.target_tokens, rv.target_tokens)
    rep = ks.op_report()["spec_verify"]
    assert rep.startswith("native (kernels_cuda.spec_verify (greedy;"), rep
    assert "temperature rows without drafts" in rep and "sampled rows with drafts" in rep, rep
