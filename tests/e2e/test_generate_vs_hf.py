"""End-to-end greedy generation through the whole engine (C++ scheduler, worker, CPU backend) against
transformers' DeepseekV2/V3ForCausalLM, fp32: the 24 generated tokens must be identical."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM, SamplingParams

from .conftest import CASES, PROMPTS, hf_greedy

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(hf_models):
    return {name: [hf_greedy(m, p, MAX_TOKENS) for p in PROMPTS] for name, (m, _) in hf_models.items()}


def _generate(model_dir, **kwargs):
    llm = LLM(model_dir, block_size=16, max_model_len=128, dtype="float32", **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("zos", [True, False], ids=["zos", "no_zos"])
def test_greedy_matches_transformers(hf_models, references, case, zos):
    llm, tokens = _generate(hf_models[case][1], zero_overhead_scheduling=zos)
    assert tokens == references[case]
    stats = llm.get_stats()
    assert stats["generation_tokens"] == MAX_TOKENS * len(PROMPTS)
    # Everything freed once all requests finished.
    assert stats["kv_usage"] == 0.0
    llm.llm_engine.scheduler.check_invariants()


@pytest.mark.parametrize("case", ["v3_grouped", "v2_group_limited"])
def test_chunked_prefill_matches_transformers(hf_models, references, case):
    # A 12-token budget splits the 17- and 33-token prompts into chunks; each chunked request runs alone.
    llm, tokens = _generate(hf_models[case][1], max_num_batched_tokens=12)
    assert tokens == references[case]
    assert llm.get_stats()["prefill_steps"] >= 1 + 2 + 3


def test_small_batch_limit_still_exact(hf_models, references):
    # max_num_seqs=2 forces requests to wait for slots and join the running batch later.
    llm, tokens = _generate(hf_models["v3_grouped"][1], max_num_seqs=2)
    assert tokens == references["v3_grouped"]
