"""Prefill attempt points through ``LLM.generate`` (docs/interfaces.md, the vote): a burst of requests that arrives
while nothing runs prefills completely before its first decode step, however many decode steps the engine ran
before; a request that arrives while others decode waits for the next attempt point."""

from __future__ import annotations

import pytest

from benchmarks.decode_workload import TINY, write_model_dir
from deepinfer_npu import LLM, SamplingParams

PROMPT_LEN = 48
STEP_TOKENS = 64  # one prompt a prefill step: a burst of N prompts needs N prefill steps


@pytest.fixture(scope="module")
def llm():
    return LLM(write_model_dir(TINY, "attempt_points_"), load_format="dummy", backend="cpu", dtype="float32",
               max_model_len=256, max_num_seqs=8, max_num_batched_tokens=STEP_TOKENS, seed=0)


def _steps(llm, prompts, max_tokens) -> tuple[int, int]:
    before = llm.get_stats()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    after = llm.get_stats()
    return after["prefill_steps"] - before["prefill_steps"], after["decode_steps"] - before["decode_steps"]


def _prompts(n: int, salt: int) -> list[list[int]]:
    return [[(7 * i + 13 * j + salt) % 500 + 2 for j in range(PROMPT_LEN)] for i in range(n)]


def test_a_burst_after_earlier_decode_prefills_before_decoding(llm):
    assert _steps(llm, _prompts(1, 0), 31) == (1, 30)  # 30 decode steps: the counter is off an attempt point
    # 6 prompts, one a step; 10 tokens each: the first comes from the prefill, 9 from decode steps of all 6.
    # Counting from the engine's first step, the next point would be 70 decode steps away: the 5 prompts after
    # the first would wait there while the first decoded alone.
    assert _steps(llm, _prompts(6, 1), 10) == (6, 9)
    assert _steps(llm, _prompts(6, 2), 10) == (6, 9)  # and again, whatever the counter reached


def test_a_request_arriving_mid_decode_waits_for_the_attempt_point(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=80, ignore_eos=True, temperature=0.0)
    engine.add_request("first", {"prompt_token_ids": _prompts(1, 3)[0]}, params)
    interval = engine.scheduler.config.prefill_attempt_interval
    for _ in range(1 + 5):  # the prefill, then 5 decode steps
        engine.step()
    engine.add_request("second", {"prompt_token_ids": _prompts(1, 4)[0]},
                       SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    waited = 0
    while engine.scheduler.num_waiting:
        engine.step()
        waited += 1
    assert waited == interval - 5 + 1  # decode steps up to the point, then the prefill step that admits it
    while engine.has_unfinished_requests():
        engine.step()
