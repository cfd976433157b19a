"""The engine calls ``KernelSet.warmup`` once at start-up, after the model is loaded and before any graph capture,
with the shapes of its steps (``worker/kernel_warmup.py``); ``EngineConfig.kernel_warmup`` / ``--no-kernel-warmup``
turn it off. On the CPU reference backend the hook is the base class's no-op."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.hal.graph_runner import EagerReplayRunner
from deepinfer_npu.hal.kernel_set import KernelSet
from deepinfer_npu.hal.registry import get_backend
from deepinfer_npu.hal.types import KernelWarmupPlan
from deepinfer_npu.engine_args import build_parser
from tests.reference_assets import needs_reference_model

SMALL_KV = dict(block_size=16, num_kv_blocks=64)


@pytest.fixture
def warmups(monkeypatch):
    """Spy on the CPU kernel set's ``warmup`` (the base class's no-op): -> [(plan, captures made before), ...]."""
    calls: list[tuple[KernelWarmupPlan, int]] = []
    runners: list[EagerReplayRunner] = []
    cls = type(get_backend("cpu").kernels)
    assert cls.warmup is KernelSet.warmup  # the CPU backend keeps the default

    def spy(self, plan):
        calls.append((plan, sum(r.num_captures for r in runners)))
        return KernelSet.warmup(self, plan)

    def factory(self):
        runners.append(EagerReplayRunner())
        return runners[-1]

    monkeypatch.setattr(cls, "warmup", spy)
    monkeypatch.setattr(type(get_backend("cpu")), "graph_runner", factory)
    return calls, runners


@needs_reference_model
def test_cpu_engine_calls_the_hook_once(warmups):
    calls, _ = warmups
    llm = LLM(max_num_seqs=4, **SMALL_KV)
    assert len(calls) == 1
    plan, _ = calls[0]
    engine = llm.llm_engine
    mc = engine.model_config
    assert isinstance(plan, KernelWarmupPlan)
    assert (plan.vocab_size, plan.num_heads, plan.kv_lora_rank) == (mc.vocab_size, mc.num_attention_heads,
                                                                      mc.kv_lora_rank)
    assert plan.dtype == engine.runner.dtype and plan.max_num_seqs == 4 and plan.block_size == 16
    assert plan.num_speculative_tokens == 0 and plan.decode_graph_sizes == () and not plan.varlen
    assert engine.worker.kernel_warmup == "nothing to warm up"


@needs_reference_model
def test_hook_runs_before_startup_capture_with_the_graph_sizes(warmups):
    calls, runners = warmups
    llm = LLM(speculative_method="mtp", num_speculative_tokens=2, max_num_seqs=4, enable_graphs=True,
              graph_capture="startup", **SMALL_KV)
    graphs = llm.llm_engine.worker.graphs
    (plan, captured_before), = calls
    assert captured_before == 0 and sum(r.num_captures for r in runners) > 0  # warmed up, then captured
    assert plan.decode_graph_sizes == tuple(graphs.sizes) and plan.decode_graph_width == graphs.width
    assert plan.num_speculative_tokens == 2 and plan.speculative_method == "mtp" and plan.varlen


@needs_reference_model
def test_kernel_warmup_off(warmups):
    calls, _ = warmups
    llm = LLM(max_num_seqs=4, kernel_warmup=False, **SMALL_KV)
    assert calls == [] and llm.llm_engine.worker.kernel_warmup is None


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_engine_config_rejects_non_bool_kernel_warmup(value):
    with pytest.raises(ValueError, match="kernel_warmup"):
        EngineConfig(kernel_warmup=value)


def test_cli_flag():
    assert build_parser().parse_args([]).kernel_warmup is True
    assert build_parser().parse_args(["--no-kernel-warmup"]).kernel_warmup is False


@needs_reference_model
def test_a_failing_plan_skips_the_warmup_and_the_engine_serves(warmups, monkeypatch):
    """An unusual model layout that the plan builder cannot read must not stop start-up."""
    from deepinfer_npu.worker import worker as worker_mod

    def broken(*a, **kw):
        raise AttributeError("model has no layers attribute")

    monkeypatch.setattr(worker_mod, "build_kernel_warmup_plan", broken)
    calls, _ = warmups
    llm = LLM(max_num_seqs=4, **SMALL_KV)
    assert calls == []
    assert llm.llm_engine.worker.kernel_warmup.startswith("skipped: building the plan failed: AttributeError")
    from deepinfer_npu import SamplingParams

    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture
def early(monkeypatch):
    """Spy on ``KernelSet.start_early_warmup`` and the weight load: -> the events in order, ("early", plan) and
    ("load", None)."""
    from deepinfer_npu.worker import model_runner

    events: list[tuple[str, KernelWarmupPlan | None]] = []
    cls = type(get_backend("cpu").kernels)
    assert cls.start_early_warmup is KernelSet.start_early_warmup  # the default: nothing built ahead

    def spy(self, plan):
        events.append(("early", plan))
        return KernelSet.start_early_warmup(self, plan)

    real_load = model_runner.load_weights

    def load(*a, **kw):
        events.append(("load", None))
        return real_load(*a, **kw)

    monkeypatch.setattr(cls, "start_early_warmup", spy)
    monkeypatch.setattr(model_runner, "load_weights", load)
    return events


@needs_reference_model
@pytest.mark.parametrize("spec", [{}, dict(speculative_method="mtp", num_speculative_tokens=2, enable_graphs=True,
                                           graph_capture="startup")], ids=["plain", "mtp-graphs"])
def test_kernel_builds_start_before_the_weights_load_with_the_warmups_plan(warmups, early, spec):
    """The early builds (``start_early_warmup``) get the plan the warm-up gets later, from the model as built,
    before its weights are loaded: a cold start then overlaps the load with the kernel builds."""
    calls, _ = warmups
    LLM(max_num_seqs=4, **spec, **SMALL_KV)
    assert [name for name, _ in early] == ["early", "load"]
    (plan, _), = calls
    assert early[0][1] == plan


@needs_reference_model
def test_no_early_builds_without_the_warmup(warmups, early):
    LLM(max_num_seqs=4, kernel_warmup=False, **SMALL_KV)
    assert [name for name, _ in early] == ["load"]
