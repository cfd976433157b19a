"""The counter-based hash RNG: exact (matches the scalar spec), in (0, 1), uniform, independent streams."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_npu.sampling.rng import (
    _M32,
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    _mul32_,
    derive_seed,
    hash_uniform,
    hash_uniform_cols,
    hash_uniform_py,
    new_request_seed,
    seed_to_int64,
)


def ks_statistic(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between the sample ``u`` and U(0, 1)."""
    x = torch.sort(u.double().flatten()).values
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - x, x - (i - 1) / n).max())


def ks_critical(n: int) -> float:
    return 1.95 / n**0.5  # alpha = 0.001


def test_mul32_is_exact() -> None:
    rng = random.Random(0)
    xs = [rng.getrandbits(32) for _ in range(2000)] + [0, 1, _M32]
    for c in (0x7FEB352D, 0x846CA68B, _M32, 1):
        got = _mul32_(torch.tensor(xs, dtype=torch.int64), c).tolist()
        assert got == [(x * c) & _M32 for x in xs]


def test_matches_scalar_spec() -> None:
    rng = random.Random(1)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63)] + [rng.getrandbits(64) - 2**63 for _ in range(11)]
    offsets = [0, 1, 2**32, 2**40 + 5] + [rng.getrandbits(40) for _ in range(12)]
    st = torch.tensor(seeds, dtype=torch.int64)
    ot = torch.tensor(offsets, dtype=torch.int64)
    for stream in (STREAM_SAMPLE, STREAM_ACCEPT, 7):
        u = hash_uniform(st, ot, 37, stream=stream, dtype=torch.float64)
        ref = [[hash_uniform_py(s, o, j, stream) for j in range(37)] for s, o in zip(seeds, offsets)]
        assert u.tolist() == ref
    cols = torch.tensor([[0, 5, 2**31], [7, 7, 99]] * 8, dtype=torch.int64)
    u = hash_uniform_cols(st, ot, cols, stream=2, dtype=torch.float64)
    assert u.tolist() == [
        [hash_uniform_py(s, o, int(c), 2) for c in row] for s, o, row in zip(seeds, offsets, cols.tolist())
    ]


def test_float32_and_float64_identical_and_repeatable() -> None:
    seeds = torch.arange(-50, 50, dtype=torch.int64) * 0x9E3779B97F4A7C1
    offsets = torch.arange(100, dtype=torch.int64) * 3
    u32 = hash_uniform(seeds, offsets, 1000, dtype=torch.float32)
    u64 = hash_uniform(seeds, offsets, 1000, dtype=torch.float64)
    assert u32.dtype == torch.float32 and u64.dtype == torch.float64
    assert torch.equal(u32.double(), u64)
    assert torch.equal(u32, hash_uniform(seeds.clone(), offsets.clone(), 1000))
    # the inputs are not modified in place
    assert torch.equal(seeds, torch.arange(-50, 50, dtype=torch.int64) * 0x9E3779B97F4A7C1)


def test_open_interval() -> None:
    u = hash_uniform(torch.arange(64), torch.zeros(64, dtype=torch.int64), 50_000, dtype=torch.float64)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # the extreme representable values are 2**-24 and 1 - 2**-24
    assert float(u.min()) >= 2.0**-24 and float(u.max()) <= 1 - 2.0**-24


@pytest.mark.parametrize("axis", ["columns", "offsets", "seeds", "streams"])
def test_uniform_ks(axis: str) -> None:
    n = 200_000
    if axis == "columns":
        u = hash_uniform(torch.tensor([12345]), torch.tensor([0]), n)
    elif axis == "offsets":  # the axis the sampler walks for one request and one token id
        u = hash_uniform_cols(torch.full((n,), 7), torch.arange(n), torch.tensor([3]))
    elif axis == "seeds":
        u = hash_uniform_cols(torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.tensor([0]))
    else:
        u = torch.cat(
            [hash_uniform(torch.tensor([1]), torch.tensor([0]), n // 4, stream=s) for s in range(4)], dim=1
        )
    assert ks_statistic(u) < ks_critical(u.numel())
    # Consecutive values are uncorrelated.
    x = u.double().flatten() - 0.5
    corr = float((x[1:] * x[:-1]).mean() / (x * x).mean())
    assert abs(corr) < 4.0 / n**0.5


def test_ks_detects_non_uniform() -> None:
    u = hash_uniform(torch.tensor([1]), torch.tensor([0]), 200_000) ** 1.02  # a slight distortion
    assert ks_statistic(u) > ks_critical(u.numel())


def test_streams_seeds_offsets_give_different_noise() -> None:
    base = hash_uniform(torch.tensor([5]), torch.tensor([9]), 1000)
    for other in (
        hash_uniform(torch.tensor([5]), torch.tensor([9]), 1000, stream=STREAM_ACCEPT),
        hash_uniform(torch.tensor([6]), torch.tensor([9]), 1000),
        hash_uniform(torch.tensor([5]), torch.tensor([10]), 1000),
        hash_uniform(torch.tensor([5 + 2**32]), torch.tensor([9]), 1000),  # high seed bits matter
        hash_uniform(torch.tensor([5]), torch.tensor([9 + 2**32]), 1000),  # high offset bits matter
    ):
        assert (other == base).float().mean() < 0.01


def test_seeds_wrap_to_int64_and_derive_distinct_reproducible_children() -> None:
    assert seed_to_int64(2**64 - 1) == -1 and seed_to_int64(-1) == -1 and seed_to_int64(5) == 5
    assert seed_to_int64(2**63) == -(2**63)
    a, b = random.Random(0), random.Random(0)
    seeds = [new_request_seed(a) for _ in range(5)]
    assert seeds == [new_request_seed(b) for _ in range(5)] and len(set(seeds)) == 5
    assert all(0 <= s < 2**63 for s in seeds)
    kids = [derive_seed(1234, i) for i in range(100)]
    assert kids[0] == 1234 and len(set(kids)) == 100 and all(0 <= k < 2**63 for k in kids)
    assert kids == [derive_seed(1234, i) for i in range(100)]
