"""Backend registry, the CPU backend's hooks, and the sync guard."""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.hal import Backend, SyncForbiddenError, get_backend, registry, sync_forbidden


class _MissingBackend(Backend):
    name = "fakeaccel"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def unavailable_reason(cls):
        return "no fakeaccel driver found (libfake.so missing)"


@pytest.fixture
def fake_registered():
    registry.register_backend("fakeaccel", f"{__name__}:_MissingBackend")
    yield
    registry._REGISTRY.pop("fakeaccel")
    registry.clear_cache()


def test_cpu_backend_resolves_once():
    cpu = get_backend("cpu")
    assert get_backend("cpu") is cpu
    # ascend (and cuda, on a machine without a CUDA device) are registered but unavailable: detection falls through
    assert get_backend("auto") is (get_backend("cuda") if torch.cuda.is_available() else cpu)
    assert (cpu.name, cpu.device_type, cpu.dist_backend) == ("cpu", "cpu", "gloo")
    assert cpu.device == torch.device("cpu")
    assert sorted(registry.registered_backends()) == ["ascend", "cpu", "cuda"]


def test_unknown_backend_lists_registered():
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; registered backends: ascend, cuda, cpu"):
        get_backend("tpu")


def test_unavailable_backend_gives_its_reason(fake_registered):
    with pytest.raises(
        RuntimeError, match=r"'fakeaccel' is not available: no fakeaccel driver .*available: (cuda, )?cpu"
    ):
        get_backend("fakeaccel")
    assert get_backend("auto").name == ("cuda" if torch.cuda.is_available() else "cpu")  # skips unavailable ones


def test_cpu_hooks():
    cpu = get_backend("cpu")
    assert cpu.graph_runner() is None
    mem = cpu.memory_info()
    free, total = mem
    assert 0 < mem.free_bytes == free <= mem.total_bytes == total
    start, end = cpu.create_event(enable_timing=True), cpu.create_event(enable_timing=True)
    stream = cpu.create_stream()
    start.record(stream)
    end.record(stream)
    stream.wait_event(end)
    assert end.query() and start.elapsed_time(end) >= 0
    cpu.current_stream().synchronize()
    cpu.synchronize()


def test_forbid_sync_flags_and_raises(monkeypatch):
    cpu = get_backend("cpu")
    assert not sync_forbidden()
    with cpu.forbid_sync():
        assert sync_forbidden()
        with pytest.raises(SyncForbiddenError, match="synchronize"):
            cpu.synchronize()
        with pytest.raises(SyncForbiddenError):
            cpu.create_event().synchronize()
        monkeypatch.setenv("DEEPINFER_DISABLE_SYNC_GUARD", "1")
        assert not sync_forbidden()
        cpu.synchronize()
    assert not sync_forbidden()
