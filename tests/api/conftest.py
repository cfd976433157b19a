"""Fixtures for the offline API and CLI tests: one engine on the shipped reference model."""

from __future__ import annotations

import pytest

from deepinfer_npu.config import REFERENCE_MODEL_DIR

needs_ref = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "model.safetensors").exists(),
                               reason="reference model not shipped")


@pytest.fixture(scope="module")
def llm():
    from deepinfer_npu import LLM

    return LLM(max_num_seqs=16, block_size=16, num_kv_blocks=256)
