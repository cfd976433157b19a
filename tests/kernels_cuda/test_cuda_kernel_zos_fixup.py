"""kernels_cuda/zos_fixup.py (ZOS seqlens correction and varlen re-split) and its gated use by the CUDA kernel set.

Everywhere: the argument checks, the kernel set's gate (DEEPINFER_CUDA_UNVERIFIED_KERNELS) and its op report, and a
NumPy mirror of the re-split kernel's selection (per-thread int32 keys, the 30-step threshold search, ties by flat
index through an exclusive scan over threads) against the CPU reference op, with the reference's own (sequential,
CPU) cumprod rounding. The mirror checks the algorithm, not the TileLang code.
On a CUDA device: the kernel's ``--check`` cases (every output equal to the reference op on the same CUDA tensors,
which rounds the cumprod with torch's CUDA scans) and a CUDA-graph replay. Not yet run on a GPU.
"""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

from kernels_cuda import zos_fixup as zf  # noqa: E402 (importable without tilelang)

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


# ---- NumPy mirror of zos_resplit -------------------------------------------------------------------------------
def _sklansky(p):
    """torch's CUDA innermost-dim cumprod order (ScanUtils.cuh) on one row, in fp32."""
    c = p.astype(np.float32).copy()
    k = len(c)
    m = 0
    while (1 << m) < k:
        s = 1 << m
        for ti in range(k):
            if (ti >> m) & 1:
                c[ti] = np.float32(c[ti] * c[((ti >> (m + 1)) << (m + 1)) + s - 1])
        m += 1
    return c


def _sequential(p):
    c = p.astype(np.float32).copy()
    for i in range(1, len(c)):
        c[i] = np.float32(c[i - 1] * c[i])
    return c


def resplit_mirror(sq, sk, opt, slots, corr, probs, caps, threads, rpt, scan):
    """The kernel's steps on the host (``scan`` picks the cumprod rounding for B > 1)."""
    b, k = len(sq), probs.shape[1]
    assert b <= threads * rpt
    keys = np.full((threads, rpt * k), -1, dtype=np.int64)
    mine = np.zeros(threads, dtype=np.int64)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        for t in range(threads):
            for r in range(rpt):
                row = t * rpt + r
                if row >= b or not opt[row]:
                    continue
                mine[t] += sq[row] - 1
                p = probs[slots[row]].astype(np.float32)
                p = np.where(np.isnan(p), p, np.clip(p, 0, 1)).astype(np.float32)
                c = _sequential(p) if (b == 1 or scan == "sequential") else _sklansky(p)
                for i in range(k):
                    if i < caps[row]:
                        v = c[i]
                        keys[t, r * k + i] = 0 if (np.isnan(v) or v == 0) else int(np.float32(v).view(np.int32))
    num_slots = int(mine.sum())
    thr = 0
    for bit in range(zf.SEARCH_BITS):
        cand = thr | (1 << (zf.SEARCH_BITS - 1 - bit))
        if int((keys >= cand).sum()) >= num_slots:
            thr = cand
    quota = num_slots - int((keys > thr).sum())
    ties = (keys == thr).sum(axis=1)
    run = np.concatenate([[0], np.cumsum(ties)[:-1]])  # exclusive scan over threads
    sq_out, sk_out = np.array(sq, dtype=np.int64), np.array(sk, dtype=np.int64)
    for t in range(threads):
        rr = int(run[t])
        for r in range(rpt):
            row = t * rpt + r
            nd = 0
            for i in range(k):
                e = keys[t, r * k + i]
                if e > thr:
                    nd += 1
                elif e == thr:
                    nd += int(rr < quota)
                    rr += 1
            if row < b and opt[row]:
                sk_out[row] = sk[row] - corr[slots[row]] - sq[row] + 1 + nd
                sq_out[row] = 1 + nd
    return sq_out.astype(np.int32), sk_out.astype(np.int32)


@pytest.mark.parametrize("rows,k,probs,threads,rpt", [
    (1, 4, "rand", 32, 1), (1, 16, "conf", 32, 1), (7, 3, "rand", 32, 1), (40, 4, "ties", 32, 2),
    (64, 7, "special", 64, 1), (90, 2, "ties", 32, 3), (128, 8, "conf", 128, 1), (33, 1, "special", 32, 2),
    (64, 4, "rand", 16, 4),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resplit_mirror_matches_reference_cpu(rows, k, probs, threads, rpt, seed):
    """The kernel's selection (threshold search + ties by flat index) picks exactly the reference's drafts."""
    sq, sk, opt, slots, corr, dp, caps = zf.make_problem(rows, k, True, probs, 0.7, seed=seed, device="cpu")
    ref_q, ref_k = zf.zos_fixup_ref(sq, sk, opt, slots, corr, dp, caps)
    q, kk = resplit_mirror(sq.numpy(), sk.numpy(), opt.numpy(), slots.numpy(), corr.numpy(), dp.numpy(),
                           caps.numpy(), threads, rpt, "sequential")  # the CPU reference's cumprod is sequential
    assert np.array_equal(q, ref_q.numpy()) and np.array_equal(kk, ref_k.numpy())


def test_resplit_mirror_edge_counts():
    """Fewer candidates than slots (every candidate chosen) and no slot to fill (nothing chosen)."""
    sq = torch.tensor([3, 3, 1], dtype=torch.int32)
    sk = torch.tensor([100, 50, 10], dtype=torch.int32)
    opt = torch.tensor([True, True, True])
    slots = torch.tensor([0, 1, 2])
    corr = torch.tensor([1, 0, 2])
    dp = torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.1, 0.0], [0.3, 0.3, 0.3]])
    for caps in (torch.tensor([1, 1, 0]), torch.tensor([3, 3, 3])):
        ref = zf.zos_fixup_ref(sq, sk, opt, slots, corr, dp, caps)
        got = resplit_mirror(sq.numpy(), sk.numpy(), opt.numpy(), slots.numpy(), corr.numpy(), dp.numpy(),
                             caps.numpy(), 32, 1, "sequential")
        assert np.array_equal(got[0], ref[0].numpy()) and np.array_equal(got[1], ref[1].numpy())
    sq0 = torch.ones(3, dtype=torch.int32)  # num_slots 0
    ref = zf.zos_fixup_ref(sq0, sk, opt, slots, corr, dp, torch.tensor([3, 3, 3]))
    got = resplit_mirror(sq0.numpy(), sk.numpy(), opt.numpy(), slots.numpy(), corr.numpy(), dp.numpy(),
                         np.array([3, 3, 3]), 32, 1, "sequential")
    assert np.array_equal(got[0], ref[0].numpy()) and np.array_equal(got[1], ref[1].numpy())


