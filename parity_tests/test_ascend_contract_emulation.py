"""Contract emulation of the Ascend backend — it proves our use of the documented torch_npu contracts, not the
hardware.

A fake ``torch_npu`` (npu_emulation/: CPU implementations of exactly the fused ops backends/ascend calls, each
written from its documentation and checking argument order, layouts, dtypes and returned tuples) is injected,
and the whole engine runs through ``LLM(model, backend="ascend")`` on the CPU. Greedy tokens must equal the
CPU
backend's (fp32, zero-overhead scheduling on, with and without MTP speculative decoding on the reference
model). Nothing here says anything about NPU kernels, bf16 numerics on the chip, or speed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from npu_emulation import CALLS, emulated_npu

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import REFERENCE_MODEL_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from helpers import make_hf_model, save_hf  # noqa: E402

FUSED = {
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_interleave_rope",
    "npu_fused_infer_attention_score",
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_moe_token_unpermute",
}
ID_PROMPTS = [
    list(range(1, 6)),
    [(7 * i + 3) % 90 + 1 for i in range(17)],
    [(11 * i + 5) % 90 + 1 for i in range(33)],
]


def _generate(model_dir, backend: str, prompts, max_tokens: int, **kw) -> list[list[int]]:
    llm = LLM(
        str(model_dir),
        backend=backend,
        dtype="float32",
        block_size=16,
        num_kv_blocks=96,
        zero_overhead_scheduling=True,
        **kw,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def small_v3(tmp_path_factory):
    """A random DeepSeek-V3 (sigmoid noaux_tc, 2 groups, q_lora) saved by transformers."""
    model = make_hf_model("v3", seed=3, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True)
    return save_hf(model, str(tmp_path_factory.mktemp("small_v3")))


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    if not (REFERENCE_MODEL_DIR / "model.safetensors").exists():
        pytest.skip(
            f"the reference model is not shipped yet ({REFERENCE_MODEL_DIR} has no model.safetensors)"
        )
    # A private copy: the reference model may be re-trained (rewritten) while the suite runs.
    dst = tmp_path_factory.mktemp("reference") / "model"
    shutil.copytree(REFERENCE_MODEL_DIR, dst)
    return dst


def test_small_v3_tokens_equal_cpu_and_fused_ops_are_used(small_v3):
    cpu = _generate(small_v3, "cpu", [{"prompt_token_ids": p} for p in ID_PROMPTS], 12)
    with emulated_npu():
        ascend = _generate(small_v3, "ascend", [{"prompt_token_ids": p} for p in ID_PROMPTS], 12)
        calls = dict(CALLS)
    assert ascend == cpu
    assert FUSED <= set(calls), f"fused ops never called: {FUSED - set(calls)}"


def test_reference_model_with_mtp_tokens_equal_cpu(reference_model):
    prompts = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"]
    for spec in (None, "mtp"):
        kw = {"speculative_method": spec, "num_speculative_tokens": 3} if spec else {}
        cpu = _generate(reference_model, "cpu", prompts, 16, **kw)
        with emulated_npu():
            ascend = _generate(reference_model, "ascend", prompts, 16, **kw)
            assert CALLS["npu_fused_infer_attention_score"] > 0
        assert ascend == cpu, f"speculative_method={spec}"


def test_strict_a2_a3_profile_falls_back_with_reasons_and_still_matches(small_v3, monkeypatch):
    """The documented A2/A3 limits (fp16/bf16 only, 512/64 MLA dims, 256 experts) reject this small fp32
    model:
    every limited op must fall back, say why, and the tokens stay equal."""
    monkeypatch.setenv("DEEPINFER_ASCEND_PROFILE", "a2_a3")
    cpu = _generate(small_v3, "cpu", [{"prompt_token_ids": ID_PROMPTS[1]}], 6)
    with emulated_npu():
        llm = LLM(small_v3, backend="ascend", dtype="float32", block_size=16, num_kv_blocks=96)
        out = llm.generate(
            [{"prompt_token_ids": ID_PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
        )
        report = llm.llm_engine.backend.op_report()
        calls = dict(CALLS)
    assert [o.outputs[0].token_ids for o in out] == cpu
    assert report["profile"] == "a2_a3" and "not yet run on an NPU" in report["note"]
    for op in ("rope", "mla_attention", "moe_gating_topk", "grouped_mlp"):
        assert report[op].startswith("fallback ("), (op, report[op])
    assert "npu_fused_infer_attention_score" not in calls and "npu_moe_gating_top_k" not in calls
    assert report["rms_norm"].startswith("native")


def test_op_report_plan_for_deepseek_v3_dims_on_a2_a3(monkeypatch):
    """Full DeepSeek-V3 shapes in bf16 fit every documented limit the backend checks."""
    from deepinfer_npu.backends.ascend import capabilities as caps

    from deepinfer_npu.model_executor import DeepseekModelConfig

    cfg = DeepseekModelConfig.from_dict(
        {
            "model_type": "deepseek_v3",
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "first_k_dense_replace": 3,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "max_position_embeddings": 4096,
        }
    )
    plan = caps.plan_for_config(caps.A2_A3, cfg, torch.bfloat16, 128)
    assert all(d.native for d in plan.values()), {k: d.report() for k, d in plan.items()}
    fp32 = caps.plan_for_config(caps.A2_A3, cfg, torch.float32, 128)
    assert not fp32["mla_attention"].native and "dtype" in fp32["mla_attention"].detail


def test_fia_split_into_16_query_pieces():
    from deepinfer_npu.backends.ascend.ops_mla import split_requests

    ends, kv, src, counts = split_requests([33, 1, 0, 16], [40, 9, 5, 16], 16)
    assert counts == [16, 16, 1, 1, 16] and src == [0, 0, 0, 1, 3]
    assert ends == [16, 32, 33, 34, 50] and kv == [23, 39, 40, 9, 16]


def test_backend_hooks_under_emulation():
    from deepinfer_npu.hal import get_backend
    from deepinfer_npu.hal.sync_guard import SyncForbiddenError

    with emulated_npu() as npu:
        be = get_backend("ascend")
        assert be.dist_backend == "hccl" and be.device == torch.device("cpu")
        free, total = be.memory_info()
        assert 0 < free <= total
        ev = be.create_event()
        with be.forbid_sync():
            assert npu.npu_namespace.sync_debug_mode == "error"
            ev.record()
            with pytest.raises(SyncForbiddenError):
                ev.synchronize()
        assert npu.npu_namespace.sync_debug_mode == 0
        runner = be.graph_runner()
        x = torch.zeros(4)
        out = runner.capture(4, lambda x: x * 2 + 1, {"x": x})
        assert torch.equal(
            runner.replay(4, {"x": torch.tensor([1.0, 2.0])}), torch.tensor([3.0, 5.0, 1.0, 1.0])
        )
        assert out.data_ptr() == runner.static_out[4].data_ptr() and runner.pick(3) == 4
