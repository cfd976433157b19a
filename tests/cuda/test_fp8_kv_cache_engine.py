"""``kv_cache_dtype="fp8"`` on CUDA against the CPU backend's FP8 cache: both write FlashMLA's packed rows (512 e4m3
latent values, their fp32 scales, 64 bf16 RoPE values) and read them back dequantised; the CUDA engine runs bf16
activations (``kernels_cuda.mla_decode``'s FP8 variant for decode and prefill at DeepSeek's MLA dims, the dense
composition elsewhere), the CPU engine fp32. Greedy tokens follow the logprobs-close rule; decode steps replay
CUDA graphs (the packing write and the FP8 kernel read nothing on the host)."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM, SamplingParams
from tests.reference_assets import needs_reference_model

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n"]
TOKEN_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [400, 17, 33], list(range(100, 190))]  # the last one: > 16 tokens
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
ENGINE = dict(kv_cache_dtype="fp8", max_num_seqs=8, max_model_len=512)


def _generate(prompts, backend: str, **kw):
    if backend == "cuda":  # the op report accumulates over the process (one backend): this engine's calls only
        from deepinfer_npu.hal import get_backend

        get_backend("cuda").kernels.log.clear()
    llm = LLM(backend=backend, dtype="bfloat16" if backend == "cuda" else "float32", **ENGINE, **kw)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    report = {}
    if backend == "cuda":
        report = dict(llm.llm_engine.backend.op_report())
        worker = llm.llm_engine.worker
        assert worker.runner.kv_caches[0].dtype.itemsize == 1, "the caches are not packed FP8 rows"
        assert worker.graphs is not None and worker.graph_steps > 0, "the decode steps did not replay graphs"
    return [o.outputs[0] for o in outs], report


def test_deepseek_dims_fp8_cache_follows_the_cpu_engine(deepseek_dims_model, assert_logprobs_close):
    path = deepseek_dims_model()
    cpu, _ = _generate(TOKEN_PROMPTS, "cpu", model=path, load_format="dummy_portable")
    cuda, report = _generate(TOKEN_PROMPTS, "cuda", model=path, load_format="dummy_portable")
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in cuda)
    assert_logprobs_close(cpu, cuda)
    assert "kernels_cuda.mla_decode (bf16, packed FP8 cache" in report["mla_attention"], report["mla_attention"]
    assert "mla_prefill (bf16, packed FP8 cache" in report["mla_attention"], report["mla_attention"]
    assert "packed FP8 cache" in report["mla_prolog"], report["mla_prolog"]
    # the prolog's tail on kernels: mla_rope_cache's rows, fp8_quant's codes (not the composed torch tail)
    assert "mla_rope_cache into scratch bf16 rows + kernels_cuda.fp8_quant" in report["mla_prolog"]


@needs_reference_model
def test_reference_model_fp8_cache_follows_the_cpu_engine(assert_logprobs_close):
    """The reference model's latent dims (not the kernel's): the dense composition over the unpacked rows."""
    cpu, _ = _generate(PROMPTS, "cpu")
    cuda, report = _generate(PROMPTS, "cuda")
    assert_logprobs_close(cpu, cuda)
    assert "composed torch dense decode" in report["mla_attention"], report["mla_attention"]
