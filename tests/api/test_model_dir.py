"""A model directory without weights fails at start-up, naming the missing files, before any allocation."""

from __future__ import annotations

import json

import pytest

import deepinfer_npu.engine.llm_engine as llm_engine
from deepinfer_npu import LLM
from deepinfer_npu.run import main


@pytest.fixture
def no_allocation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model runner (weights, KV cache) was built for a directory without weights")

    monkeypatch.setattr(llm_engine, "ModelRunner", refuse)


def test_config_without_weights_fails_naming_the_files(tmp_path, no_allocation, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(FileNotFoundError, match=r"has no weights: expected model\.safetensors.*found config\.json"):
        LLM(str(tmp_path))
    assert main(["--model", str(tmp_path), "--no-progress"]) == 2
    assert "has no weights" in capsys.readouterr().err


def test_index_naming_missing_shards_fails_naming_them(tmp_path, no_allocation):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"lacks 1 weight shard.*model-00002-of-00002\.safetensors"):
        LLM(str(tmp_path))


def test_missing_directory_and_config(tmp_path, no_allocation):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))
