"""Stream and event stand-ins for a host backend: work is synchronous, so waiting is a no-op."""

from __future__ import annotations

import time

from deepinfer_npu.hal import sync_guard


class HostEvent:
    """``torch.cuda.Event``-like: records a wall-clock time; always complete."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: HostStream | None = None) -> None:
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        sync_guard.check_sync_allowed("HostEvent.synchronize()")

    def wait(self, stream: HostStream | None = None) -> None:
        """Make ``stream`` wait for this event (no-op: host work is already ordered)."""

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds between this event and ``end`` (both must have been recorded)."""
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._time - self._time) * 1000.0


class HostStream:
    """``torch.cuda.Stream``-like: host work runs in program order, so every wait is already satisfied."""

    def synchronize(self) -> None:
        sync_guard.check_sync_allowed("HostStream.synchronize()")

    def wait_event(self, event: HostEvent) -> None:
        pass

    def wait_stream(self, stream: HostStream) -> None:
        pass

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = event or HostEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True
