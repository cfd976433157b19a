"""A stand-in for the ``torch.npu`` device namespace whose "NPU" is the host.

Streams and events are host objects (work is synchronous; the current stream is tracked so the graph API's
stream arguments can be checked); NPU graphs record and replay device work (:mod:`.graphs`); the sync debug mode
is recorded so tests can see that ``forbid_sync()`` armed it. Nothing here pretends to measure anything.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from . import graphs


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


class FakeNpuNamespace:
    """What the backend calls on ``torch.npu``."""

    def __init__(self) -> None:
        self.current_device = 0
        self.sync_debug_mode: int | str = 0
        self.sync_debug_modes_seen: list[int | str] = []
        self.task_updates = 0  # graph_task_update_begin calls
        self.graphs_captured = 0
        self._default_stream = Stream()
        self._stream = self._default_stream
        self.Event = Event
        self.Stream = Stream
        self.NPUGraph = graphs.NPUGraph
        self.ExternalEvent = graphs.ExternalEvent

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
    def graph(self, graph: graphs.NPUGraph, pool: Any = None, stream: Any = None,
              capture_error_mode: str = "global"):
        """``torch.npu.graph``: work launched inside is recorded into ``graph`` (on a capture stream that is
        current for the duration), not just run."""
        capture_stream = stream if stream is not None else Stream()
        previous, self._stream = self._stream, capture_stream
        try:
            with graphs.capture(graph, capture_stream):
                yield
            self.graphs_captured += 1
        finally:
            self._stream = previous

    def is_current_stream_capturing(self) -> bool:
        return graphs.STATE.capturing is not None and self._stream is graphs.STATE.capture_stream

    @contextlib.contextmanager
    def stream(self, stream: Any):
        previous, self._stream = self._stream, stream if stream is not None else self._stream
        try:
            yield
        finally:
            self._stream = previous

    def graph_task_group_begin(self, stream: Any) -> None:
        graphs.task_group_begin(stream)

    def graph_task_group_end(self, stream: Any) -> graphs.TaskGroupHandle:
        return graphs.task_group_end(stream)

    def graph_task_update_begin(self, stream: Any, handle: graphs.TaskGroupHandle) -> None:
        graphs.task_update_begin(stream, handle, self._stream)
        self.task_updates += 1

    def graph_task_update_end(self, stream: Any) -> None:
        graphs.task_update_end(stream)
