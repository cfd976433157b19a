"""benchmarks/bench_kernel_builds.py: the plan it builds without a GPU is the worker's for the engine's settings, its
job list is the warm-up's, and its replay of the warm-up's claim queue gives the right makespan."""

import pytest

from benchmarks import bench_kernel_builds as bench
from tests.cuda.conftest import _v2_lite_plan as v2_lite_plan

pytestmark = pytest.mark.tilelang


def test_claim_queue_replay():
    assert bench.schedule([5.0, 1.0, 1.0, 1.0], 2) == (5.0, 0)  # one slow job: the others share the second worker
    assert bench.schedule([1.0, 1.0, 1.0, 5.0], 2) == (6.0, 3)  # the slow job last: it starts after the first two
    assert bench.schedule([2.0, 2.0, 2.0], 1) == (6.0, 2)
    assert bench.schedule([3.0, 1.0], 8) == (3.0, 0)


def test_v2_lite_plan_is_the_engines():
    """The model's modules built on the meta device give the dims the engine's worker reads from the loaded model;
    the decode graphs and step size are the CUDA engine's defaults."""
    plan = bench.warmup_plan("v2-lite", max_num_seqs=256, max_model_len=4096, max_num_batched_tokens=None,
                             block_size=64, graphs=True)
    hand = v2_lite_plan(max_num_seqs=256)  # tests/cuda/conftest.py, written from the model card
    for field in ("vocab_size", "hidden_size", "num_heads", "kv_lora_rank", "q_lora_rank", "mlp_intermediate_sizes",
                  "moe_gating", "moe_intermediate_size", "softmax_scale", "decode_graph_width"):
        assert getattr(plan, field) == getattr(hand, field), field
    assert plan.max_num_batched_tokens == 16384  # the CUDA backend's default step
    assert plan.decode_graph_sizes[-1] == 256 and plan.decode_graph_sizes[:4] == (1, 2, 4, 8)
    assert (2048, bench.torch.float32) in plan.linear_weights  # the router's fp32 weight


def test_job_list_is_the_warm_ups():
    """The warm-up's queue: every reachable configuration once, the longest expected builds first."""
    from deepinfer_npu.backends.cuda.warmup import expected_build_s, warmup_job_order

    plan = bench.warmup_plan("v2-lite", max_num_seqs=64, max_model_len=4096, max_num_batched_tokens=4096,
                             block_size=64, graphs=True)
    configs = bench.reachable(plan, 132, sm90=False)
    jobs = warmup_job_order(configs)
    assert sorted(map(repr, jobs)) == sorted(repr((n, c)) for n, cfgs in configs.items() for c in cfgs)
    costs = [expected_build_s(*job) for job in jobs]
    assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1]
    assert jobs[0][0] == "mla_decode" and {name for name, _cfg in jobs} >= {"rms_norm", "moe_routing", "moe_gemm"}
    assert jobs[-1] == ("moe_gemm", ("expert_scan", (64,)))  # compiles at its first launch: nothing to build
