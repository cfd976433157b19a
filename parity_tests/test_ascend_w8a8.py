"""INT8 W8A8 on the Ascend backend under the torch_npu contract emulation: the dense and shared-expert projections
run ``npu_dynamic_quant`` + ``npu_quant_matmul``, the routed experts ``npu_dynamic_quant`` + two int8
``npu_grouped_matmul`` around ``npu_swiglu``, each called as documented, and the greedy tokens equal the CPU
reference's with the same quantised weights (fp32 model, the emulation profile). The strict A2/A3 profile refuses
fp32 activations for the int8 ops and says why. FP8 weights (reference projections on 910-class NPUs) reach the
fused attention through the same cache layout. Nothing here runs on an NPU."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM, SamplingParams
from parity_tests.npu_emulation import CALLS, emulated_npu
from tests.model.tiny_models import make_hf_model, save_hf

PROMPTS = [{"prompt_token_ids": [(7 * i + 3) % 90 + 1 for i in range(17)]},
           {"prompt_token_ids": [(11 * i + 5) % 90 + 1 for i in range(9)]}]


@pytest.fixture(scope="module")
def small_v3(tmp_path_factory):
    model = make_hf_model("v3", seed=5, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True)
    return save_hf(model, str(tmp_path_factory.mktemp("small_v3_w8a8")))


def _generate(model_dir, backend: str, quantization: str = "w8a8"):
    llm = LLM(str(model_dir), backend=backend, dtype="float32", quantization=quantization, block_size=16,
              num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.backend.op_report()


def test_w8a8_tokens_equal_the_cpu_reference_through_the_int8_npu_ops(small_v3):
    cpu, _ = _generate(small_v3, "cpu")
    with emulated_npu():
        ascend, report = _generate(small_v3, "ascend")
        calls = dict(CALLS)
    assert ascend == cpu
    assert calls.get("npu_dynamic_quant", 0) > 0 and calls.get("npu_quant_matmul", 0) > 0, calls
    assert report["w8a8_linear"].startswith("native (torch_npu.npu_dynamic_quant + npu_quant_matmul"), report
    assert report["w8a8_grouped_mlp"].startswith("native (torch_npu.npu_dynamic_quant + npu_grouped_matmul"), report


def test_strict_profile_refuses_fp32_activations_with_the_reason(small_v3, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ASCEND_PROFILE", "a2_a3")
    cpu, _ = _generate(small_v3, "cpu")
    with emulated_npu():
        ascend, report = _generate(small_v3, "ascend")
        calls = dict(CALLS)
    assert ascend == cpu
    assert "npu_quant_matmul" not in calls
    assert report["w8a8_linear"].startswith("fallback (npu_dynamic_quant / npu_quant_matmul take fp16/bf16 here, "
                                            "model runs torch.float32"), report


def test_fp8_weights_reach_the_fused_attention_in_its_cache_layout(small_v3):
    """The quantised MLA prolog (reference projections) writes its latents in the split layout the fused attention
    reads, so FP8 weights under the emulation give the CPU reference's tokens too."""
    cpu, _ = _generate(small_v3, "cpu", "fp8")
    with emulated_npu():
        ascend, report = _generate(small_v3, "ascend", "fp8")
        calls = dict(CALLS)
    assert ascend == cpu
    assert calls.get("npu_fused_infer_attention_score", 0) > 0, calls
