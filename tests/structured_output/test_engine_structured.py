"""Structured output through the engine on the reference model: outputs of 50 random JSON schemas always parse and
validate (greedy and seeded sampling), regexes fullmatch, choices are one of the choices — with ZOS on and off and
with MTP and DFlash speculation; greedy constrained tokens do not depend on speculation; unconstrained requests in
the same batch get exactly the tokens they get alone; a bad schema is a ValueError that queues nothing."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from deepinfer_npu import SamplingParams
from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.structured_output import StructuredOutputsParams

from .test_grammar import random_schema

pytestmark = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "model.safetensors").exists(),
                                reason="reference model not shipped")

ENGINE = dict(max_num_seqs=64, block_size=16, num_kv_blocks=1024)
PROMPTS = ["def f(x):\n", "config = ", "# data\n", "x = {", "import json\n"]
REGEXES = [r"[a-z]{3}-\d{2}", r"(yes|no), \d{1,3}", r"[A-Z][a-z]{1,6}"]
CHOICES = ["red", "green", "blue"]


def _schemas() -> list[dict]:
    out = []
    for seed in range(50):
        rng = random.Random(1000 + seed)
        while True:  # the model's free-form number digits are unbounded: integers, strings, enums, arrays, objects
            schema = random_schema(rng)
            if '"number"' not in json.dumps(schema):
                break
        out.append(schema)
    return out


def _requests():
    schemas = _schemas()
    prompts, params = [], []
    for i, schema in enumerate(schemas):
        sampled = i % 3 == 0  # sampled requests emit JSON without free whitespace (random runs of it can fill max_tokens)
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(
            max_tokens=256, temperature=0.8 if sampled else 0.0, seed=i if sampled else None,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=sampled or i % 2 == 0)))
    for i, pattern in enumerate(REGEXES):
        prompts.append(PROMPTS[i])
        params.append(SamplingParams(max_tokens=32, temperature=0.0,
                                     structured_outputs=StructuredOutputsParams(regex=pattern)))
    prompts.append("favourite colour: ")
    params.append(SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                 structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts += PROMPTS[:2]
    params += [free, free]
    return schemas, prompts, params


@pytest.fixture(scope="module")
def alone():
    """The unconstrained requests' greedy tokens without any constrained request beside them."""
    from deepinfer_npu import LLM

    llm = LLM(**ENGINE)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY_JSON: dict = {}


@pytest.mark.parametrize("engine", [{}, {"zero_overhead_scheduling": False},
                                    {"speculative_method": "mtp", "num_speculative_tokens": 3},
                                    {"speculative_method": "dflash", "num_speculative_tokens": 4}],
                         ids=["zos", "no-zos", "mtp", "dflash"])
def test_constrained_outputs_always_match(engine, alone):
    from deepinfer_npu import LLM

    schemas, prompts, params = _requests()
    llm = LLM(**ENGINE, **engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, schema in enumerate(schemas):
        c = outs[i].outputs[0]
        assert c.finish_reason == "stop", (i, c.text, schema)
        jsonschema.validate(json.loads(c.text, strict=False), schema)  # raw control characters allowed in strings
        if params[i].temperature == 0.0:  # greedy: the same tokens with or without speculation
            assert GREEDY_JSON.setdefault(i, list(c.token_ids)) == list(c.token_ids), i
    base = len(schemas)
    for k, pattern in enumerate(REGEXES):
        c = outs[base + k].outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), (pattern, c.text)
    assert outs[base + len(REGEXES)].outputs[0].text in CHOICES
    free = [list(o.outputs[0].token_ids) for o in outs[-2:]]
    assert free == alone
    llm.llm_engine.scheduler.check_invariants()


def test_bad_constraint_queues_nothing_and_abort_while_compiling():
    from deepinfer_npu import LLM

    llm = LLM(**ENGINE)
    ok = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=r"\d{3}"))
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "objectx"}))
    with pytest.raises(ValueError, match=r"structured_outputs.json is invalid.*index 1"):
        llm.generate(["a", "b"], [ok, bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    engine = llm.llm_engine
    engine.add_request("compiling", "x = ", ok)
    engine.abort_request("compiling")  # before any step: it never reached the scheduler
    finals = [o for _ in range(3) for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finals] == [("compiling", "abort")]
    assert re.fullmatch(r"\d{3}", llm.generate(["n = "], ok, use_tqdm=False)[0].outputs[0].text)
    engine.scheduler.check_invariants()
