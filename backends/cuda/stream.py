"""CUDA streams and events behind the HAL's interface, with the sync guard on every host wait."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_npu.hal import sync_guard


class CudaEvent:
    """Wraps ``torch.cuda.Event`` so that ``synchronize()`` inside ``forbid_sync()`` raises as the HAL asks."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.event = torch.cuda.Event(enable_timing=enable_timing)

    def record(self, stream: Any = None) -> None:
        if stream is None:
            self.event.record()
        else:
            self.event.record(stream.stream if isinstance(stream, CudaStream) else stream)

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        sync_guard.check_sync_allowed("CudaEvent.synchronize()")
        self.event.synchronize()

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for this event, on the device (no host wait)."""
        target = stream.stream if isinstance(stream, CudaStream) else stream
        if target is None:
            self.event.wait()
        else:
            self.event.wait(target)

    def elapsed_time(self, end: CudaEvent) -> float:
        return float(self.event.elapsed_time(end.event))


class CudaStream:
    """Wraps ``torch.cuda.Stream``; ``stream`` is the torch object (use it with ``torch.cuda.stream(...)``)."""

    def __init__(self, stream: Any = None, device_index: int = 0) -> None:
        self.stream = stream if stream is not None else torch.cuda.Stream(device=device_index)

    def synchronize(self) -> None:
        sync_guard.check_sync_allowed("CudaStream.synchronize()")
        self.stream.synchronize()

    def wait_event(self, event: CudaEvent) -> None:
        self.stream.wait_event(event.event)

    def wait_stream(self, other: CudaStream) -> None:
        self.stream.wait_stream(other.stream if isinstance(other, CudaStream) else other)

    def record_event(self, event: CudaEvent | None = None) -> CudaEvent:
        event = event or CudaEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return bool(self.stream.query())
