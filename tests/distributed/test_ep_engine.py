"""Expert parallelism through the whole engine: ranks in spawned processes (gloo), routed experts sharded over
them, steps in lockstep. fp32 greedy tokens must equal the single-process engine's, on the reference model (ZOS
on and off, MTP, DFlash, chunked prefill, preemption with recompute, an abort) and on random DeepSeek-V2 and V3
checkpoints (grouped routing, shared experts, a dense first layer) at 2 and 4 ranks."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM, SamplingParams
from tests.distributed.random_checkpoints import save_random_checkpoint

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(", "# sort a list\n"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        if hasattr(llm.llm_engine, "shutdown"):
            llm.llm_engine.shutdown()


# ZOS on with the default options: test_experts_are_split_and_an_abort_leaves_the_others
@pytest.mark.parametrize("options", [
    {"zero_overhead_scheduling": False},
    {"speculative_method": "mtp", "num_speculative_tokens": 3},
    {"speculative_method": "dflash"},
    # chunked prefill, and preemption with recompute
    {"max_num_batched_tokens": 8, "num_kv_blocks": 8, "block_size": 4, "stop_preempted_request": False},
], ids=["no-zos", "mtp", "dflash", "chunked-preempt"])
def test_reference_model_two_ranks_equal_one(options):
    single = LLM(max_num_seqs=8, **options)
    one = _tokens(single, PROMPTS)
    if "num_kv_blocks" in options:
        # the KV pool is too small for the batch: requests are preempted and recomputed. (On two ranks whether a
        # rank preempts depends on how the requests' steps interleave, i.e. on timing: only the tokens are checked.)
        assert single.get_stats()["preemptions"] > 0
    two = LLM(max_num_seqs=8, data_parallel_size=2, distributed_timeout_s=120, **options)
    info = two.llm_engine.rank_info
    assert info[0]["expert_weight_bytes"] > 0
    assert info[0]["expert_weight_bytes"] == info[1]["expert_weight_bytes"]
    try:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)] == one
    finally:
        two.llm_engine.shutdown()


@pytest.mark.parametrize("quantization", ["fp8", "w8a8"])
def test_quantized_experts_two_ranks_equal_one(quantization):
    """Each rank holds its experts quantised (weights and scales); the routed rows meet the quantised grouped MLP
    on the rank that owns them: the same tokens as one process, half the expert bytes a rank."""
    single = LLM(max_num_seqs=8, quantization=quantization)
    experts = sum(p.numel() * p.element_size() for n, p in single.llm_engine.runner.model.named_parameters()
                  if ".experts." in n)
    one = _tokens(single, PROMPTS)
    two = LLM(max_num_seqs=8, data_parallel_size=2, distributed_timeout_s=120, quantization=quantization)
    try:
        assert [r["expert_weight_bytes"] for r in two.llm_engine.rank_info] == [experts // 2] * 2
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)] == one
    finally:
        two.llm_engine.shutdown()


def test_experts_are_split_and_an_abort_leaves_the_others():
    full = LLM(max_num_seqs=8)
    per_rank = full.llm_engine.runner.model
    full_experts = sum(p.numel() * p.element_size() for n, p in per_rank.named_parameters() if ".experts." in n)
    want = _tokens(full, PROMPTS)
    llm = LLM(max_num_seqs=8, data_parallel_size=2, distributed_timeout_s=120)
    engine = llm.llm_engine
    try:
        assert [r["expert_weight_bytes"] for r in engine.rank_info] == [full_experts // 2] * 2
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        engine.add_request("long", "import sys\n", SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        engine.abort_request("long")
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        assert done["long"].finish_reason == "abort"
        assert [done[f"r{i}"].token_ids for i in range(len(PROMPTS))] == want
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind,world", [("v2", 2), ("v3", 4)])
def test_random_checkpoints_equal_one_rank(kind, world, tmp_path):
    model = save_random_checkpoint(kind, tmp_path / kind)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 96 for j in range(3 + i)]} for i in range(6)]
    one = _tokens(LLM(model, max_num_seqs=8), prompts)
    many = _tokens(LLM(model, max_num_seqs=8, data_parallel_size=world, distributed_timeout_s=120), prompts)
    assert many == one
