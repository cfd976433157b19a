"""One ``LLM`` shared by 8 threads: concurrent ``generate`` calls, direct ``llm_engine`` use with aborts and a
rejected submission, all at once; every output equals the single-threaded result."""

from __future__ import annotations

import threading

import pytest

from deepinfer_npu import SamplingParams

from .conftest import needs_ref

pytestmark = needs_ref

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(10):\n", "x = 1\n",
           "print('hi')\n", "# comment\n", "def f(a, b):\n"]


def _jobs() -> list[tuple[list[str], list[SamplingParams]]]:
    """Per generate thread: prompts and mixed parameters (greedy, seeded top-p / top-k sampling, stop string)."""
    jobs = []
    for t in range(6):
        prompts = [PROMPTS[(t + j) % len(PROMPTS)] for j in range(2 + t % 2)]
        params = [
            SamplingParams(max_tokens=6 + t, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=100 + t, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=7 * t, stop=["\n\n"]),
        ][: len(prompts)]
        jobs.append((prompts, params))
    return jobs


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_one_llm_hammered_from_8_threads_matches_single_threaded(llm):
    jobs = _jobs()
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    long_greedy = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    expected = [_tokens(llm.generate(p, sp, use_tqdm=False)) for p, sp in jobs]
    expected_direct = _tokens(llm.generate([PROMPTS[0], PROMPTS[1]], [greedy, long_greedy], use_tqdm=False))
    expected_last = _tokens(llm.generate(PROMPTS[2:4], greedy, use_tqdm=False))

    results: dict = {}
    errors: list = []
    start = threading.Barrier(8)

    def generate_thread(t: int) -> None:
        prompts, params = jobs[t]
        start.wait()
        results[t] = [_tokens(llm.generate(prompts, params, use_tqdm=False)) for _ in range(2)]

    def direct_thread() -> None:  # the LLMEngine API next to generate: add, step, abort
        engine = llm.llm_engine
        start.wait()
        engine.add_request("direct-a", PROMPTS[0], greedy)
        engine.add_request("direct-b", PROMPTS[1], long_greedy)
        final, aborted = {}, False
        while len(final) < 2:
            for out in engine.step():
                assert out.request_id.startswith("direct-"), out.request_id  # never another caller's request
                if out.request_id == "direct-b" and not aborted and len(out.outputs[0].token_ids) >= 2:
                    engine.abort_request("direct-b")
                    aborted = True
                if out.finished:
                    final[out.request_id] = out
        results["direct"] = final

    def rejected_then_valid_thread() -> None:  # an invalid submission mid-run queues nothing
        start.wait()
        with pytest.raises(ValueError, match="logit_bias"):
            llm.generate(PROMPTS[2:4], [greedy, SamplingParams(logit_bias={1_000_000: 1.0})], use_tqdm=False)
        results["last"] = _tokens(llm.generate(PROMPTS[2:4], greedy, use_tqdm=False))

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(generate_thread, t), daemon=True) for t in range(6)]
    threads += [threading.Thread(target=guarded, args=(direct_thread,), daemon=True),
                threading.Thread(target=guarded, args=(rejected_then_valid_thread,), daemon=True)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not [th for th in threads if th.is_alive()], "threads still running (deadlock or lost outputs)"
    assert not errors, errors
    for t in range(6):
        assert results[t] == [expected[t], expected[t]], f"thread {t}"
    direct = results["direct"]
    assert direct["direct-a"].outputs[0].token_ids == expected_direct[0]
    b = direct["direct-b"].outputs[0]
    # Other threads step the engine too, so direct-b may have run to its length before the abort landed;
    # either way its tokens are the single-threaded ones.
    if b.finish_reason == "length":
        assert b.token_ids == expected_direct[1]
    else:
        assert b.finish_reason == "abort" and b.token_ids == expected_direct[1][: len(b.token_ids)]
    assert results["last"] == expected_last
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
