"""CudaBackend: torch.cuda device, streams/events, NCCL, memory info, CUDA graphs, and the TileLang KernelSet.

``forbid_sync()`` and torch's sync debug mode
---------------------------------------------
Inside ``forbid_sync()`` the HAL flag is set (``hal.check_sync_allowed`` raises) and torch's own check is armed
with ``torch.cuda.set_sync_debug_mode(mode)``, restored on exit. The mode is chosen honestly:

- ``"error"`` only once the model has run and every op path taken so far is sync-free;
- ``"warn"`` while any op the model used took a path that reads device values on the host (the CPU-reference
  fallbacks: ``mla_attention`` for prefill chunks / toy dims, ``grouped_mlp`` outside bf16, ...), and before the
  first forward (nothing is known yet). With these fallbacks "error" would make every step raise, so the
  backend arms "warn", logs which ops sync (once), and lists them under ``op_report()["sync_debug"]``.

``DEEPINFER_DISABLE_SYNC_GUARD=1`` arms nothing (and clears the HAL flag, as everywhere);
``DEEPINFER_CUDA_SYNC_DEBUG=error|warn|off`` overrides the choice (debugging).

Note for the engine: the worker's host-to-device copies of step inputs (``torch.from_numpy(a).to(device)``,
pageable memory, blocking) are syncs for torch's checker too, so "error" needs the worker to stage inputs in
pinned buffers and copy with ``non_blocking=True`` first.

``CUDA_VISIBLE_DEVICES`` is honoured by the CUDA runtime; ``device_index`` counts within the visible set.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from deepinfer_npu import envs
from deepinfer_npu.hal import sync_guard
from deepinfer_npu.hal.backend import Backend, MemoryInfo

from .graph import CudaGraphRunner
from .kernels import CudaKernelSet, tilelang_importable
from .stream import CudaEvent, CudaStream

logger = logging.getLogger(__name__)

class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    kernel_set_cls = CudaKernelSet
    # Prefill steps of 4096 tokens were host-bound on an H200 (V2-Lite shape: about 48 ms of host work a step, the
    # host waiting on the device 4 % of the time); 16384 is also vLLM's offline default on GPUs of this class.
    default_max_num_batched_tokens = 16384
    graphs_by_default = True  # graph-vs-eager decode checked on an H200 (tests/cuda/test_cuda_graphs.py)
    # packed FP8 rows: written by the composed prolog tail, read by kernels_cuda.mla_decode's FP8 variant on the
    # DeepSeek dims, by the dense composition or the reference elsewhere (backends/cuda/ops/mla_attention.py)
    fp8_kv_cache_unsupported = None

    def __init__(self, device_index: int = 0) -> None:
        super().__init__(device_index)
        torch.cuda.set_device(device_index)
        props = torch.cuda.get_device_properties(device_index)
        self.device_name = props.name
        self.capability = (props.major, props.minor)
        self.kernels.num_sms = props.multi_processor_count
        self.last_sync_mode: str | None = None  # what the latest forbid_sync() armed ("off" when nothing)
        self._warned_sync = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.cuda is None:
            return f"PyTorch {torch.__version__} is built without CUDA (torch.version.cuda is None)"
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return (
                "torch.cuda.is_available() is False: no CUDA device or driver is visible"
                + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
            )
        return None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def create_stream(self) -> CudaStream:
        return CudaStream(device_index=self.device_index)

    def create_event(self, enable_timing: bool = False) -> CudaEvent:
        return CudaEvent(enable_timing)

    def current_stream(self) -> CudaStream:
        return CudaStream(torch.cuda.current_stream(self.device_index))

    def synchronize(self) -> None:
        super().synchronize()
        torch.cuda.synchronize(self.device_index)

    def graph_runner(self) -> CudaGraphRunner:
        return CudaGraphRunner(self.device_index)

    def memory_info(self) -> MemoryInfo:
        """The device's free memory, capped by this process's share when one is set
        (``torch.cuda.set_per_process_memory_fraction``: processes sharing a GPU size their KV caches from their
        share, not from whatever the others left free)."""
        free, total = torch.cuda.mem_get_info(self.device_index)
        share = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _i: 1.0)(self.device_index)
        if share < 1.0:
            # allocated, not reserved: the allocator reuses its cached blocks (and frees them at the share's limit)
            free = min(free, max(0, int(share * total) - torch.cuda.memory_allocated(self.device_index)))
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    # ---- sync guard ----------------------------------------------------------------------------------------
    def sync_debug_mode(self) -> str:
        """The torch sync debug mode ``forbid_sync()`` arms now: "error", "warn" or "off" (module docstring)."""
        if not sync_guard.guard_enabled():
            return "off"
        forced = envs.CUDA_SYNC_DEBUG
        if forced:
            return forced
        if not self.kernels.has_run() or self.kernels.syncing_ops():
            return "warn"
        return "error"

    @contextlib.contextmanager
    def forbid_sync(self) -> Iterator[None]:
        mode = self.sync_debug_mode()
        self.last_sync_mode = mode
        previous = torch.cuda.get_sync_debug_mode() if mode != "off" else None
        if mode == "warn" and self.kernels.syncing_ops() and not self._warned_sync:
            self._warned_sync = True
            logger.warning(
                "cuda backend: torch sync debug mode armed as 'warn', not 'error': these ops run syncing "
                "CPU-reference fallbacks: %s", self.kernels.syncing_ops()
            )
        if mode != "off":
            torch.cuda.set_sync_debug_mode(mode)
        try:
            with sync_guard.forbid_sync():
                yield
        finally:
            if previous is not None:
                torch.cuda.set_sync_debug_mode(previous)

    # ---- reporting -----------------------------------------------------------------------------------------
    def op_report(self) -> dict[str, str]:
        report = self.kernels.op_report()
        syncing = self.kernels.syncing_ops()
        mode = self.sync_debug_mode()
        if syncing:
            why = "syncing fallbacks used: " + ", ".join(sorted(syncing))
        elif not self.kernels.has_run():
            why = "no forward has run yet: which fallbacks sync is not known"
        else:
            why = "every path taken so far is sync-free"
        report["sync_debug"] = f"{mode} ({why})"
        report["device"] = f"{self.device_name} sm_{self.capability[0]}{self.capability[1]}; tilelang " + (
            "importable" if tilelang_importable() else "not installed (kernels fall back)"
        )
        return report
