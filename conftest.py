"""Hardware markers for the whole suite: ``gpu``, ``tilelang``, ``nvcc``, ``npu`` (registered in pyproject.toml).

A marked test is skipped, with the missing requirement named, on a machine that lacks it, so device tests live
beside the CPU ones without per-file ``skipif`` copies. ``pytest -m gpu`` selects the GPU tier on a GPU host.

Under pytest-xdist on a GPU host (``pytest -m gpu -n 14``), engines built by a worker size their KV caches from an
equal share of the GPU's memory, so that one worker's engine does not take the memory the others need, and build
their kernels in a few processes each (``DEEPINFER_COMPILE_WORKERS``). ``TEST_FAILURE_LOG=path`` appends each
failure's report to ``path`` as it happens (a run cut off by a time limit still says what failed and why);
``TEST_DURATION_LOG=path`` appends each test's call time, outcome and id (where a cut-off run spent its time); a
module that fails to import is in both logs, as an error. After each GPU test a worker hands its cached GPU blocks
back to the driver: 14 workers each keeping the peak of their largest test ran the GPU out of memory.
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


@functools.cache
def _gpu_worker_share() -> float | None:
    """The share of the GPU's memory a pytest-xdist worker sizes engines' KV caches from, or None (one process,
    or no GPU)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER") and _missing("gpu") is None:
        return 0.9 / workers
    return None


def pytest_configure(config):
    """A GPU worker's engines size their KV caches from the worker's share of the GPU's memory (a soft cap: other
    tensors may use more, which kernel tests of V3 shapes need), set here for the whole session so that engines of
    module-scoped fixtures are covered too; and they build their kernels in a few processes, not one per core each
    (14 workers on a 16-core host would otherwise start ~200 compile processes at once)."""
    share = _gpu_worker_share()
    if share is None:
        return
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("DEEPINFER_COMPILE_WORKERS", str(max(2, (os.cpu_count() or 1) // workers)))
    import torch

    from deepinfer_npu.backends.cuda.backend import CudaBackend
    from deepinfer_npu.hal.backend import MemoryInfo

    device_info = CudaBackend.memory_info

    def memory_info(self):
        info = device_info(self)
        cap = max(0, int(share * info.total_bytes) - torch.cuda.memory_allocated(self.device_index))
        return MemoryInfo(free_bytes=min(info.free_bytes, cap), total_bytes=info.total_bytes)

    CudaBackend.memory_info = memory_info


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Under pytest-xdist on a GPU host, return the blocks torch's caching allocator keeps after a GPU test (the
    tensors of a test that ended are garbage, module-scoped engines keep theirs), so that the workers share the GPU
    by what they use now, not by the largest test each one ran."""
    if _gpu_worker_share() is None or item.get_closest_marker("gpu") is None:
        return
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


_COLLECTION_ERRORS: set[str] = set()


def pytest_collectreport(report):
    """A module that fails to import (a missing package on a GPU host) never reaches the per-test hooks: both logs
    name it, once (each xdist worker collects, and the controller hears every worker)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not report.failed or report.nodeid in _COLLECTION_ERRORS:
        return
    _COLLECTION_ERRORS.add(report.nodeid)
    path = os.environ.get("TEST_FAILURE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"==== FAILED {report.nodeid} (collection)\n{report.longreprtext}\n")
    path = os.environ.get("TEST_DURATION_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"0.00 error {report.nodeid}\n")


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes what its workers report
        return
    path = os.environ.get("TEST_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
    path = os.environ.get("TEST_DURATION_LOG")
    if path and report.when == "call":
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f} {report.outcome} {report.nodeid}\n")
