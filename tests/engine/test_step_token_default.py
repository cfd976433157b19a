"""``EngineConfig.max_num_batched_tokens=None`` takes the backend's step size
(``Backend.default_max_num_batched_tokens``): 4096 on the CPU reference and Ascend, 16384 on CUDA (4096-token prefill
steps were bound by the host's launches on an H200); an explicit value is kept and validated."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.hal import registry


def test_backends_declare_their_step_size():
    assert registry._load_class("cpu").default_max_num_batched_tokens == 4096
    assert registry._load_class("cuda").default_max_num_batched_tokens == 16384
    assert registry._load_class("ascend").default_max_num_batched_tokens == 4096


def test_engine_takes_the_backend_default_and_keeps_an_explicit_value():
    llm = LLM(backend="cpu", max_model_len=256, max_num_seqs=4)
    assert llm.llm_engine.config.max_num_batched_tokens == 4096
    llm = LLM(backend="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=512)
    assert llm.llm_engine.config.max_num_batched_tokens == 512


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        EngineConfig(max_num_batched_tokens=value)


def test_the_server_caps_the_backend_default(monkeypatch):
    """A server's steps default to at most 8192 tokens (a prefill step delays every running request's next token);
    an explicit value is kept."""
    from deepinfer_npu.serve import SERVING_MAX_NUM_BATCHED_TOKENS, serving_step_tokens

    assert SERVING_MAX_NUM_BATCHED_TOKENS == 8192
    assert serving_step_tokens(EngineConfig(backend="cpu")) == 4096
    assert serving_step_tokens(EngineConfig(backend="cpu", max_num_batched_tokens=20000)) == 20000
    monkeypatch.setattr(registry._load_class("cpu"), "default_max_num_batched_tokens", 16384)
    assert serving_step_tokens(EngineConfig(backend="cpu")) == 8192
    assert registry.backend_class("cpu") is registry._load_class("cpu")
    assert registry.backend_class("auto").is_available()
    assert serving_step_tokens(EngineConfig(backend="nonesuch")) is None  # the engine names the backends
