"""ForwardRuntimeEstimator (numpy ring buffer) against the list-based definition it replaced."""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np
import pytest

from deepinfer_npu.spec.varlen import ForwardRuntimeEstimator


class _Definition:
    """The two-level median as first written (pure Python over the window)."""

    def __init__(self, window: int, groups: int) -> None:
        self.samples: deque = deque(maxlen=window)
        self.groups = groups

    def add(self, g: int, e: float) -> None:
        self.samples.append((g, e))

    def slope(self) -> float:
        data = list(self.samples)
        if len(data) < 4:
            return 0.0
        size = max(2, len(data) // self.groups)
        medians = []
        for i in range(0, len(data), size):
            group = data[i : i + size]
            pair = [(e2 - e1) / (g2 - g1) for (g1, e1), (g2, e2) in zip(group, group[1:]) if g2 != g1]
            if pair:
                medians.append(statistics.median(pair))
        if len(medians) < 2:
            return 0.0
        return max(0.0, float(statistics.median(medians)))

    def intercept(self) -> float:
        if not self.samples:
            return 0.0
        b = self.slope()
        return max(0.0, float(statistics.median(e - b * g for g, e in self.samples)))


@pytest.mark.parametrize("window,groups,steps", [(5000, 50, 700), (64, 5, 300), (10, 50, 40)])
def test_estimates_equal_the_definition(window, groups, steps):
    rng = np.random.default_rng(window)
    fast, slow = ForwardRuntimeEstimator(window, groups), _Definition(window, groups)
    for step in range(steps):
        g = int(rng.choice([1, 2, 4, 8, 16, 24, 32]))
        e = float(0.01 * g + rng.normal(0, 0.05) + (5.0 if rng.random() < 0.02 else 0.0))  # slope, noise, outliers
        fast.add(g, e)
        slow.add(g, e)
        if step % 7 == 0 or step == steps - 1:
            assert fast.slope() == pytest.approx(slow.slope(), rel=1e-12, abs=1e-15)
            assert fast.intercept() == pytest.approx(slow.intercept(), rel=1e-12, abs=1e-15)
    assert fast.samples == list(slow.samples)
    if window >= steps:
        assert fast.slope() == pytest.approx(0.01, abs=0.01)  # recovers the per-token cost


def test_constant_sizes_leave_the_slope_at_zero():
    est = ForwardRuntimeEstimator()
    for _ in range(20):
        est.add(8, 0.3)
    assert est.slope() == 0.0 and est.intercept() == pytest.approx(0.3)
    assert ForwardRuntimeEstimator().intercept() == 0.0


def test_large_windows_refresh_every_window_over_512_steps():
    rng = np.random.default_rng(1)
    fast, slow = ForwardRuntimeEstimator(), _Definition(5000, 50)
    history: list[tuple[float, float]] = []
    for _ in range(2100):
        g = int(rng.choice([2, 4, 8, 16]))
        e = float(0.02 * g + rng.normal(0, 0.05))
        fast.add(g, e)
        slow.add(g, e)
        history.append((slow.slope(), slow.intercept()))
        got = (fast.slope(), fast.intercept())
        interval = max(1, len(history) // 512)
        assert any(got == pytest.approx(h, rel=1e-12, abs=1e-15) for h in history[-interval:]), len(history)


def test_python_and_numpy_paths_agree_across_the_switch():
    """Windows under 512 samples take the pure-Python path, longer ones numpy: the same numbers either side."""
    rng = np.random.default_rng(2)
    fast, slow = ForwardRuntimeEstimator(600, 50), _Definition(600, 50)
    for step in range(900):
        g = int(rng.choice([1, 3, 6, 12]))
        e = float(0.03 * g + rng.normal(0, 0.02))
        fast.add(g, e)
        slow.add(g, e)
        if 505 <= step <= 515 or step == 899:
            assert fast.slope() == pytest.approx(slow.slope(), rel=1e-12, abs=1e-15)
            assert fast.intercept() == pytest.approx(slow.intercept(), rel=1e-12, abs=1e-15)
