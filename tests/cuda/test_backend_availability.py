"""CUDA backend (backends/cuda): registration, availability with a readable reason, and an import that touches
neither tilelang nor CUDA, everywhere; the HAL hooks (streams, events, memory, graphs) on a CUDA device."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deepinfer_npu.hal import registry, sync_guard


def test_import_touches_neither_tilelang_nor_cuda():
    code = (
        "import sys, torch\n"
        "import deepinfer_npu\n"
        "from deepinfer_npu.backends.cuda import backend, kernels, stream, graph, warmup, ops\n"
        "from deepinfer_npu.hal import registry\n"
        "registry._load_class('cuda').unavailable_reason()\n"
        "kernels.CudaKernelSet().op_report()\n"
        "assert 'tilelang' not in sys.modules, 'tilelang imported'\n"
        "assert not any(m.startswith('deepinfer_npu.kernels_cuda.') for m in sys.modules), 'kernels imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_registered_with_hal_attributes():
    cls = registry._load_class("cuda")
    assert (cls.name, cls.device_type, cls.dist_backend) == ("cuda", "cuda", "nccl")
    assert "cuda" in registry.registered_backends()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_unavailable_here_with_a_readable_reason():
    cls = registry._load_class("cuda")
    assert cls.is_available() is False
    reason = cls.unavailable_reason()
    assert reason and ("CUDA" in reason or "cuda" in reason)
    with pytest.raises(RuntimeError, match=r"backend 'cuda' is not available: .*(CUDA|cuda)"):
        registry.get_backend("cuda")


@pytest.mark.gpu
def test_backend_hooks(cuda_backend):
    be = cuda_backend
    assert be.device == torch.device("cuda", 0)
    free, total = be.memory_info()
    assert 0 < free <= total
    s, e0, e1 = be.create_stream(), be.create_event(True), be.create_event(True)
    e0.record(s)
    with torch.cuda.stream(s.stream):
        torch.ones(1 << 20, device="cuda").sum()
    e1.record(s)
    s.synchronize()
    assert e0.elapsed_time(e1) >= 0.0
    assert be.graph_runner() is not None
    with be.forbid_sync(), pytest.raises(sync_guard.SyncForbiddenError):
        be.synchronize()


@pytest.mark.gpu
def test_free_memory_is_capped_by_the_process_share(cuda_backend):
    """Processes sharing a GPU (pytest-xdist workers, several engines) size their KV caches from their share."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get is None:
        pytest.skip("torch.cuda.get_per_process_memory_fraction is missing in this torch")
    before = get(0)
    free_before, _total = cuda_backend.memory_info()
    try:
        torch.cuda.set_per_process_memory_fraction(0.05, 0)
        free, total = cuda_backend.memory_info()
        assert free <= max(0, int(0.05 * total) - torch.cuda.memory_allocated(0)), (free, total)
        assert free <= free_before
    finally:
        torch.cuda.set_per_process_memory_fraction(before, 0)


@pytest.mark.gpu
def test_worker_style_pageable_h2d_copy_is_a_sync_for_torch():
    """Documents the engine change "error" mode needs: a blocking pageable H2D copy trips torch's checker."""
    import numpy as np

    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.from_numpy(np.arange(8)).to("cuda")
        pinned = torch.arange(8).pin_memory()
        pinned.to("cuda", non_blocking=True)  # the sync-free way
    finally:
        torch.cuda.set_sync_debug_mode(0)
