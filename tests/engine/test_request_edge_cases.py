"""Request edge cases on the reference model: a forked child's own max_tokens and aligned logprobs,
out-of-vocabulary stop ids, n > 1, the varlen calibrator forgetting finished requests, abort ids."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM, SamplingParams
from tests.reference_assets import needs_reference_model

pytestmark = needs_reference_model


def _run_until_done(engine, on_out=None, max_steps=200):
    final = {}
    for _ in range(max_steps):
        for out in engine.step():
            if on_out is not None:
                on_out(out)
            if out.finished:
                final[out.request_id] = out.outputs[0]
        if not engine.has_unfinished_requests():
            return final, True
    return final, False


@pytest.mark.parametrize("zos", [True, False])
def test_fork_child_with_larger_max_tokens_finishes(zos):
    engine = LLM(zero_overhead_scheduling=zos).llm_engine
    engine.add_request("p", "def fibonacci(n):\n", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    state = {"forked": False}

    def fork(out):
        if out.request_id == "p" and not state["forked"] and out.outputs[0].token_ids:
            engine.fork_request("p", "c", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
            state["forked"] = True

    final, done = _run_until_done(engine, fork)
    assert done, f"engine never finished; unfinished={engine.get_num_unfinished_requests()}"
    assert len(final["c"].token_ids) == 20


def test_fork_child_logprobs_align_with_tokens():
    engine = LLM(zero_overhead_scheduling=False).llm_engine
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    engine.add_request("p", "def fibonacci(n):\n", sp)
    state = {"forked": False}

    def fork(out):
        if out.request_id == "p" and not state["forked"] and len(out.outputs[0].token_ids) >= 2:
            engine.fork_request("p", "c")
            state["forked"] = True

    final, done = _run_until_done(engine, fork)
    assert done
    child = final["c"]
    assert len(child.logprobs) == len(child.token_ids)
    assert all(tok in lp for tok, lp in zip(child.token_ids, child.logprobs))


def test_out_of_vocab_stop_token_id_rejected_at_add_request():
    llm = LLM()
    engine = llm.llm_engine
    bad = SamplingParams(max_tokens=4, min_tokens=2, temperature=0.0, stop_token_ids=[engine.vocab_size + 10])
    with pytest.raises(ValueError):
        engine.add_request("bad", "def f(x):\n", bad)
    # ... and if it was accepted, generation must still work:
    engine.add_request("ok", "def f(x):\n", SamplingParams(max_tokens=4, temperature=0.0))
    _run_until_done(engine)


def test_n_greater_than_one_is_honoured_or_rejected():
    llm = LLM()
    try:
        outs = llm.generate(["def f(x):\n"], SamplingParams(n=2, max_tokens=3, temperature=0.8, seed=1),
                            use_tqdm=False)
    except ValueError:
        return  # rejecting n > 1 is fine too
    assert len(outs[0].outputs) == 2


def test_varlen_calibrator_forgets_finished_requests():
    llm = LLM(speculative_method="mtp", num_speculative_tokens=3, varlen_verification=True)
    for _ in range(3):
        llm.generate(["def f(x):\n"] * 4, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    assert len(llm.llm_engine.varlen.calibrator.last) == 0


def test_abort_request_accepts_the_same_ids_as_add_request():
    engine = LLM().llm_engine
    engine.add_request(1, "def f():", SamplingParams(max_tokens=3))
    engine.abort_request(1)
    assert engine.get_num_unfinished_requests() == 0
