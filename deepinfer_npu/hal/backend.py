"""The Backend base class: one subclass per device target, in the style of vLLM's ``Platform``.

Class attributes name the target; classmethods answer availability without constructing anything (so the
registry can probe cheaply); the instance owns the device, its streams and its :class:`KernelSet`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple

import torch

from . import sync_guard
from .kernel_set import KernelSet


class MemoryInfo(NamedTuple):
    """Device memory in bytes (host RAM for the CPU backend); unpacks as ``free, total``."""

    free_bytes: int
    total_bytes: int


class Backend:
    """Base class for device backends. Subclasses set the class attributes and override the hooks."""

    name: ClassVar[str] = ""  # registry name, e.g. "cpu"
    device_type: ClassVar[str] = ""  # torch device type, e.g. "cpu", "cuda", "npu"
    dist_backend: ClassVar[str] = ""  # torch.distributed backend: "gloo", "nccl", "hccl"
    kernel_set_cls: ClassVar[type[KernelSet]] = KernelSet
    #: Whether varlen may re-split a ZOS step's query lengths on the device (the N-1 rule). A backend whose
    #: attention API needs exact host query lengths (Ascend's fused attention) sets False: the CPU split stands.
    supports_device_resplit: ClassVar[bool] = True
    # Decode from captured graphs when ``EngineConfig.enable_graphs`` is None (auto): backends whose graph runner
    # was verified against eager decode on their hardware (CUDA) say True.
    graphs_by_default: ClassVar[bool] = False
    #: Whether decode graphs may capture the drafter's device-only main-forward hook (DFlash's ring write:
    #: scatter-reduce + index writes). Ascend says False until that capture is checked on an NPU.
    drafter_hook_in_graphs: ClassVar[bool] = True
    #: ``EngineConfig.max_num_batched_tokens`` when it is None: the most tokens in a step. A step's host work
    #: (every layer's launches) is about the same at any token count, so a backend whose host bounds prefill steps
    #: of this size takes more.
    default_max_num_batched_tokens: ClassVar[int] = 4096
    #: Why ``kv_cache_dtype="fp8"`` (packed FP8 latent rows, ``quantization/kv_fp8.py``) cannot run here, or None
    #: when the backend's attention reads that cache. Checked once at start-up.
    fp8_kv_cache_unsupported: ClassVar[str | None] = "no attention path of this backend reads a packed FP8 cache yet"

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index
        self.kernels: KernelSet = self.kernel_set_cls()

    # ---- availability (classmethods: probed by the registry before construction) ---------------------------
    @classmethod
    def is_available(cls) -> bool:
        """True when this machine can run the backend (driver, runtime, device present)."""
        return cls.unavailable_reason() is None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when available, else a sentence saying what is missing (shown in the registry's error)."""
        raise NotImplementedError

    # ---- device, streams, events ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The torch device tensors of this backend live on."""
        return torch.device(self.device_type, self.device_index)

    def create_stream(self) -> Any:
        """A new stream (``torch.cuda.Stream``-like: ``synchronize``, ``wait_event``, ``wait_stream``)."""
        raise NotImplementedError

    def create_event(self, enable_timing: bool = False) -> Any:
        """A new event (``record``, ``synchronize``, ``query``, ``elapsed_time``)."""
        raise NotImplementedError

    def current_stream(self) -> Any:
        """The stream work is currently launched on."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until all launched device work is done. Raises inside ``forbid_sync()``."""
        sync_guard.check_sync_allowed(f"{type(self).__name__}.synchronize()")

    def graph_runner(self) -> Any | None:
        """A new captured-graph runner (``deepinfer_npu.hal.graph_runner.GraphRunner``: CUDA graphs), or None when
        the backend has none (CPU; tests inject ``EagerReplayRunner``). The worker asks once, when
        ``EngineConfig.enable_graphs`` is set."""
        return None

    @contextlib.contextmanager
    def forbid_sync(self) -> Iterator[None]:
        """Context for the launch path: implicit host-device syncs become errors. The base sets the shared
        flag (:mod:`deepinfer_npu.hal.sync_guard`); device backends also arm their runtime's sync checks."""
        with sync_guard.forbid_sync():
            yield

    def memory_info(self) -> MemoryInfo:
        """Free and total memory of the device."""
        raise NotImplementedError

    # ---- ops -----------------------------------------------------------------------------------------------
    def op_report(self) -> dict[str, str]:
        """``{op: "native" | "fallback (reason)"}`` for every KernelSet op (``--list-ops``)."""
        return self.kernels.op_report()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={self.device})"
