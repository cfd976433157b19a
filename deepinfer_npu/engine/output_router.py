"""Who gets a step's outputs: each request's outputs go to whoever added it, whichever thread ran the step.

A request added with an output sink (``LLM.generate``, a serving loop) has every output handed to that sink. A
request added without one belongs to the caller of ``LLMEngine.step()``: when another caller's step produced its
output, the output is kept until the next ``step()`` returns it. Outputs are cumulative, so only the latest one of
each kept request is retained.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_npu.engine.outputs import RequestOutput

OutputSink = Callable[[RequestOutput], None]


class OutputRouter:
    def __init__(self) -> None:
        self._sinks: dict[str, OutputSink] = {}
        self._kept: dict[str, RequestOutput] = {}  # request_id -> latest output for the next step() caller

    def register(self, request_id: str, sink: OutputSink | None) -> None:
        if sink is not None:
            self._sinks[request_id] = sink

    def has_kept(self) -> bool:
        return bool(self._kept)

    def route(self, outputs: list[RequestOutput], *, for_step_caller: bool) -> list[RequestOutput]:
        """Hand sink-owned outputs to their sinks. ``for_step_caller``: return the sink-less outputs, those kept
        from other callers' steps first; otherwise keep them for the next ``step()`` caller and return ``[]``."""
        mine: list[RequestOutput] = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                if out.finished:
                    del self._sinks[out.request_id]
                sink(out)
            elif for_step_caller:
                mine.append(out)
            else:
                self._kept.pop(out.request_id, None)  # re-insert: the latest output goes last
                self._kept[out.request_id] = out
        if not for_step_caller:
            return []
        kept, self._kept = list(self._kept.values()), {}
        return kept + mine
