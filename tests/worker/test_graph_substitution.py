"""A decode step whose graph size is not captured yet replays a captured graph at most a quarter larger, until its
own size has been asked for ``DecodeGraphs.CAPTURE_AFTER`` times (worker/decode_graphs.py ``pick``); greedy tokens
of a shrinking batch are those of eager decode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.hal.graph_runner import EagerReplayRunner
from deepinfer_npu.worker.decode_graphs import DecodeGraphs
from tests.reference_assets import needs_reference_model


def _graphs(captured: set[int]) -> DecodeGraphs:
    runner = SimpleNamespace(block_size=16, max_model_len=256, device="cpu")
    g = DecodeGraphs(runner, EagerReplayRunner(), k=0, max_tokens=64)
    assert g.sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    g.graphs.static_out.update({s: None for s in captured})  # what GraphRunner.has reads
    return g


def test_a_captured_own_size_is_replayed():
    g = _graphs({64})
    assert g.pick(57, 4) == 64 and g.substituted == 0


def test_a_larger_graph_within_a_quarter_stands_in_until_the_size_was_asked_for_often_enough():
    g = _graphs({64})
    for i in range(1, DecodeGraphs.CAPTURE_AFTER):
        assert g.pick(52, 4) == 64, i  # 56 not captured; 64 <= 1.25 * 52
    assert g.substituted == DecodeGraphs.CAPTURE_AFTER - 1
    assert g.pick(52, 4) == 56  # asked for CAPTURE_AFTER times: its own graph now (captured by the caller's run)


def test_no_stand_in_past_a_quarter_of_padding():
    g = _graphs({64})
    assert g.pick(50, 4) == 56  # 64 > 1.25 * 50 = 62.5: capture 56
    assert g.pick(30, 4) == 32 and g.substituted == 0


def test_steps_the_graphs_cannot_hold_stay_eager():
    g = _graphs({64})
    assert g.pick(65, 4) is None and g.pick(10, g.width + 1) is None and g.pick(0, 4) is None


@needs_reference_model
def test_shrinking_batch_replays_stand_ins_and_matches_eager(graph_runners):
    """40 requests whose outputs end one a step: at 32 rows (not captured yet) the step replays the graph of 40."""
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 200 for j in range(4 + i % 5)]} for i in range(40)]
    params = [SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True) for i in range(40)]
    kw = dict(block_size=16, num_kv_blocks=256, max_num_seqs=40, zero_overhead_scheduling=False)
    graphed = LLM(enable_graphs=True, graph_capture="lazy", **kw)  # the stand-ins serve lazy capture
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    stats = graphed.llm_engine.get_stats()
    assert stats["graph_substituted_steps"] > 0 and stats["graph_steps"] > 0
    assert 40 in stats["graphs_captured"]
    eager = LLM(enable_graphs=False, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
