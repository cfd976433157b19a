"""ConfidenceCalibrator.observe_verify (vectorized) against the row-by-row definition it replaced."""

from __future__ import annotations

import numpy as np

from deepinfer_npu.spec.varlen import ConfidenceCalibrator


def _observe_rowwise(cal: ConfidenceCalibrator, seq_ids, drafts, accepted) -> None:
    """The definition: for each row in order, decay both tables, then count the verified positions."""
    for sid, d, a in zip(seq_ids.tolist(), drafts.tolist(), accepted.tolist()):
        conf = cal.last.get(sid)
        if conf is None or d <= 0:
            continue
        reached = min(d, a + 1)
        cal.count *= cal.decay
        cal.hits *= cal.decay
        pos = np.arange(reached)
        b = cal._bin(conf[:reached])
        cal.count[pos, b] += 1.0
        cal.hits[pos[: min(a, d)], b[: min(a, d)]] += 1.0


def test_vectorized_observe_equals_rowwise_definition():
    rng = np.random.default_rng(0)
    k = 5
    fast, slow = ConfidenceCalibrator(k, decay=0.97), ConfidenceCalibrator(k, decay=0.97)
    for step in range(40):
        rows = int(rng.integers(1, 33))
        ids = rng.choice(64, size=rows, replace=False).astype(np.int64)
        if step:  # verify what the previous step proposed (some ids have no confidences yet: skipped)
            drafts = rng.integers(0, k + 1, size=rows)
            accepted = np.minimum(rng.integers(0, k + 1, size=rows), drafts)
            fast.observe_verify(ids, drafts, accepted)
            _observe_rowwise(slow, ids, drafts, accepted)
            np.testing.assert_allclose(fast.count, slow.count, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(fast.hits, slow.hits, rtol=1e-12, atol=1e-12)
        probs = rng.random((rows, k)).astype(np.float32)
        np.testing.assert_array_equal(fast.calibrate(ids, probs), slow.calibrate(ids, probs))
    assert fast.count.sum() > 10  # the comparison saw real observations


def test_rows_without_confidences_or_drafts_change_nothing():
    cal = ConfidenceCalibrator(3)
    cal.observe_verify(np.array([1, 2]), np.array([3, 0]), np.array([1, 0]))
    assert cal.count.sum() == 0 and cal.hits.sum() == 0
