"""EPLB through the whole engine on 2 spawned gloo ranks, routing skewed towards a few experts: fp32 greedy tokens
equal the run without EPLB across re-plans in the middle of the generation, moe_lb falls, the pause is reported,
and no KV block or state slot stays taken."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import EngineConfig, EPLBConfig

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(", "# sort a list\n",
           "while True:\n"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
COMMON = dict(max_num_seqs=8, data_parallel_size=2, distributed_timeout_s=120, dtype="float32",
              moe_routing_skew=1.0)


def _generate(**options):
    llm = LLM(**COMMON, **options)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return tokens, llm.get_stats()
    finally:
        llm.llm_engine.shutdown()


def test_replans_mid_generation_keep_tokens_and_even_the_load():
    want, without = _generate()
    assert without["moe_lb"] > 1.6  # ep = 2: at most 2.0, every routed token on one rank
    assert "eplb" not in without
    got, stats = _generate(enable_eplb=True, eplb_config=EPLBConfig(redundant_experts_per_rank=1, window_size=4,
                                                                    rebalance_interval=6))
    assert got == want
    eplb = stats["eplb"]
    assert eplb["physical_experts"] == 10 and eplb["redundant_experts"] == 2  # 8 experts + 1 per rank
    assert eplb["replans"] >= 2 and eplb["steps"] > 6 * eplb["replans"] - 1
    assert eplb["pause_ms_max"] > 0 and len(eplb["history"]) == eplb["replans"]
    assert eplb["history"][0]["window_moe_lb"] > eplb["history"][-1]["planned_moe_lb"]
    assert stats["moe_lb"] < without["moe_lb"] - 0.3
    for rank in stats["per_rank"]:  # nothing leaked on any rank
        assert rank["num_running"] == 0 and rank["num_waiting"] == 0
        assert rank["kv_usage"] == 0.0 and rank["state_slot_usage"] == 0.0


def test_replans_move_quantised_experts_with_their_scales():
    """FP8 experts: a re-plan moves each expert's e4m3 rows and its block scales together, so the tokens stay those
    of the run without EPLB."""
    want, _ = _generate(quantization="fp8")
    got, stats = _generate(quantization="fp8", enable_eplb=True,
                           eplb_config=EPLBConfig(redundant_experts_per_rank=1, window_size=4, rebalance_interval=6))
    assert stats["eplb"]["replans"] >= 2
    assert got == want


@pytest.mark.parametrize("options,match", [
    (dict(enable_eplb=True), "needs expert parallelism"),
    (dict(enable_eplb=True, data_parallel_size=2, enable_expert_parallel=False), "needs expert parallelism"),
    (dict(eplb_config=EPLBConfig()), "enable_eplb is False"),
    (dict(enable_eplb=True, data_parallel_size=2, eplb_config={"window_size": 3}), "EPLBConfig"),
    (dict(moe_routing_skew=1.0), "expert-parallel MoE path only"),
    (dict(moe_routing_skew=-1.0, data_parallel_size=2), r"\[0, 1000\)"),
])
def test_bad_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=0), "window_size must be an integer >= 1"),
    (dict(redundant_experts_per_rank=-1), "redundant_experts_per_rank"),
    (dict(window_size=200, rebalance_interval=100), "exceeds rebalance_interval"),
])
def test_eplb_config_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EPLBConfig(**kwargs)


def test_presets_are_the_published_settings():
    assert EPLBConfig() == EPLBConfig.decode() == EPLBConfig(1, 1000, 10000)
    assert EPLBConfig.prefill() == EPLBConfig(4, 100, 1000)
    assert EngineConfig(data_parallel_size=2, enable_eplb=True).eplb == EPLBConfig.decode()


def test_cli_flags_build_the_config():
    from deepinfer_npu.engine_args import build_parser, engine_kwargs

    def kwargs(*argv):
        return engine_kwargs(build_parser().parse_args(list(argv)))

    assert kwargs()["eplb_config"] is None and kwargs()["enable_eplb"] is False
    assert kwargs("--enable-eplb")["eplb_config"] == EPLBConfig.decode()
    got = kwargs("--enable-eplb", "--eplb-preset", "prefill", "--eplb-window-size", "50")
    assert got["eplb_config"] == EPLBConfig(4, 50, 1000)
    with pytest.raises(ValueError, match="enable_eplb is False"):  # a tuning flag without --enable-eplb
        EngineConfig(**kwargs("--eplb-window-size", "5", "--data-parallel-size", "2"))
