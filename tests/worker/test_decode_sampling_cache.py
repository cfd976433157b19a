"""The worker's reuse of a decode step's sampling inputs (``Worker._decode_sampling_inputs``): tokens and logprobs
are identical with the reuse and without it, for mixed sampling params (greedy, seeded top-p / top-k, logprobs),
requests joining and finishing mid-flight, with and without speculation; and steady decode really reuses them.
CPU reference backend on the reference model."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.worker.worker import Worker
from tests.reference_assets import needs_reference_model

pytestmark = needs_reference_model

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
           "    for i in range(len(items)):\n"]
PARAMS = [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=11, ignore_eos=True),
    # min_tokens with a stop id: the ban mask (rebuilt every step, not cached) is in play for the first 4 tokens
    SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True, min_tokens=4, stop_token_ids=[264]),
]


@pytest.fixture
def sampling_builds(monkeypatch):
    """Count the decode steps and how many built their sampling inputs anew (``_row_tensors`` in decode)."""
    counts = {"decode_steps": 0, "builds": 0}
    orig_inputs, orig_rows = Worker._decode_sampling_inputs, Worker._row_tensors

    def inputs(self, step, reqs):
        counts["decode_steps"] += 1
        counts["in_decode"] = True
        try:
            return orig_inputs(self, step, reqs)
        finally:
            counts["in_decode"] = False

    def rows(self, reqs, rows):
        if counts.get("in_decode"):
            counts["builds"] += 1
        return orig_rows(self, reqs, rows)

    monkeypatch.setattr(Worker, "_decode_sampling_inputs", inputs)
    monkeypatch.setattr(Worker, "_row_tensors", rows)
    return counts


def _run(reuse: bool, monkeypatch, **kw) -> dict:
    """Requests 0 and 1 first, 3 joining after a few steps, 2 when 1 finishes (the same number of rows, other
    params); -> {id: (tokens, logprobs)}."""
    orig = Worker.execute_model_step

    def step(self, plan, reqs):
        if not reuse:  # drop the cached batch before every step: each decode step builds its inputs anew
            self._decode_sampling_cache = None
        return orig(self, plan, reqs)

    monkeypatch.setattr(Worker, "execute_model_step", step)
    # prefill tried every 2nd decode step (the default waits 70): joins land mid-flight
    llm = LLM(block_size=16, num_kv_blocks=64, prefill_attempt_interval=2, prefill_any_attempt_interval=2, **kw)
    engine = llm.llm_engine
    for i in (0, 1):
        engine.add_request(str(i), PROMPTS[i], PARAMS[i])
    final = {}
    for n in range(1000):
        if n == 4:
            engine.add_request("3", PROMPTS[3], PARAMS[3])
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                final[out.request_id] = (list(o.token_ids), o.logprobs)
                if out.request_id == "1":
                    engine.add_request("2", PROMPTS[2], PARAMS[2])
        if not engine.has_unfinished_requests():
            break
    monkeypatch.setattr(Worker, "execute_model_step", orig)
    return final


@pytest.mark.parametrize("kw", [{}, {"zero_overhead_scheduling": False},
                                {"speculative_method": "mtp", "num_speculative_tokens": 2},
                                {"speculative_method": "mtp", "num_speculative_tokens": 2,
                                 "varlen_verification": False}],
                         ids=["plain", "no-zos", "mtp-varlen", "mtp-fixed"])
def test_reuse_gives_the_same_outputs(kw, monkeypatch, sampling_builds):
    # varlen picks q lengths from measured step times, so with random sampling the accepted tokens may differ run
    # to run (the greedy row does not)
    varlen = kw.get("speculative_method") and kw.get("varlen_verification", True)
    want = _run(False, monkeypatch, **kw)
    sampling_builds.update(decode_steps=0, builds=0)
    got = _run(True, monkeypatch, **kw)
    assert set(got) == {"0", "1", "2", "3"} and (got["0"] == want["0"] if varlen else got == want)
    assert [len(got[str(i)][0]) for i in range(3)] == [p.max_tokens for p in PARAMS[:3]]
    assert PARAMS[3].min_tokens <= len(got["3"][0]) <= PARAMS[3].max_tokens and 264 not in got["3"][0][:4]
    assert got["1"][1] is not None and len(got["1"][1]) == 6  # logprobs came through
    # batch changes (joins, finishes) rebuild; steady steps in between reuse. Varlen verification changes the q
    # lengths (part of the key) from step to step, and a device re-split leaves them unknown to the host: no reuse.
    assert 0 < sampling_builds["builds"] <= sampling_builds["decode_steps"], sampling_builds
    assert varlen or sampling_builds["builds"] < sampling_builds["decode_steps"], sampling_builds


def test_steady_decode_builds_once(monkeypatch, sampling_builds):
    llm = LLM(block_size=16, num_kv_blocks=64)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0.5, seed=1, ignore_eos=True),
                 use_tqdm=False)
    assert sampling_builds["decode_steps"] >= 14 and sampling_builds["builds"] == 1, sampling_builds


def test_the_key_tells_batches_apart():
    """Direct calls: the same q lengths with other requests, params, seeds or prompt lengths build anew; the same
    batch reuses; host-unknown q lengths (a device re-split) never reuse."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from deepinfer_npu.worker.step_io import StepRequests

    worker = LLM(block_size=16, num_kv_blocks=64).llm_engine.worker
    a, b = SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=0.9, top_k=5, seed=2)

    def call(seq_ids, params, seeds, prompt_lens, host=True, q=None):
        n = len(seq_ids)
        q = np.ones(n, dtype=np.int32) if q is None else np.array(q, dtype=np.int32)
        plan = SimpleNamespace(seq_ids=np.array(seq_ids, dtype=np.int64), seqlens_q=q, num_seqs=n)
        step = SimpleNamespace(plan=plan, attn=SimpleNamespace(host=object() if host else None),
                               row_of_token=torch.repeat_interleave(torch.arange(n), torch.from_numpy(q).long()))
        reqs = StepRequests(params=params, seeds=seeds, prompt_lens=np.array(prompt_lens, dtype=np.int64),
                            min_tokens=np.zeros(n, dtype=np.int64), ban_ids=[[] for _ in range(n)],
                            next_tokens=np.zeros(n, dtype=np.int64), draft_caps=np.zeros(n, dtype=np.int64))
        return worker._decode_sampling_inputs(step, reqs)

    first = call([0, 1], [a, a], [1, 1], [5, 6])
    assert call([0, 1], [a, a], [1, 1], [5, 6])[0].temperature is first[0].temperature  # reused
    t, prompt_len_of_token, planned = call([0, 2], [a, b], [1, 2], [5, 7])  # another request in row 1
    assert t.temperature.tolist() == pytest.approx([0.5, 0.9]) and t.top_k.tolist() == [0, 5]
    assert prompt_len_of_token.tolist() == [5, 7] and planned.tolist() == [1, 1]
    for other in (dict(params=[a, a]), dict(seeds=[1, 3]), dict(prompt_lens=[5, 8])):
        args = dict(seq_ids=[0, 2], params=[a, b], seeds=[1, 2], prompt_lens=[5, 7]) | other
        assert call(**args)[0].temperature is not t.temperature
        t = call(seq_ids=[0, 2], params=[a, b], seeds=[1, 2], prompt_lens=[5, 7])[0]
    again = call([0, 2], [a, b], [1, 2], [5, 7])
    assert again[0].temperature is t.temperature and again[0] is not t  # a shallow copy: offsets are per step
    assert call([0, 2], [a, b], [1, 2], [5, 7], host=False)[0].temperature is not t.temperature
    t, prompt_len_of_token, planned = call([0, 2], [a, b], [1, 2], [5, 7], q=[2, 1])  # other q lengths: other rows
    assert t.temperature.tolist() == pytest.approx([0.5, 0.5, 0.9]) and prompt_len_of_token.tolist() == [5, 5, 7]
    assert planned.tolist() == [2, 1]
