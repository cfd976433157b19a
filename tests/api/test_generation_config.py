"""``generation_config.json`` gives the sampling defaults (temperature, top_k, top_p, min_p, repetition_penalty) as in vLLM: for requests
without ``SamplingParams`` and for CLI flags left unset; the CLI says which it used."""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.engine.generation_config import load_generation_defaults
from deepinfer_npu.run import main

from .conftest import needs_ref

pytestmark = needs_ref
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("genconfig")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REFERENCE_MODEL_DIR / name, path / name)
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.5, "top_k": 7, "top_p": 0.8, "repetition_penalty": 1.1}))
    return path


def test_generate_without_params_uses_generation_config(model_dir):
    llm = LLM(str(model_dir))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty) == (0.5, 7, 0.8, 1.1)
    implicit = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, use_tqdm=False)]
    explicit = [o.outputs[0].token_ids for o in LLM(str(model_dir)).generate(
        PROMPTS, SamplingParams(temperature=0.5, top_k=7, top_p=0.8, repetition_penalty=1.1), use_tqdm=False)]
    assert implicit == explicit  # same engine seed, so the same per-request seeds


def test_cli_uses_and_names_the_defaults(model_dir, capsys):
    assert main(["--model", str(model_dir), "--max-tokens", "2", "--prompt", "a", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "generation_config.json: temperature=0.5, top_k=7, top_p=0.8" in err
    assert main(["--model", str(model_dir), "--max-tokens", "2", "--prompt", "a", "--no-progress",
                 "--temperature", "0.9"]) == 0
    err = capsys.readouterr().err
    assert "top_k=7, top_p=0.8" in err and "temperature=0.5" not in err


def test_reference_model_samples_by_default():
    defaults = load_generation_defaults(REFERENCE_MODEL_DIR)
    assert defaults.get("temperature", 0) > 0, defaults
