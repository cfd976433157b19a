"""deepinfer_npu: DeepSeek-family inference on Ascend NPUs and NVIDIA GPUs with a CPU reference backend.

Public API (vLLM-compatible names)::

    from deepinfer_npu import LLM, SamplingParams
    outputs = LLM().generate(["def fib(n):"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "deepinfer_npu.engine.llm",
    "LLMEngine": "deepinfer_npu.engine.llm_engine",
    "SamplingParams": "deepinfer_npu.engine.sampling_params",
    "RequestOutput": "deepinfer_npu.engine.outputs",
    "CompletionOutput": "deepinfer_npu.engine.outputs",
    "EngineConfig": "deepinfer_npu.config",
    "EPLBConfig": "deepinfer_npu.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    # Lazy: importing the package stays cheap and never touches device runtimes (torch_npu in particular).
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'deepinfer_npu' has no attribute {name!r}")
