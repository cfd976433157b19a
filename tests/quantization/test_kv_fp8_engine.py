"""``kv_cache_dtype="fp8"`` through the engine on the reference model (fp32): the caches hold packed FP8 rows, the KV
budget holds as many more blocks as the rows are smaller, the held-out loss (prompt logprobs: the prefill reads the
latents back from the cache) stays within 1 % of the full-precision cache, greedy outputs are logprobs-close, MTP
acceptance and forks keep working, and a backend without an FP8 attention path refuses at start-up, naming why."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.model_executor.quantization.kv_fp8 import fp8_latent_row_bytes
from tests.reference_assets import needs_reference_model

pytestmark = needs_reference_model

HELD_OUT = ["def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
            "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n",
            "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n"
            "        self.counts[key] = self.counts.get(key, 0) + 1\n"]
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
BUDGET = 8 * 2**20


def _engine(kv: str, **kw) -> LLM:
    return LLM(dtype="float32", kv_cache_dtype=kv, max_num_seqs=8, kv_cache_memory_bytes=BUDGET, **kw)


def _held_out_nll(llm: LLM) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    total, count = 0.0, 0
    for out in llm.generate(HELD_OUT, params, use_tqdm=False):
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            total -= entry[token].logprob
            count += 1
    return total / count


@pytest.fixture(scope="module")
def engines():
    return _engine("auto"), _engine("fp8")


def test_packed_rows_and_capacity(engines):
    plain, fp8 = (e.llm_engine.runner for e in engines)
    cfg = fp8.model_config
    width = fp8_latent_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    assert all(c.dtype == torch.uint8 and c.shape[-1] == width for c in fp8.kv_caches)
    assert plain.kv_caches[0].dtype == torch.float32
    ratio = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 / width  # bytes of an fp32 row / a packed row
    assert fp8.bytes_per_block() * ratio == pytest.approx(plain.bytes_per_block())
    want = min(fp8.config.max_num_seqs * math.ceil(fp8.max_model_len / fp8.block_size) + 1,
               BUDGET // fp8.bytes_per_block())
    assert fp8.num_kv_blocks == want and fp8.num_kv_blocks > plain.num_kv_blocks
    assert fp8.kv_cache_report().startswith(f"KV cache fp8: {width} bytes a token and layer instead of "
                                            f"{(cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4} (float32)")
    assert plain.kv_cache_report() is None


def test_held_out_loss_within_one_percent(engines):
    plain, fp8 = (_held_out_nll(e) for e in engines)
    assert abs(fp8 - plain) / plain < 0.01, (plain, fp8)


def test_greedy_outputs_are_logprobs_close_and_forks_share_packed_blocks(engines):
    plain, fp8 = engines
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5, n=2)
    a = plain.generate(PROMPTS, params, use_tqdm=False)
    b = fp8.generate(PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == x.outputs[1].token_ids and y.outputs[0].token_ids == y.outputs[1].token_ids
        tx, ty = list(x.outputs[0].token_ids), list(y.outputs[0].token_ids)
        first = next((i for i, (p, q) in enumerate(zip(tx, ty)) if p != q), None)
        if first is not None:  # FP8 rounding may flip a near tie; each run's token is in the other's top-5
            assert ty[first] in x.outputs[0].logprobs[first] and tx[first] in y.outputs[0].logprobs[first]
    assert fp8.llm_engine.scheduler.kv_block_manager.usage() == 0.0


def test_mtp_drafts_over_the_packed_cache():
    llm = _engine("fp8", speculative_method="mtp", num_speculative_tokens=3)
    drafter = llm.llm_engine.worker.drafter
    assert all(c.dtype == torch.uint8 for c in drafter.kv_caches)
    llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.get_stats()["mean_accepted_length"] > 1.5


def test_a_backend_without_an_fp8_attention_path_refuses():
    from parity_tests.npu_emulation import emulated_npu

    with emulated_npu(), pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is not supported on the ascend "
                                                         r"backend: FP8 does not run on Atlas A2/A3"):
        LLM(backend="ascend", dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be 'auto' .* or 'fp8' .*got 'int8'"):
        LLM(kv_cache_dtype="int8")
