"""NPU streams and events behind the HAL's torch.cuda-like interface, with the sync guard on every wait."""

from __future__ import annotations

from typing import Any

from deepinfer_npu.hal import sync_guard

from . import runtime


class NpuEvent:
    """Wraps ``torch.npu.Event`` so that ``synchronize()`` inside ``forbid_sync()`` raises like the HAL
    asks."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.event = runtime.npu_namespace().Event(enable_timing=enable_timing)

    def record(self, stream: Any = None) -> None:
        if stream is None:
            self.event.record()
        else:
            self.event.record(stream.stream if isinstance(stream, NpuStream) else stream)

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        sync_guard.check_sync_allowed("NpuEvent.synchronize()")
        self.event.synchronize()

    def wait(self, stream: Any = None) -> None:
        target = stream.stream if isinstance(stream, NpuStream) else stream
        if target is None:
            self.event.wait()
        else:
            self.event.wait(target)

    def elapsed_time(self, end: NpuEvent) -> float:
        return float(self.event.elapsed_time(end.event))


class NpuStream:
    """Wraps ``torch.npu.Stream``; ``stream`` is the torch_npu object (use it with
    ``torch.npu.stream(...)``)."""

    def __init__(self, stream: Any = None, device_index: int = 0) -> None:
        ns = runtime.npu_namespace()
        self.stream = stream if stream is not None else ns.Stream(device=device_index)

    def synchronize(self) -> None:
        sync_guard.check_sync_allowed("NpuStream.synchronize()")
        self.stream.synchronize()

    def wait_event(self, event: NpuEvent) -> None:
        self.stream.wait_event(event.event)

    def wait_stream(self, other: NpuStream) -> None:
        self.stream.wait_stream(other.stream)

    def record_event(self, event: NpuEvent | None = None) -> NpuEvent:
        event = event or NpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return bool(self.stream.query())
