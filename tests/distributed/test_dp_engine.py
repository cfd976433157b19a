"""The data-parallel engine over real rank processes (CPU backend, gloo): the same tokens as one engine, requests
spread over the ranks, all-or-nothing submission, bad requests answered without stalling the others, aborts,
merged stats, and a dead rank named."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepinfer_npu import LLM
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.distributed.dp_engine import DPEngine
from deepinfer_npu.distributed.rank_worker import visible_device_for
from deepinfer_npu.engine.sampling_params import SamplingParams

#: one pytest-xdist worker runs the module: the rank processes of dp_llm are started once
pytestmark = pytest.mark.xdist_group("dp_engine")

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(", "# sort a list\n",
           "with open("]


def _params(i: int) -> SamplingParams:  # greedy, and sampling seeded by the front-end in submission order
    return SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, ignore_eos=True)


@pytest.fixture(scope="module")
def dp_llm():
    # every rank holds every expert here (pure data parallelism); expert parallelism: test_ep_engine.py
    llm = LLM(max_num_seqs=8, seed=3, data_parallel_size=2, enable_expert_parallel=False, distributed_timeout_s=60)
    yield llm
    llm.llm_engine.shutdown()
    # a clean stop is exit code 0 for every rank process (no abort in the interpreter's teardown)
    assert [p.exitcode for p in llm.llm_engine._procs] == [0, 0]


def test_generate_equals_one_engine_and_requests_spread(dp_llm):
    params = [_params(i) for i in range(len(PROMPTS))]
    single = LLM(max_num_seqs=8, seed=3).generate(PROMPTS, params, use_tqdm=False)
    engine = dp_llm.llm_engine
    spread = []
    add = engine.add_requests

    def recording_add(requests, **kw):
        add(requests, **kw)
        spread.append(engine.requests_per_rank())

    engine.add_requests = recording_add
    try:
        multi = dp_llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        del engine.add_requests
    assert [o.outputs[0].token_ids for o in multi] == [o.outputs[0].token_ids for o in single]
    assert [o.outputs[0].text for o in multi] == [o.outputs[0].text for o in single]
    assert sorted(spread[0]) == [3, 3], f"requests were not spread over the ranks: {spread}"
    stats = dp_llm.get_stats()
    assert stats["data_parallel_size"] == 2 and len(stats["per_rank"]) == 2
    assert stats["generation_tokens"] == sum(r["generation_tokens"] for r in stats["per_rank"]) >= 6 * 12


def test_ranks_prepare_the_grammar_compiler_off_the_request_path(dp_llm):
    """A server prepares structured output after start-up (serve.py): a data-parallel engine asks every rank to
    build its grammar compiler on a thread of its own, so no rank's first constrained request waits for it."""
    pytest.importorskip("xgrammar")
    engine = dp_llm.llm_engine
    assert not engine.structured_output_ready  # nothing in this module asks for a grammar
    assert engine.prepare_structured_output() == [True, True]
    deadline = time.monotonic() + 120
    while not engine.structured_output_ready and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine.structured_output_ready


def test_all_or_nothing_and_bad_request_answered(dp_llm):
    engine = dp_llm.llm_engine
    with pytest.raises(ValueError, match=r"stop_token_ids .* \(index 1 of the 2 submitted; none was queued\)"):
        dp_llm.generate(["a = 1\n", "b = 2\n"], [SamplingParams(max_tokens=4),
                                                 SamplingParams(max_tokens=4, stop_token_ids=[10**9])])
    assert engine.get_num_unfinished_requests() == 0
    with pytest.raises(ValueError, match=r"request 'bad'.*stop_token_ids"):
        engine.add_request("bad", "x = 1\n", SamplingParams(max_tokens=4, stop_token_ids=[10**9]))
    engine.add_request("ok", "x = 1\n", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("gone", "y = 2\n", SamplingParams(max_tokens=400, ignore_eos=True))
    engine.abort_request("gone")
    reasons = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.outputs[0].finish_reason
    assert reasons == {"ok": "length", "gone": "abort"}


def test_dead_rank_is_named():
    engine = DPEngine(EngineConfig(max_num_seqs=4, data_parallel_size=2, distributed_timeout_s=30))
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


def test_config_and_visible_devices(monkeypatch):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        EngineConfig(distributed_timeout_s=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_device_for(1, "CUDA_VISIBLE_DEVICES") == "5"
    with pytest.raises(RuntimeError, match="lists 2 devices"):
        visible_device_for(2, "CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_device_for(2, "CUDA_VISIBLE_DEVICES") == "2"


def test_cli_data_parallel_gives_the_single_process_tokens():
    import json
    import subprocess
    import sys

    def tokens(dp: int) -> list:
        r = subprocess.run([sys.executable, "-m", "deepinfer_npu.run", "--data-parallel-size", str(dp),
                            "--max-tokens", "8", "--json", "--no-progress"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        return [row["token_ids"] for row in rows if "token_ids" in row]

    one, two = tokens(1), tokens(2)
    assert len(one) == 4 and one == two
