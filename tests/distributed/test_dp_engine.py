"""The data-parallel engine over real rank processes (CPU backend, gloo): same tokens as one engine, requests
spread over the ranks, bad requests answered without stalling the others, aborts, and a dead rank reported."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepinfer_npu.config import EngineConfig
from deepinfer_npu.distributed.dp_engine import DPEngine
from deepinfer_npu.distributed.rank_worker import visible_device_for
from deepinfer_npu.engine.llm_engine import LLMEngine
from deepinfer_npu.engine.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(", "# sort a list\n",
           "with open("]


def _run(engine, params_for) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params_for(i))
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + 300
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


@pytest.fixture(scope="module")
def dp_engine():
    engine = DPEngine(EngineConfig(max_num_seqs=8, seed=3), data_parallel_size=2, timeout_s=60)
    yield engine
    engine.shutdown()


def test_tokens_equal_single_engine_and_requests_spread(dp_engine):
    def params(i):  # greedy and seeded-by-the-front-end sampling
        return SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, ignore_eos=True)

    single = _run(LLMEngine(EngineConfig(max_num_seqs=8, seed=3)), params)
    seen = []
    orig_add = dp_engine.add_request

    def add(request_id, prompt, p):
        orig_add(request_id, prompt, p)
        seen.append(dp_engine.requests_per_rank())

    dp_engine.add_request = add
    try:
        multi = _run(dp_engine, params)
    finally:
        del dp_engine.add_request
    assert multi == single
    assert min(seen[-1]) >= 2, f"requests were not spread over the ranks: {seen[-1]}"


def test_bad_request_is_answered_and_others_finish(dp_engine):
    with pytest.raises(ValueError, match=r"request 'bad'.*stop_token_ids"):
        dp_engine.add_request("bad", "x = 1\n", SamplingParams(max_tokens=4, stop_token_ids=[10**9]))
    dp_engine.add_request("ok", "x = 1\n", SamplingParams(max_tokens=4, ignore_eos=True))
    dp_engine.add_request("gone", "y = 2\n", SamplingParams(max_tokens=400, ignore_eos=True))
    dp_engine.abort_request("gone")
    reasons = {}
    deadline = time.monotonic() + 120
    while dp_engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in dp_engine.step():
            if out.finished:
                reasons[out.request_id] = out.outputs[0].finish_reason
    assert reasons == {"ok": "length", "gone": "abort"}


def test_dead_rank_is_named():
    engine = DPEngine(EngineConfig(max_num_seqs=4), data_parallel_size=2, timeout_s=30)
    try:
        engine.add_request("a", "import sys\n", SamplingParams(max_tokens=200, ignore_eos=True))
        os.kill(engine._procs[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"DP rank 1 exited with code -9"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                engine.step()
    finally:
        engine.shutdown()
    assert all(p.exitcode is not None for p in engine._procs)


def test_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_device_for(1, "CUDA_VISIBLE_DEVICES") == "5"
    with pytest.raises(RuntimeError, match="lists 2 devices"):
        visible_device_for(2, "CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_device_for(2, "CUDA_VISIBLE_DEVICES") == "2"
