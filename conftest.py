"""Hardware markers for the whole suite: ``gpu``, ``tilelang``, ``nvcc``, ``npu`` (registered in pyproject.toml).

A marked test is skipped, with the missing requirement named, on a machine that lacks it, so device tests live
beside the CPU ones without per-file ``skipif`` copies. ``pytest -m gpu`` selects the GPU tier on a GPU host.

Under pytest-xdist on a GPU host (``pytest -m gpu -n 8``), each worker process gets an equal share of the GPU's
memory (``torch.cuda.set_per_process_memory_fraction``; the CUDA backend sizes KV caches from that share), so that
one worker's engine does not take the memory the others need. ``TEST_FAILURE_LOG=path`` appends each
failure's report to ``path`` as it happens (a run cut off by a time limit still says what failed and why).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import pytest


@functools.cache
def _missing(marker: str) -> str | None:
    if marker == "gpu":
        import torch

        return None if torch.cuda.is_available() else "needs a CUDA device (torch.cuda.is_available() is False)"
    if marker == "tilelang":
        return None if importlib.util.find_spec("tilelang") is not None else "needs tilelang==0.1.15"
    if marker == "nvcc":
        return None if shutil.which("nvcc") else "needs the CUDA toolkit's nvcc on PATH"
    if marker == "npu":
        # Never import torch_npu to find out: without CANN it breaks `import torch` for the whole process.
        return None if importlib.util.find_spec("torch_npu") is not None and shutil.which("npu-smi") else \
            "needs an Ascend NPU with torch_npu and CANN"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("gpu", "tilelang", "nvcc", "npu"):
            if item.get_closest_marker(marker) is not None and (why := _missing(marker)):
                item.add_marker(pytest.mark.skip(reason=why))
                break


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER") and _missing("gpu") is None:
        import torch

        torch.cuda.set_per_process_memory_fraction(0.95 / workers)


def pytest_runtest_logreport(report):
    path = os.environ.get("TEST_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
