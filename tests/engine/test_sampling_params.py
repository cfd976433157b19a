"""SamplingParams validation (ValueError naming the parameter) and normalisation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deepinfer_npu.engine.sampling_params import SamplingParams

INVALID = [
    ("n", 0),
    ("n", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("seed", 1.5),
    ("seed", "42"),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("include_stop_str_in_output", None),
    ("skip_special_tokens", 0),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_raises_naming_the_parameter(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens.*max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=4, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=1000)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_k, p.top_p) == (1, 16, 0, 1.0, 0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy


def test_normalisation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).all_stop_token_ids == {3, 4}
    p = SamplingParams(temperature=0, top_k=5, top_p=0.5)
    assert p.is_greedy and p.top_k == 0 and p.top_p == 1.0
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    # numpy integers / floats are accepted and converted to Python types
    q = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5), seed=np.int32(3))
    assert type(q.max_tokens) is int and type(q.temperature) is float and q.seed == 3
    assert SamplingParams(seed=-(2**70)).seed == -(2**70)  # any int; reduced to 64 bits by the sampler
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20).logprobs == 20
    assert SamplingParams(n=3).n == 3


def test_clone_is_independent() -> None:
    p = SamplingParams(stop=["a"])
    q = p.clone()
    q.stop.append("b")
    assert p.stop == ["a"] and q == SamplingParams(stop=["a", "b"])
