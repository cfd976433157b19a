"""Ascend NPU backend (torch_npu fused ops + TileLang-Ascend kernels).

Nothing here imports ``torch_npu`` at module import time: :mod:`.runtime` loads it on first use, so importing
``deepinfer_npu`` (or probing the registry) never touches the Ascend stack. This backend has not yet run on an
NPU; see docs/ascend.md for what has been verified and how.
"""
