"""kernels_cuda.zos_fixup (ZOS seqlens correction and varlen re-split) and its use by the CUDA kernel set.

Everywhere: the argument checks and a
NumPy mirror of the re-split kernel's selection (per-thread int32 keys, the 30-step threshold search, ties by flat
index through an exclusive scan over threads) against the CPU reference op, with the reference's own (sequential,
CPU) cumprod rounding. The mirror checks the algorithm, not the TileLang code.
On a CUDA device: every output equal to the reference op on the same CUDA tensors (which rounds the cumprod with
torch's CUDA scans), and a CUDA-graph replay.
"""

import numpy as np
import pytest
import torch

from deepinfer_npu.backends.cpu.zos import zos_fixup as zos_fixup_ref
from deepinfer_npu.kernels_cuda import zos_fixup as zf
from deepinfer_npu.kernels_cuda._testing import zos_step

CASES = [  # (rows, k, resplit, probs, optimistic fraction)
    (1, 1, False, "rand", 1.0),
    (64, 3, False, "rand", 0.7),
    (1000, 4, False, "rand", 0.5),
    (5000, 2, False, "rand", 0.5),
    (1, 4, True, "rand", 1.0),  # one row: cub's (sequential) scan
    (1, 16, True, "conf", 1.0),
    (2, 16, True, "conf", 1.0),  # Sklansky with 4 stages
    (8, 3, True, "rand", 0.7),
    (64, 4, True, "rand", 0.7),
    (64, 4, True, "ties", 0.7),
    (64, 7, True, "special", 0.7),
    (128, 8, True, "conf", 1.0),
    (129, 2, True, "ties", 0.6),  # 1024-thread variant
    (1000, 4, True, "rand", 0.8),
    (1024, 16, True, "conf", 0.9),
    (3000, 3, True, "ties", 0.9),  # 3 rows a thread
    (64, 4, True, "rand", 0.0),  # nothing optimistic
    (33, 1, True, "special", 1.0),
]


def assert_same(out, ref):
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


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
    sq, sk, opt, slots, corr, dp, caps = zos_step(rows, k, True, probs, 0.7, seed=seed, device="cpu")
    ref_q, ref_k = zos_fixup_ref(sq, sk, opt, slots, corr, dp, caps)
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
        ref = zos_fixup_ref(sq, sk, opt, slots, corr, dp, caps)
        got = resplit_mirror(sq.numpy(), sk.numpy(), opt.numpy(), slots.numpy(), corr.numpy(), dp.numpy(),
                             caps.numpy(), 32, 1, "sequential")
        assert np.array_equal(got[0], ref[0].numpy()) and np.array_equal(got[1], ref[1].numpy())
    sq0 = torch.ones(3, dtype=torch.int32)  # num_slots 0
    ref = zos_fixup_ref(sq0, sk, opt, slots, corr, dp, torch.tensor([3, 3, 3]))
    got = resplit_mirror(sq0.numpy(), sk.numpy(), opt.numpy(), slots.numpy(), corr.numpy(), dp.numpy(),
                         np.array([3, 3, 3]), 32, 1, "sequential")
    assert np.array_equal(got[0], ref[0].numpy()) and np.array_equal(got[1], ref[1].numpy())


def test_sklansky_is_a_prefix_product():
    p = np.random.default_rng(0).random(16).astype(np.float32)
    a, b = _sklansky(p), _sequential(p)
    assert np.allclose(a, b, rtol=1e-5) and a[1] == b[1] and a[2] == b[2]


def test_reason_and_launch():
    sq, sk, opt, slots, corr, dp, caps = zos_step(8, 3, True, seed=0, device="cpu")
    assert zf.reason(sq, sk, opt, slots, corr, dp, caps) is None
    assert zf.reason(sq, sk, opt, slots, corr) is None
    assert "drafts a row" in zf.reason(sq, sk, opt, slots, corr, torch.zeros(corr.shape[0], 17), caps)
    assert "no rows" in zf.reason(sq[:0], sk[:0], opt[:0], slots[:0], corr)
    assert "optimistic" in zf.reason(sq, sk, opt.int(), slots, corr)
    assert zf.resplit_launch(1) == (128, 1) and zf.resplit_launch(129) == (1024, 1)
    assert zf.resplit_launch(3000) == (1024, 3)
    assert "one CTA" in zf.reason(*zos_step(4097, 2, True, device="cpu"))


# ---- GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-k{c[1]}-{'resplit' if c[2] else 'fix'}-{c[3]}")
def test_zos_fixup_matches_reference_gpu(case):
    """Both outputs equal (values and dtypes) to the CPU reference op on the same CUDA tensors."""
    args = zos_step(*case, seed=sum(case[:2]))
    assert zf.reason(*args) is None, zf.reason(*args)
    assert_same(zf.zos_fixup(*args), zos_fixup_ref(*args))


@pytest.mark.gpu
@pytest.mark.tilelang
def test_zos_fixup_graph_replay_gpu():
    """The re-split captured in a CUDA graph and replayed on new probabilities."""
    args = zos_step(64, 4, seed=9)
    zf.zos_fixup(*args)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = zf.zos_fixup(*args)
    args[5].copy_(zos_step(64, 4, seed=10)[5])
    gr.replay()
    assert_same(out, zos_fixup_ref(*args))


@pytest.mark.gpu
@pytest.mark.tilelang
def test_kernel_set_runs_the_kernel_gpu():
    from deepinfer_npu.backends.cuda import kernels as ck

    ks = ck.CudaKernelSet()
    for resplit in (False, True):
        args = zos_step(64, 4, resplit, seed=7)
        assert_same(ks.zos_fixup(*args), zos_fixup_ref(*args))
    rep = ks.op_report()["zos_fixup"]
    assert rep.startswith("native (kernels_cuda.zos_fixup (correction)") and "(correction + re-split)" in rep, rep
