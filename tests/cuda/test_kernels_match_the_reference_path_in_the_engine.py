"""Engine-level check of the TileLang kernels for verification, ZOS fixups, decode inputs, routing and prefill
attention (kernels_cuda.spec_verify, zos_fixup, decode_inputs, moe_routing.route and mla_decode.mla_prefill): the
reference model's tokens with the kernels equal those of the reference path (the kernels left out of the kernel
set's selection, ``CudaKernelSet.SKIP``) and the op report names the kernels. W_UK of one token
(kernels_cuda.mla_absorb) and the warp-specialized MLA decode have tests of their own at DeepSeek dims (their
rounding is not that of the path they replace, so the tokens follow the logprobs-close rule); the other tests
leave them out of both runs.

- MTP speculation (3 drafts), ZOS on, greedy: spec_verify's greedy kernels and zos_fixup serve every decode step
  (prefill sampling is greedy too); with fixed draft counts the tokens must be equal, with varlen verification (the
  device re-split of drafts, timing-driven scheduling) close by the graph tests' rule.
- no speculation, temperature 0.8 with seeds: every step samples through spec_verify's temperature path (one token
  a row, hash-RNG Gumbel noise), which must draw exactly the reference's tokens.
Where the two runs execute identical model forwards (same shapes, same kernels) equal tokens are required.
Skipped without CUDA, tilelang or the reference model.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.config import REFERENCE_MODEL_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang]
needs_reference = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "config.json").exists(),
                                     reason="the reference model is not installed")

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
           "class Stack:\n    def __init__(self):\n", "    for i in range(len(items)):\n",
           "# Copyright 2001 Python Software Foundation\n"]


# the kernels whose run must give the reference path's tokens exactly
REPLACEABLE = {"spec_verify", "zos_fixup", "mla_prefill", "decode_inputs", "moe_route"}
# left out of both runs of the equal-token tests: not bit-identical to the path they replace (own tests below)
# (mla_prefill_mha: prefill on decompressed keys, which takes prefill steps from mla_prefill; its own tests in
# tests/cuda/test_mla_prefill_mha.py)
NOT_BIT_IDENTICAL = {"mla_absorb", "mla_decode_ws", "mla_prefill_mha"}


def _use_kernels(monkeypatch, enabled: bool, also_skipped: set[str] = NOT_BIT_IDENTICAL) -> None:
    """enabled: every kernel but ``also_skipped``; else the REPLACEABLE kernels and ``also_skipped`` left out of the
    selection, i.e. the reference path."""
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    skip = set(also_skipped) if enabled else REPLACEABLE | set(also_skipped)
    monkeypatch.setattr(CudaKernelSet, "SKIP", frozenset(skip))


def _run(monkeypatch, enabled: bool, params, **kw):
    from deepinfer_npu import LLM

    _use_kernels(monkeypatch, enabled)
    llm = LLM(backend="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8, graph_capture="lazy", **kw)
    _forget_paths(llm)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs], dict(llm.llm_engine.backend.op_report())


def _forget_paths(llm) -> None:
    """The op report accumulates over the process (one backend): keep only this run's generate calls. The engines
    here capture their decode graphs lazily (``graph_capture="lazy"``): graphs captured at start-up would record the
    decode paths before this clears them, and replays record nothing."""
    llm.llm_engine.backend.kernels.log.clear()


@needs_reference
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed-drafts", "varlen-resplit"])
def test_mtp_zos_greedy_tokens_equal_the_reference_path(monkeypatch, varlen):
    """Fixed draft counts: the schedule depends on accepted counts only, so both runs execute the same forwards and
    the tokens must be equal. Varlen: the scheduler's draft budget also follows measured step and sampling times
    (which the kernels change), so the verified shapes may differ between the runs; bf16 numerics then allow the
    rule of tests/cuda/test_cuda_graphs.py (all but one sequence equal, every common prefix >= 8 tokens)."""
    from deepinfer_npu import SamplingParams

    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    kw = dict(speculative_method="mtp", num_speculative_tokens=3, zero_overhead_scheduling=True,
              varlen_verification=varlen)
    ref_llm, ref, ref_report = _run(monkeypatch, False, params, **kw)
    llm, got, report = _run(monkeypatch, True, params, **kw)
    assert "left out of the selection" in ref_report["spec_verify"], ref_report["spec_verify"]
    assert "left out of the selection" in ref_report["zos_fixup"], ref_report["zos_fixup"]
    assert report["spec_verify"].startswith("native (kernels_cuda.spec_verify (greedy)"), report["spec_verify"]
    assert report["zos_fixup"].startswith("native (kernels_cuda.zos_fixup"), report["zos_fixup"]
    assert report["decode_inputs"].startswith("native (kernels_cuda.decode_inputs"), report["decode_inputs"]
    assert "left out of the selection" in ref_report["decode_inputs"], ref_report["decode_inputs"]
    stats, ref_stats = llm.get_stats(), ref_llm.get_stats()
    if not varlen:
        assert got == ref, (got, ref)
        for key in ("spec_accepted_tokens", "spec_draft_tokens", "decode_steps"):
            assert stats[key] == ref_stats[key], (key, stats[key], ref_stats[key])
        return
    assert "correction + re-split" in report["zos_fixup"], report["zos_fixup"]  # draft_probs passed: the re-split ran
    exact = sum(a == b for a, b in zip(got, ref))
    for a, b in zip(got, ref):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert common >= 8, (common, a, b)
    assert exact >= len(PROMPTS) - 1, (exact, got, ref)


@needs_reference
def test_seeded_temperature_tokens_equal_the_reference_path(monkeypatch):
    from deepinfer_npu import SamplingParams

    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=1000 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    params[1] = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)  # a greedy row in the batch
    _ref_llm, ref, _ref_report = _run(monkeypatch, False, params)
    _llm, got, report = _run(monkeypatch, True, params)
    assert "kernels_cuda.spec_verify (greedy / temperature rows without drafts" in report["spec_verify"], report
    for a, b in zip(got, ref):
        assert a == b, (a, b)


def test_prefill_kernel_in_the_engine(monkeypatch, deepseek_dims_model, assert_logprobs_close):
    """kernels_cuda.mla_decode.mla_prefill serving prefill at DeepSeek dims (random bf16 weights, 2 layers), short
    prompts (<= 16 tokens: its 32-query bucket, not decode variants) included: greedy tokens follow the default
    path (the reference loop on host lengths) by the logprobs-close rule."""

    from deepinfer_npu import LLM, SamplingParams

    path = deepseek_dims_model()
    prompts = [{"prompt_token_ids": [(31 * i + 7 * b) % 4000 + 5 for i in range(100 + 250 * b)]} for b in range(4)]
    prompts += [{"prompt_token_ids": [(17 * i + 3 * b) % 4000 + 5 for i in range(3 + 6 * b)]} for b in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)

    def run(enabled: bool):
        _use_kernels(monkeypatch, enabled)
        llm = LLM(path, load_format="dummy", backend="cuda", dtype="bfloat16", max_model_len=1024,
                  max_num_seqs=4, max_num_batched_tokens=512,  # chunked prefill: context before later chunks
                  graph_capture="lazy")
        _forget_paths(llm)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return llm.llm_engine.backend.op_report()["mla_attention"], outs

    rep_off, off = run(False)
    rep_on, on = run(True)
    assert "mla_prefill" in rep_on and "mla_prefill (bf16" not in rep_off
    assert "q<= 32)" in rep_on, rep_on  # the short prompts' prefill steps
    assert_logprobs_close(off, on)


def test_mla_absorb_in_the_engine(monkeypatch, deepseek_dims_model, assert_logprobs_close):
    """kernels_cuda.mla_absorb (W_UK of one token) at batch 1, DeepSeek dims: where selected every decode step
    takes it, and the greedy tokens follow cuBLAS' path by the logprobs-close rule."""

    from deepinfer_npu import LLM, SamplingParams

    path = deepseek_dims_model()
    prompt = {"prompt_token_ids": [(31 * i + 7) % 4000 + 5 for i in range(60)]}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)

    def run(enabled: bool):
        _use_kernels(monkeypatch, True, set() if enabled else {"mla_absorb"})
        llm = LLM(path, load_format="dummy", backend="cuda", dtype="bfloat16", max_model_len=256,
                  max_num_seqs=1, graph_capture="lazy")
        _forget_paths(llm)
        outs = [o.outputs[0] for o in llm.generate([prompt], params, use_tqdm=False)]
        return llm.llm_engine.backend.op_report()["mla_prolog"], outs

    rep_off, off = run(False)
    rep_on, on = run(True)
    assert "W_UK of one token: kernels_cuda.mla_absorb" in rep_on and "cuBLAS batched GEMM" not in rep_on, rep_on
    assert "W_UK of one token: cuBLAS batched GEMM" in rep_off, rep_off
    assert_logprobs_close(off, on)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="mla_decode_ws runs on Hopper (compute capability 9.x) only")


