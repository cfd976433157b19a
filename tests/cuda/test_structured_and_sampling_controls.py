"""Structured output and the sampling controls on the CUDA backend (decode graphs, ZOS, MTP): constrained outputs
always parse, validate, fullmatch or pick a choice; the unconstrained rows of a mixed batch are logprobs-close to
the same requests alone; penalties, logit bias, min-p and n > 1 give the CPU backend's greedy tokens (fp32 on both,
logprobs-close) with nothing read back to the host on the launch path. Skipped without CUDA or the reference model.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.hal.sync_guard import HostReadDetector
from tests.reference_assets import needs_reference_model
from tests.sampling_controls.test_engine_controls import CONTROLLED, PROMPTS as CONTROL_PROMPTS
from tests.structured_output.test_engine_structured import CHOICES, PROMPTS, REGEXES, _requests

pytestmark = [pytest.mark.gpu, pytest.mark.tilelang, needs_reference_model]

ENGINE = dict(max_num_seqs=64, block_size=16, num_kv_blocks=1024, dtype="float32")


def _free(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("engine", [{}, {"speculative_method": "mtp", "num_speculative_tokens": 3}],
                         ids=["zos-graphs", "mtp"])
def test_constrained_outputs_always_match_on_cuda(engine, assert_logprobs_close):
    llm = LLM(backend="cuda", **ENGINE, **engine)
    alone = [o.outputs[0] for o in llm.generate(PROMPTS[:2], _free(16), use_tqdm=False)]
    schemas, prompts, params = _requests()
    params[-2:] = [_free(16), _free(16)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, schema in enumerate(schemas):
        c = outs[i].outputs[0]
        assert c.finish_reason == "stop", (i, c.text, schema)
        jsonschema.validate(json.loads(c.text, strict=False), schema)
    base = len(schemas)
    for k, pattern in enumerate(REGEXES):
        c = outs[base + k].outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), (pattern, c.text)
    assert outs[base + len(REGEXES)].outputs[0].text in CHOICES
    assert_logprobs_close([o.outputs[0] for o in outs[-2:]], alone)
    llm.llm_engine.scheduler.check_invariants()
    assert llm.llm_engine.scheduler.kv_block_manager.usage() == 0.0


def _controlled_outputs(backend: str, detect: bool):
    llm = LLM(backend=backend, max_num_seqs=8, dtype="float32")
    prompts = [CONTROL_PROMPTS[i] for i, _ in CONTROLLED]
    params = [dataclasses.replace(p, logprobs=5) for _, p in CONTROLLED]
    if not detect:
        return llm.generate(prompts, params, use_tqdm=False), []
    with HostReadDetector() as detector:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, detector.reads


def test_sampling_controls_on_cuda_match_the_cpu_backend(assert_logprobs_close):
    cpu, _ = _controlled_outputs("cpu", detect=False)
    cuda, reads = _controlled_outputs("cuda", detect=True)
    assert reads == []
    assert [len(o.outputs) for o in cuda] == [len(o.outputs) for o in cpu]
    for a, b in zip(cpu, cuda):
        assert_logprobs_close(a.outputs, b.outputs)