def test_sklansky_is_a_prefix_product():
    p = np.random.default_rng(0).random(16).astype(np.float32)
    a, b = _sklansky(p), _sequential(p)
    assert np.allclose(a, b, rtol=1e-5) and a[1] == b[1] and a[2] == b[2]


def test_reason_and_launch():
    sq, sk, opt, slots, corr, dp, caps = zf.make_problem(8, 3, True, seed=0, device="cpu")
    assert zf.reason(sq, sk, opt, slots, corr, dp, caps) is None
    assert zf.reason(sq, sk, opt, slots, corr) is None
    assert "drafts a row" in zf.reason(sq, sk, opt, slots, corr, torch.zeros(corr.shape[0], 17), caps)
    assert "no rows" in zf.reason(sq[:0], sk[:0], opt[:0], slots[:0], corr)
    assert "optimistic" in zf.reason(sq, sk, opt.int(), slots, corr)
    assert zf.resplit_launch(1) == (128, 1) and zf.resplit_launch(129) == (1024, 1)
    assert zf.resplit_launch(3000) == (1024, 3)
    assert "one CTA" in zf.reason(*zf.make_problem(4097, 2, True, device="cpu"))


# ---- the kernel set's gate ---------------------------------------------------------------------------------------
def test_kernel_set_gate(monkeypatch):
    """Verified on an H200 (session 3): the kernel set takes zos_fixup by default; a module put back in
    UNVERIFIED_KERNELS keeps the reference, with the reason in the op report, unless the environment enables it."""
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.delenv(ck.UNVERIFIED_ENV, raising=False)
    assert "zos_fixup" not in ck.UNVERIFIED_KERNELS and ck.unverified_kernel_enabled("zos_fixup")
    args = zf.make_problem(6, 3, True, seed=3, device="cpu")
    ks = ck.CudaKernelSet()
    assert ks.op_report()["zos_fixup"].startswith("pending (kernels_cuda.zos_fixup")
    ks.zos_fixup(*args)  # host tensors: the reference, with the reason
    assert ks.op_report()["zos_fixup"] == "fallback (reference (tensor not on a CUDA device))"
    monkeypatch.setattr(ck, "UNVERIFIED_KERNELS", {"zos_fixup"})
    ks = ck.CudaKernelSet()
    out = ks.zos_fixup(*args)
    ref = zf.zos_fixup_ref(*args)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert ks.op_report()["zos_fixup"] == ("fallback (reference (kernels_cuda.zos_fixup not yet verified on a GPU: "
                                           "DEEPINFER_CUDA_UNVERIFIED_KERNELS=1 enables it))")
    monkeypatch.setenv(ck.UNVERIFIED_ENV, "1")
    assert ck.unverified_kernel_enabled("zos_fixup")
    ks = ck.CudaKernelSet()
    ks.zos_fixup(*args)
    assert ks.op_report()["zos_fixup"] == "fallback (reference (tensor not on a CUDA device))"


# ---- GPU ---------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("case", zf.CHECK_CASES, ids=lambda c: f"B{c[0]}-k{c[1]}-{'resplit' if c[2] else 'fix'}-{c[3]}")
def test_zos_fixup_matches_reference_gpu(case):
    ok, stats = zf.check_case(*case, seed=sum(case[:2]), verbose=False)
    assert ok, stats


@gpu
def test_zos_fixup_graph_replay_gpu():
    assert zf.check_graph(verbose=False)


@gpu
def test_zos_fixup_check_script_gpu():
    """``python kernels_cuda/zos_fixup.py --check`` as the lead runs it."""
    import subprocess

    out = subprocess.run([sys.executable, os.path.join(ROOT, "kernels_cuda", "zos_fixup.py"), "--check"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "CHECK PASS" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@gpu
def test_kernel_set_runs_the_kernel_when_enabled_gpu(monkeypatch):
    from deepinfer_npu.backends.cuda import kernels as ck

    monkeypatch.setenv(ck.UNVERIFIED_ENV, "1")
    ks = ck.CudaKernelSet()
    for resplit in (False, True):
        args = zf.make_problem(64, 4, resplit, seed=7)
        out = ks.zos_fixup(*args)
        ref = zf.zos_fixup_ref(*args)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    rep = ks.op_report()["zos_fixup"]
    assert rep.startswith("native (kernels_cuda.zos_fixup (correction;") and "re-split" in rep, rep