def _ws_against_pipelined(monkeypatch, path: str, prompts, assert_logprobs_close, **llm_kw) -> None:
    """Greedy runs with logprobs, mla_decode_ws left out and then selected: the op report names the
    warp-specialized kernel only in the second, and the tokens follow the logprobs-close rule."""
    from deepinfer_npu import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)

    def run(enabled: bool):
        _use_kernels(monkeypatch, True, set() if enabled else {"mla_decode_ws"})
        llm = LLM(path, load_format="dummy", backend="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                  graph_capture="lazy", **llm_kw)
        _forget_paths(llm)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return llm.llm_engine.backend.op_report()["mla_attention"], outs

    rep_off, off = run(False)
    rep_on, on = run(True)
    assert "warp-specialized (mla_decode_ws)" in rep_on, rep_on
    assert "warp-specialized" not in rep_off, rep_off
    assert_logprobs_close(off, on)


@needs_sm90
def test_mla_decode_ws_in_the_engine(monkeypatch, deepseek_dims_model, assert_logprobs_close):
    """kernels_cuda.mla_decode_ws (the hand warp-specialized decode, selected on a Hopper) at 128 heads,
    three requests: every decode step takes it, and the greedy tokens follow those of the pipelined kernel."""
    path = deepseek_dims_model(num_attention_heads=128, num_key_value_heads=128)
    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % 4000 + 5 for i in range(40 + 30 * j)]} for j in range(3)]
    _ws_against_pipelined(monkeypatch, path, prompts, assert_logprobs_close)


@needs_sm90
def test_mla_decode_ws_with_mtp_drafts_at_16_heads(monkeypatch, deepseek_dims_model, assert_logprobs_close):
    """V2-Lite's 16 heads with MTP (2 drafts: 3 query tokens a request, 48 rows of a 64-row tile) on the
    warp-specialized kernel, against the pipelined one."""
    path = deepseek_dims_model(num_nextn_predict_layers=1)
    prompts = [{"prompt_token_ids": [(17 * i + 11 * j) % 4000 + 5 for i in range(30 + 20 * j)]} for j in range(3)]
    _ws_against_pipelined(monkeypatch, path, prompts, assert_logprobs_close, speculative_method="mtp",
                          num_speculative_tokens=2)
