"""The CPU backend: plain torch on the host, the reference every other backend is checked against."""

from __future__ import annotations

import os

import torch

from deepinfer_npu import envs
from deepinfer_npu.hal.backend import Backend, MemoryInfo

from .kernels import CpuKernelSet
from .stream import HostEvent, HostStream


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    kernel_set_cls = CpuKernelSet
    fp8_kv_cache_unsupported = None  # the reference MLA ops pack on write and dequantize on read

    def __init__(self, device_index: int = 0) -> None:
        super().__init__(device_index)
        self._stream = HostStream()
        # Intra-op threads: DEEPINFER_CPU_THREADS (default 1). Reference-sized models run fastest on one thread,
        # and spinning OpenMP workers on a busy host slowed steps ~100x in our measurements.
        torch.set_num_threads(envs.CPU_THREADS)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None  # the host is always there

    @property
    def device(self) -> torch.device:
        # No index: torch treats "cpu:0" and "cpu" alike but prints and compares them differently.
        return torch.device("cpu")

    def create_stream(self) -> HostStream:
        return HostStream()

    def create_event(self, enable_timing: bool = False) -> HostEvent:
        return HostEvent(enable_timing)

    def current_stream(self) -> HostStream:
        return self._stream

    def synchronize(self) -> None:
        super().synchronize()  # host work is already complete; only the guard check remains

    def graph_runner(self) -> None:
        return None

    def memory_info(self) -> MemoryInfo:
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(
            free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page, total_bytes=os.sysconf("SC_PHYS_PAGES") * page
        )
