"""Engine behaviour end to end: bad input, too-long prompts, abort, preemption (finish and recompute), seeds,
logprobs. Each test asserts the behaviour it names; the other requests' outputs must stay exact."""

from __future__ import annotations

import json

import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.engine.llm_engine import LLMEngine

from .conftest import PROMPTS, hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(hf_models):
    return hf_models["v3_grouped"]


@pytest.fixture(scope="module")
def reference(model):
    return [hf_greedy(model[0], p, 24) for p in PROMPTS]


def _llm(model_dir, **kw):
    kw.setdefault("block_size", 16)
    kw.setdefault("max_model_len", 128)
    return LLM(model_dir, **kw)


def _prompts(ps):
    return [{"prompt_token_ids": p} for p in ps]


def test_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        LLM(tmp_path / "does_not_exist")


def test_malformed_config_names_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(tmp_path)


def test_max_model_len_above_model_limit(model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(model[1], max_model_len=10**6)


def test_empty_prompt_and_oov_ids_rejected_without_disturbing_others(model, reference):
    llm = _llm(model[1])
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token id 96 at position 1 is out of the vocabulary \[0, 96\)"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 96]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", GREEDY, use_tqdm=False)
    # Nothing half-submitted: the engine is idle and still serves exact outputs.
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate(_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_add_request_errors_while_running(model, reference):
    engine = _llm(model[1]).llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.add_request("b", {"prompt_token_ids": [-1]}, GREEDY)
    final = _drain(engine)
    assert final["a"].outputs[0].token_ids == reference[0]


def _drain(engine: LLMEngine) -> dict:
    final = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_prompt_longer_than_max_model_len_is_ignored_others_complete(model, reference):
    llm = _llm(model[1], max_model_len=32)
    long_prompt = list(range(1, 41))
    ok = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(_prompts([PROMPTS[0], long_prompt, PROMPTS[1]]), ok, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "ignored"
    assert "40" in outs[1].outputs[0].finish_message and "32" in outs[1].outputs[0].finish_message
    assert outs[1].outputs[0].token_ids == []
    assert outs[0].outputs[0].token_ids == reference[0][:8]
    assert outs[2].outputs[0].token_ids == reference[1][:8]


def test_generation_stops_at_max_model_len(model, reference):
    llm = _llm(model[1], max_model_len=20)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=100, temperature=0.0,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(PROMPTS[0]) + len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].token_ids == reference[0][:15]


@pytest.mark.parametrize("zos", [True, False])
def test_abort_mid_generation_keeps_others_exact_and_frees_everything(model, reference, zos):
    engine = _llm(model[1], zero_overhead_scheduling=zos).llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    final = {}
    for step in range(10_000):
        if step == 5:
            engine.abort_request(["1", "3"])
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert final["1"].outputs[0].finish_reason == "abort"
    assert final["3"].outputs[0].finish_reason == "abort"
    assert len(final["1"].outputs[0].token_ids) < 24
    assert final["0"].outputs[0].token_ids == reference[0]
    assert final["2"].outputs[0].token_ids == reference[2]
    sched = engine.scheduler
    sched.check_invariants()
    assert sched.kv_usage() == 0.0 and not sched.has_unfinished()


def test_forced_preemption_finishes_requests_by_default(model, reference):
    # 9 usable blocks of 16 tokens cannot hold four sequences growing to 29..57 tokens.
    llm = _llm(model[1], num_kv_blocks=10)
    outs = llm.generate(_prompts(PROMPTS), GREEDY, use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert llm.get_stats()["preempted_requests"] > 0
    assert "preempted" in reasons
    for o, ref in zip(outs, reference):
        c = o.outputs[0]
        if c.finish_reason == "preempted":
            assert c.finish_message
            assert c.token_ids == ref[: len(c.token_ids)]  # what it produced before preemption is exact
        else:
            assert c.token_ids == ref
    llm.llm_engine.scheduler.check_invariants()
    assert llm.llm_engine.scheduler.kv_usage() == 0.0


@pytest.mark.parametrize("zos", [True, False])
def test_forced_preemption_with_recompute_equals_unconstrained(model, reference, zos):
    llm = _llm(model[1], num_kv_blocks=10, stop_preempted_request=False, zero_overhead_scheduling=zos)
    outs = llm.generate(_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert llm.get_stats()["preempted_requests"] == 0  # recompute: nothing finished as preempted
    assert llm.get_stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)
    alone = _llm(model[1]).generate({"prompt_token_ids": PROMPTS[2]}, p, use_tqdm=False)[0]
    batch = _llm(model[1], seed=7).generate(
        _prompts(PROMPTS), [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 2 + [p]
        + [SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone.outputs[0].token_ids
    other = _llm(model[1]).generate({"prompt_token_ids": PROMPTS[2]},
                                    SamplingParams(max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, seed=99,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_unseeded_requests_reproducible_from_engine_seed(model):
    p = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    a = _llm(model[1], seed=3).generate(_prompts(PROMPTS[:2]), p, use_tqdm=False)
    b = _llm(model[1], seed=3).generate(_prompts(PROMPTS[:2]), p, use_tqdm=False)
    c = _llm(model[1], seed=4).generate(_prompts(PROMPTS[:2]), p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_logprobs_and_stop_token_ids(model, reference):
    ref = reference[1]
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    p = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, stop_token_ids=[stop_tok])
    out = _llm(model[1]).generate({"prompt_token_ids": PROMPTS[1]}, p, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == ref[: first + 1]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy: the sampled token is the most likely
        assert len(lp) == 3
        assert all(v.logprob <= 0.0 for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids,
                                                                                        out.logprobs)))


def test_min_tokens_bans_stop_tokens(model, reference):
    ref = reference[0]
    p = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0, stop_token_ids=[ref[0]])
    out = _llm(model[1]).generate({"prompt_token_ids": PROMPTS[0]}, p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and ref[0] not in out.token_ids


def test_cli_runs_with_token_ids_and_reports_summary(model, capsys):
    from deepinfer_npu.run import main

    rc = main(["--model", model[1], "--prompt-token-ids", "1,2,3,4,5", "--max-tokens", "6", "--json",
               "--no-progress", "--backend", "cpu"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines[0]["token_ids"]) == 6
    assert lines[-1]["summary"]["requests"] == 1 and lines[-1]["summary"]["backend"] == "cpu"


def test_cli_errors_are_clear(tmp_path, capsys):
    from deepinfer_npu.run import main

    assert main(["--model", str(tmp_path / "nope"), "--no-progress"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["--backend", "tpu", "--list-ops"]) == 2
    err = capsys.readouterr().err
    assert "tpu" in err and "cpu" in err
    assert main(["--list-ops", "--backend", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu" and "mla_attention" in report["ops"]
