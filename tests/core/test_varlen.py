"""Varlen verification allocator (seed §7.2).

Prefix property, monotonicity, brute-force optimum, curve shapes, and its use inside the scheduler."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import numpy as np
import pytest
from tests.core.scheduler_driver import make_sched, prefill_all
from hypothesis import given, settings

from deepinfer_npu import _core as C


def score(probs, drafts, graph_sizes, step_ms, slope, sampler):
    n = probs.shape[0]
    cum = np.cumprod(probs.astype(np.float64), axis=1)
    total_q = n + int(sum(drafts))
    expected = n + sum(cum[i, :d].sum() for i, d in enumerate(drafts))
    g = next(i for i, x in enumerate(graph_sizes) if x >= total_q)
    return expected / (step_ms[g] + slope * graph_sizes[g] + sampler)


def brute_force(probs, graph_sizes, step_ms, slope, sampler, max_total_q=0):
    n, k = probs.shape
    limit = graph_sizes[-1] if max_total_q == 0 else min(graph_sizes[-1], max_total_q)
    best = None
    for drafts in itertools.product(range(k + 1), repeat=n):
        if n + sum(drafts) > limit:
            continue
        sc = score(probs, drafts, graph_sizes, step_ms, slope, sampler)
        if best is None or sc > best[0]:
            best = (sc, drafts)
    return best


curves = st.integers(1, 6).flatmap(
    lambda m: st.tuples(
        st.lists(st.integers(1, 4), min_size=m, max_size=m).map(lambda d: list(np.cumsum(d) + 1)),
        st.lists(st.floats(0.5, 10.0), min_size=m, max_size=m).map(sorted),
    )
)
prob_arrays = st.integers(1, 4).flatmap(
    lambda n: st.integers(1, 3).flatmap(
        lambda k: st.lists(st.floats(0.0, 1.0, width=32), min_size=n * k, max_size=n * k).map(
            lambda v: np.array(v, dtype=np.float32).reshape(n, k)
        )
    )
)


@settings(max_examples=150, deadline=None)
@given(probs=prob_arrays, curve=curves, slope=st.floats(0, 0.5), sampler=st.floats(0, 2.0))
def test_matches_brute_force_optimum_and_prefix(probs, curve, slope, sampler):
    graph_sizes, step_ms = curve
    n, k = probs.shape
    total_q, drafts = C.varlen_allocate(probs, graph_sizes, step_ms, slope, sampler)
    drafts = drafts.tolist()
    assert total_q == n + sum(drafts) or (n >= graph_sizes[-1] and total_q == n)
    assert all(0 <= d <= k for d in drafts)
    assert total_q <= max(graph_sizes[-1], n)
    if n >= graph_sizes[-1]:
        assert drafts == [0] * n
        return
    # prefix property: drafts[i] counts positions 0..d-1 of request i, and the chosen set is the top of the
    # cumulative products (everything chosen >= everything not chosen)
    cum = np.cumprod(probs.astype(np.float64), axis=1)
    chosen = [cum[i, j] for i in range(n) for j in range(drafts[i])]
    rest = [cum[i, j] for i in range(n) for j in range(drafts[i], k)]
    if chosen and rest:
        assert min(chosen) >= max(rest) - 1e-12
    best_score, _ = brute_force(probs, graph_sizes, step_ms, slope, sampler)
    assert score(probs, drafts, graph_sizes, step_ms, slope, sampler) == pytest.approx(best_score, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(probs=prob_arrays, curve=curves, bump=st.floats(0.0, 1.0))
def test_monotone_dominating_request_gets_at_least_as_many(probs, curve, bump):
    graph_sizes, step_ms = curve
    if probs.shape[0] < 2:
        return
    # request 1 dominates request 0 element-wise (strictly where possible)
    probs = probs.copy()
    probs[1] = np.minimum(
        1.0, np.maximum(probs[1], probs[0]) + np.float32(bump) * (1 - np.maximum(probs[1], probs[0]))
    )
    _, drafts = C.varlen_allocate(probs[[1, 0]], graph_sizes, step_ms)
    assert drafts[0] >= drafts[1]


def test_prefix_allocation_order_example():
    probs = np.array([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5], [0.99, 0.2, 0.9]], np.float32)
    # flat curve up to 12: everything with positive gain is verified
    total_q, drafts = C.varlen_allocate(probs, [4, 8, 12], [1.0, 1.0, 1.0])
    assert total_q == 12 and drafts.tolist() == [3, 3, 3]


def test_flat_curve_verifies_nearly_everything():
    rng = np.random.default_rng(1)
    probs = rng.uniform(0.05, 1.0, size=(16, 5)).astype(np.float32)
    graph_sizes = list(range(8, 129, 8))
    total_q, drafts = C.varlen_allocate(probs, graph_sizes, [10.0] * len(graph_sizes), 0.0, 1.0)
    assert total_q >= 16 + 0.9 * 80
    assert total_q == 16 + drafts.sum()


def test_steep_curve_cuts_low_probability_drafts():
    probs = np.array([[0.95, 0.9, 0.85, 0.1, 0.1]] * 8 + [[0.2, 0.1, 0.1, 0.1, 0.1]] * 8, np.float32)
    graph_sizes = list(range(1, 129))
    step_ms = [1.0 + 0.5 * g for g in graph_sizes]  # time grows as fast as tokens: only sure drafts pay
    total_q, drafts = C.varlen_allocate(probs, graph_sizes, step_ms)
    assert total_q < 16 + 80 // 2
    assert (drafts[8:] == 0).all() and (drafts[:8] >= 1).all() and (drafts[:8] <= 3).all()


def test_ties_keep_the_smaller_total_q_and_max_total_q():
    probs = np.zeros((2, 3), np.float32)
    total_q, drafts = C.varlen_allocate(probs, [8], [1.0])
    assert total_q == 2 and drafts.tolist() == [0, 0]  # zero-probability drafts add nothing: ties keep fewer
    total_q, drafts = C.varlen_allocate(np.ones((2, 3), np.float32), [8], [1.0], max_total_q=5)
    assert total_q == 5 and drafts.tolist() == [2, 1]  # equal products: round-robin by position, then request
    total_q, drafts = C.varlen_allocate(np.ones((9, 3), np.float32), [8], [1.0])
    assert total_q == 9 and drafts.tolist() == [0] * 9  # n above the largest graph: no drafts


def test_varlen_allocate_validation():
    with pytest.raises(ValueError, match="probs"):
        C.varlen_allocate(np.array([[1.5]], np.float32), [1, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="probs"):
        C.varlen_allocate(np.array([0.5], np.float32), [1, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="strictly increasing"):
        C.varlen_allocate(np.ones((1, 1), np.float32), [2, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="same length"):
        C.varlen_allocate(np.ones((1, 1), np.float32), [2, 4], [1.0])
    with pytest.raises(TypeError, match="graph_sizes"):
        C.varlen_allocate(np.ones((1, 1), np.float32), [2.5], [1.0])


def test_scheduler_uses_varlen_over_draft_probs():
    s = make_sched(nextn=3, max_num_batched_tokens=64)
    for i in range(4):
        s.add_seq(i, [1, 2, 3], 100)
    prefill_all(s)
    graph_sizes = list(range(1, 65))
    s.configure_varlen(graph_sizes, [1.0 + 0.3 * g for g in graph_sizes])
    s.set_runtime_estimates(0.0, 0.0)
    assert s.varlen_enabled
    s.set_draft_probs([0, 1, 2, 3], np.array([[0.99, 0.99, 0.99], [0.01, 0.01, 0.01]] * 2, np.float32))
    out = s.schedule(False)
    drafts = dict(zip(out.seq_ids.tolist(), out.num_drafts.tolist()))
    expected_q, expected = C.varlen_allocate(
        np.array([[0.99] * 3, [0.01] * 3] * 2, np.float32), graph_sizes, [1.0 + 0.3 * g for g in graph_sizes]
    )
    assert out.num_tokens == expected_q
    assert drafts[0] == drafts[2] == expected[0] > 0 and drafts[1] == drafts[3] == 0
    with pytest.raises(ValueError, match="nextn=3"):
        s.set_draft_probs([0], np.ones((1, 2), np.float32))
