"""The zos_fixup op (backends/cpu/zos.py): seqlens_k corrected by the previous step's accepted counts, and the
varlen re-split of optimistic rows' drafts by the freshest confidences with total_q fixed."""

from __future__ import annotations

import torch
from deepinfer_npu.backends.cpu.zos import zos_fixup


def test_correction_only_for_optimistic_rows():
    q = torch.tensor([3, 2, 1], dtype=torch.int32)
    k = torch.tensor([40, 30, 20], dtype=torch.int32)
    optimistic = torch.tensor([True, False, True])
    slots = torch.tensor([2, 1, 0])
    correction = torch.tensor([5, 7, 2])  # per slot
    nq, nk = zos_fixup(q, k, optimistic, slots, correction)
    assert nq.tolist() == [3, 2, 1]
    assert nk.tolist() == [40 - 2, 30, 20 - 5]


def test_resplit_keeps_total_and_exact_rows_and_gives_prefixes():
    torch.manual_seed(0)
    for _ in range(200):
        b, kk = 6, 5
        q = torch.randint(1, kk + 2, (b,), dtype=torch.int32)
        k = q + torch.randint(10, 50, (b,), dtype=torch.int32)
        optimistic = torch.rand(b) < 0.6
        slots = torch.randperm(b)
        probs = torch.rand(b, kk)
        caps = torch.maximum(q.to(torch.int64) - 1, torch.randint(0, kk + 1, (b,)))
        correction = torch.zeros(b, dtype=torch.int64)
        nq, nk = zos_fixup(q, k, optimistic, slots, correction, probs, caps)
        assert int(nq.sum()) == int(q.sum())  # total_q (the graph the CPU chose) never moves
        assert torch.equal(nq[~optimistic], q[~optimistic])  # exactly planned rows keep their split
        assert bool(((nq - 1) <= caps).all()) and bool((nq >= 1).all())
        assert torch.equal(nk - nq, k - q)  # context before the step unchanged
        # The chosen drafts are the highest cumulative confidences among optimistic rows (each row a prefix).
        cum = torch.cumprod(probs[slots], dim=1)
        taken = [cum[i, : nq[i] - 1] for i in range(b) if optimistic[i]]
        left = [cum[i, nq[i] - 1 : caps[i]] for i in range(b) if optimistic[i]]
        if taken and left:
            t = torch.cat(taken)
            rest = torch.cat(left)
            if t.numel() and rest.numel():
                assert float(t.min()) >= float(rest.max()) - 1e-7
