"""Decode graphs under expert parallelism on two GPUs (NCCL, one rank each): every rank captures every decode graph
at start-up and replays the one of the step's declared size (the agreed token count rounded up to a graph size),
whatever its own batch; the fixed-capacity all-to-all inside each graph pairs with the other rank's. Tokens equal the
single-process graphed engine's (bf16: padded shapes may pick other GEMM tiles, so as in
tests/cuda/test_decode_graphs_match_eager.py most sequences exactly and a long common prefix on all).

    pytest -q -m gpu tests/distributed/test_ep_decode_graphs_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu import LLM, SamplingParams
from tests.reference_assets import needs_reference_model

pytestmark = [pytest.mark.gpu, needs_reference_model]

ENGINE = dict(backend="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8, enable_graphs=True)


def _requests():
    """One long request alone on rank 0 (its load exceeds the other three's), three short ones on rank 1, which
    then idles (dummy steps) while rank 0 decodes on."""
    long = ("long", {"prompt_token_ids": [(37 * j + 11) % 4000 + 1 for j in range(40)]},
            SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    short = [(f"s{i}", {"prompt_token_ids": [(53 * i + 7 * j) % 4000 + 1 for j in range(5 + i)]},
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for i in range(3)]
    return [long, *short]


def _run(engine) -> dict[str, list[int]]:
    for rid, prompt, params in _requests():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


@pytest.mark.parametrize("method", [None, "mtp"])
def test_two_gpu_ranks_replay_the_agreed_graph(method):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    spec = dict(speculative_method=method, num_speculative_tokens=3) if method else {}
    single = LLM(**ENGINE, **spec)
    one = _run(single.llm_engine)
    del single
    torch.cuda.empty_cache()
    llm = LLM(**ENGINE, **spec, data_parallel_size=2, distributed_timeout_s=300)
    try:
        engine = llm.llm_engine
        two = _run(engine)
        per_rank = engine.get_stats()["per_rank"]
    finally:
        llm.llm_engine.shutdown()
    assert [r["graphs_disabled"] for r in per_rank] == [None, None], per_rank
    steps = [r["graph_steps"] for r in per_rank]
    assert steps[0] > 0 and steps[0] == steps[1], steps
    assert set(two) == set(one)
    for rid in one:
        common = next((i for i, (x, y) in enumerate(zip(one[rid], two[rid])) if x != y), len(one[rid]))
        assert common >= 8, (rid, common, one[rid], two[rid])
    assert sum(one[rid] == two[rid] for rid in one) >= len(one) - 1, (one, two)
