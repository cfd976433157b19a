"""AscendBackend: torch_npu device, streams/events, HCCL, memory info, NPU graphs, and the fused-op KernelSet.

``ASCEND_RT_VISIBLE_DEVICES`` is honoured by the CANN runtime itself (device 0 of this process is the first
listed chip); ``device_index`` counts within the visible set, as torch.npu does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer_npu.hal import sync_guard
from deepinfer_npu.hal.backend import Backend, MemoryInfo

from . import capabilities, runtime
from .graph import NpuGraphRunner
from .kernels import AscendKernelSet
from .stream import NpuEvent, NpuStream


class AscendBackend(Backend):
    name = "ascend"
    device_type = "npu"
    dist_backend = "hccl"
    kernel_set_cls = AscendKernelSet
    #: No varlen re-split of a ZOS step's query lengths on the device: npu_fused_infer_attention_score's TND
    #: layout takes the per-request query lengths as a host list (``actual_seq_lengths``, cumulative ends) that
    #: also fixes where each request's rows start, so the CPU's split must stand and ``HostLengths.seqlens_q``
    #: stays exact. (Key lengths may still be optimistic; ops_mla.mla_attention_fia masks the excess on the
    #: device.)
    supports_device_resplit = False
    fp8_kv_cache_unsupported = ("FP8 does not run on Atlas A2/A3 NPUs, and the fused attention ops read the cache "
                                "in the model dtype; use kv_cache_dtype='auto'")
    drafter_hook_in_graphs = False  # DFlash's ring write (scatter_reduce) under NPU graph capture: not checked

    def __init__(self, device_index: int = 0) -> None:
        super().__init__(device_index)
        ns = runtime.npu_namespace()
        ns.set_device(device_index)
        device_name = None
        with contextlib.suppress(Exception):
            device_name = str(ns.get_device_name(device_index))
        self.device_name = device_name
        self.emulated = runtime.emulated()
        if self.emulated:  # the contract emulation's fake NPU is the host: its collectives run on gloo (no HCCL)
            self.dist_backend = "gloo"
        self.kernels.limits = capabilities.detect_profile(device_name, self.emulated)
        self.kernels.setup_tilelang()  # TileLang-Ascend kernels (tilelang_ascend.WIRED): decided once, here

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return runtime.unavailable_reason()

    @property
    def device(self) -> torch.device:
        if runtime.emulated():  # the contract emulation's fake NPU is the host
            return torch.device("cpu")
        return torch.device("npu", self.device_index)

    def create_stream(self) -> NpuStream:
        return NpuStream(device_index=self.device_index)

    def create_event(self, enable_timing: bool = False) -> NpuEvent:
        return NpuEvent(enable_timing)

    def current_stream(self) -> NpuStream:
        return NpuStream(runtime.npu_namespace().current_stream())

    def synchronize(self) -> None:
        super().synchronize()
        runtime.npu_namespace().synchronize()

    def graph_runner(self) -> NpuGraphRunner:
        """NPU decode graphs (``graph.py``): used when ``enable_graphs=True`` (off by default: verified by the CPU
        contract emulation only, never on an NPU)."""
        return NpuGraphRunner(self.device_index, kernels=self.kernels, device=self.device)

    @contextlib.contextmanager
    def forbid_sync(self) -> Iterator[None]:
        """The HAL flag plus torch_npu's own sync debug mode set to "error", so syncs hidden inside torch ops
        (``.item()``, data-dependent shapes) raise too; the previous mode is restored afterwards."""
        ns = runtime.npu_namespace()
        arm = sync_guard.guard_enabled() and hasattr(ns, "set_sync_debug_mode")
        previous = ns.get_sync_debug_mode() if arm and hasattr(ns, "get_sync_debug_mode") else 0
        if arm:
            ns.set_sync_debug_mode("error")
        try:
            with sync_guard.forbid_sync():
                yield
        finally:
            if arm:
                ns.set_sync_debug_mode(previous)

    def memory_info(self) -> MemoryInfo:
        free, total = runtime.npu_namespace().mem_get_info(self.device_index)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))
