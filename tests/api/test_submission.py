"""``generate`` is all-or-nothing and returns only its own requests; requests added through ``llm_engine`` stay
with whoever added them; malformed token ids are errors naming the request."""

from __future__ import annotations

import pytest

from deepinfer_npu import SamplingParams

from .conftest import needs_ref

pytestmark = needs_ref

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_generate_rejects_bad_params_without_queuing_any(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"logit_bias token id\(s\) \[1000000\].*index 1"):
        llm.generate(["def f(x):\n", "import os\n"],
                     [SamplingParams(max_tokens=4), SamplingParams(logit_bias={1_000_000: 1.0})], use_tqdm=False)
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    outs = llm.generate(["class A:\n"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["class A:\n"]


def test_generate_rejects_bad_prompt_without_queuing_any(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"token id 1\.5 at position 0 is not an integer.*index 1"):
        llm.generate(["def f(x):\n", {"prompt_token_ids": [1.5, 2]}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="index 0"):
        llm.generate(["def f(x):\n", "import os\n"], ["not params", GREEDY], use_tqdm=False)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("ids, bad", [([1.5, 2], "1.5"), (["a", 2], "'a'"), ([True, 2], "True")])
def test_non_integer_token_ids_name_the_request(llm, ids, bad):
    with pytest.raises(ValueError) as err:
        llm.llm_engine.add_request("req-7", {"prompt_token_ids": ids}, GREEDY)
    assert "'req-7'" in str(err.value) and bad in str(err.value) and "not an integer" in str(err.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_requests_added_through_llm_engine_stay_with_their_caller(llm):
    engine = llm.llm_engine
    # shorter than generate's requests: it finishes inside generate's steps
    engine.add_request("mine", "def fibonacci(n):\n", SamplingParams(max_tokens=2, temperature=0.0,
                                                                      ignore_eos=True))
    outs = llm.generate(["import os\n", "class A:\n"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["import os\n", "class A:\n"]
    assert all(not o.request_id.startswith("mine") for o in outs)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "mine"
            if out.finished:
                final[out.request_id] = out
    assert len(final["mine"].outputs[0].token_ids) == 2
    assert final["mine"].outputs[0].finish_reason == "length"
