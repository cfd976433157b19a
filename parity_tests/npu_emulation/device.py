"""A stand-in for the ``torch.npu`` device namespace whose "NPU" is the host.

Streams and events are host objects (work is synchronous); graphs re-run the captured callable on replay
(the emulation checks the runner's bookkeeping, not capture); the sync debug mode is recorded so tests can see
that ``forbid_sync()`` armed it. Nothing here pretends to measure anything.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any


class Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        return 0.0


class Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def wait_stream(self, stream: Stream) -> None:
        pass

    def query(self) -> bool:
        return True


class NPUGraph:
    """Replay re-runs what was captured (host execution has nothing to record)."""

    def __init__(self) -> None:
        self._fn = None

    def pool(self) -> object:
        return ("emulated-pool", id(self))

    def replay(self) -> None:
        if self._fn is not None:
            self._fn()


class FakeNpuNamespace:
    """What the backend calls on ``torch.npu``."""

    def __init__(self) -> None:
        self.current_device = 0
        self.sync_debug_mode: int | str = 0
        self.sync_debug_modes_seen: list[int | str] = []
        self.task_updates = 0
        self._stream = Stream()
        self.Event = Event
        self.Stream = Stream
        self.NPUGraph = NPUGraph

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        self.current_device = index

    def get_device_name(self, index: int = 0) -> str:
        return "CPU contract emulation (not an NPU)"

    def current_stream(self, device: Any = None) -> Stream:
        return self._stream

    def synchronize(self, device: Any = None) -> None:
        pass

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def set_sync_debug_mode(self, mode: int | str) -> None:
        self.sync_debug_mode = mode
        self.sync_debug_modes_seen.append(mode)

    def get_sync_debug_mode(self) -> int | str:
        return self.sync_debug_mode

    @contextlib.contextmanager
    def graph(self, graph: NPUGraph, pool: Any = None, stream: Any = None):
        yield  # the runner calls fn inside; the emulation keeps nothing (replay is the runner's re-run)

    @contextlib.contextmanager
    def stream(self, stream: Any):
        yield

    def graph_task_update_begin(self, stream: Any, handle: Any) -> None:
        self.task_updates += 1

    def graph_task_update_end(self, stream: Any) -> None:
        pass
