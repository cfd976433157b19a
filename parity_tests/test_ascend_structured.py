"""Structured output on the Ascend backend under contract emulation (see test_ascend_contract_emulation.py): the
grammar masks reach the Ascend ``spec_verify`` through the same ban mask, so constrained greedy tokens equal the CPU
backend's, with MTP drafts verified under the masks. Proves the engine path, not NPU kernels."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.structured_output import StructuredOutputsParams
from parity_tests.npu_emulation import emulated_npu
from tests.reference_assets import HAS_REFERENCE_MODEL, NO_REFERENCE_MODEL

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def _constrained(model_dir, backend: str) -> list[list[int]]:
    llm = LLM(str(model_dir), backend=backend, dtype="float32", block_size=16, num_kv_blocks=96,
              speculative_method="mtp", num_speculative_tokens=3)
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{1,3}"))]
    outs = llm.generate(["user = ", "tag: "], params, use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text, strict=False), SCHEMA)
    assert re.fullmatch(r"[a-z]{2,5}-\d{1,3}", outs[1].outputs[0].text)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_constrained_tokens_equal_cpu_under_emulation(tmp_path):
    if not HAS_REFERENCE_MODEL:
        pytest.skip(NO_REFERENCE_MODEL)
    model = tmp_path / "model"
    shutil.copytree(REFERENCE_MODEL_DIR, model)
    cpu = _constrained(model, "cpu")
    with emulated_npu():
        ascend = _constrained(model, "ascend")
    assert ascend == cpu
