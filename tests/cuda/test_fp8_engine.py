"""The FP8 engine on CUDA against the CPU backend's FP8 engine: weights quantised at load to 128 x 128 e4m3 blocks,
the CUDA engine on bf16 activations through the TileLang FP8 kernels (``fp8_quant`` + ``fp8_gemm`` for the
projections, ``fp8_grouped_gemm`` for the routed experts), the CPU engine on fp32 activations through the reference
ops. Greedy tokens follow the logprobs-close rule (at the first position where they differ, each run's token is in
the other's top-5): the two runs share the quantised weights, not the activation roundings.

Models: the shipped reference model (trained weights; its kv_a projection's 80 outputs are not a multiple of 64, so
that one projection takes the reference op and the report says so) and a model at DeepSeek's MLA dims
(``DEEPSEEK_DIMS``, ``dummy_portable`` weights: the same values on both backends), where every projection and the
experts run on the kernels. Decode steps replay CUDA graphs (the FP8 kernels read nothing on the host).
"""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM, SamplingParams
from tests.reference_assets import needs_reference_model

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
TOKEN_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [400, 17, 33], list(range(100, 160))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
ENGINE = dict(quantization="fp8", max_num_seqs=8, max_model_len=512)


def _generate(prompts, backend: str, **kw):
    dtype = "bfloat16" if backend == "cuda" else "float32"
    if backend == "cuda":  # the op report accumulates over the process (one backend): this engine's calls only
        from deepinfer_npu.hal import get_backend

        get_backend("cuda").kernels.log.clear()
    llm = LLM(backend=backend, dtype=dtype, **ENGINE, **kw)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    report = {}
    if backend == "cuda":
        report = dict(llm.llm_engine.backend.op_report())
        worker = llm.llm_engine.worker
        kernels = llm.llm_engine.backend.kernels
        why = kernels.quantization_capture_refusal("fp8", hidden_size=1, moe_intermediate_size=0)
        assert worker.graphs is not None and worker.graph_steps > 0, (
            f"the FP8 decode steps did not replay graphs: {why}; warm-up: {worker.kernel_warmup}")
    return [o.outputs[0] for o in outs], report


def _check(cpu, cuda, report, assert_logprobs_close, all_native: bool) -> None:
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in cuda)
    assert_logprobs_close(cpu, cuda)
    assert report["fp8_grouped_mlp"].startswith("native (kernels_cuda.fp8_quant"), report["fp8_grouped_mlp"]
    # every route fp8_linear took quantises on the kernel; the GEMM is the tile kernel or, past 64 rows where the
    # device check accepted the key, cuBLASLt (a key it refused says why, inside the tile kernel's entry)
    assert report["fp8_linear"].startswith("native (kernels_cuda.fp8_"), report["fp8_linear"]
    assert "kernels_cuda.fp8_gemm" in report["fp8_linear"], report["fp8_linear"]
    if all_native:
        assert "fallback" not in report["fp8_linear"], report["fp8_linear"]


@needs_reference_model
def test_reference_model_fp8_on_cuda_follows_the_cpu_fp8_engine(assert_logprobs_close):
    cpu, _ = _generate(PROMPTS, "cpu")
    cuda, report = _generate(PROMPTS, "cuda")
    _check(cpu, cuda, report, assert_logprobs_close, all_native=False)


def test_deepseek_dims_fp8_on_cuda_follows_the_cpu_fp8_engine(deepseek_dims_model, assert_logprobs_close):
    path = deepseek_dims_model()
    cpu, _ = _generate(TOKEN_PROMPTS, "cpu", model=path, load_format="dummy_portable")
    cuda, report = _generate(TOKEN_PROMPTS, "cuda", model=path, load_format="dummy_portable")
    _check(cpu, cuda, report, assert_logprobs_close, all_native=True)


def test_deepseek_dims_fp8_one_row_gemms_follow_the_cpu_fp8_engine(deepseek_dims_model, assert_logprobs_close,
                                                                  monkeypatch):
    """``DEEPINFER_FP8_SKINNY=1``: one prompt, so every decode step has one row: the projections and the shared
    experts' MLP run on ``fp8_skinny_gemm`` (the quantisation inside the GEMM), inside the decode graphs."""
    monkeypatch.setenv("DEEPINFER_FP8_SKINNY", "1")
    path = deepseek_dims_model()
    cpu, _ = _generate(TOKEN_PROMPTS[:1], "cpu", model=path, load_format="dummy_portable")
    cuda, report = _generate(TOKEN_PROMPTS[:1], "cuda", model=path, load_format="dummy_portable")
    assert len(cuda[0].token_ids) == PARAMS.max_tokens
    assert_logprobs_close(cpu, cuda)
    for op in ("fp8_linear", "silu_and_mul"):
        assert "kernels_cuda.fp8_skinny_gemm" in report[op], (op, report[op])
