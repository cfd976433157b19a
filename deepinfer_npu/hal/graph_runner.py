"""The captured-graph interface the worker drives: one graph per decode size (total_q), static inputs/outputs.

``capture(size, fn, static_inputs)`` records ``fn(**static_inputs)`` once (after a warm-up run, which device
graphs require) and returns its outputs: tensors (or a pytree of tensors) that every later ``replay(size)``
overwrites in place. Before a replay the caller writes the step's inputs into the same ``static_inputs`` tensors;
nothing is passed to ``replay``. Before each capture and each replay the caller also hands over the step's host
lengths (``set_step_host_lengths``): runners whose captured kernels bake host parameters re-issue them there
(Ascend's fused attention takes ``actual_seq_lengths(_kv)`` as host lists); the default ignores them. Real runners:
``backends/cuda/graph.py`` (``torch.cuda.CUDAGraph``), ``backends/ascend/graph.py`` (``torch.npu.NPUGraph``).

:class:`EagerReplayRunner` is the same contract without capture: ``replay`` calls ``fn`` on the static buffers
and copies the result into the outputs returned at capture. The CPU backend has no graph runner; tests inject
this one so the worker's graph plumbing (padding, static buffers, output slicing) runs on the CPU reference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map


class GraphRunner(ABC):
    """Captured graphs keyed by size. ``num_captures`` / ``num_replays`` count calls (tests and stats)."""

    def __init__(self) -> None:
        self.static_in: dict[int, dict[str, torch.Tensor]] = {}
        self.static_out: dict[int, Any] = {}
        self.num_captures = 0
        self.num_replays = 0

    def has(self, size: int) -> bool:
        return size in self.static_out

    def set_step_host_lengths(self, size: int, host: Any, max_drafts: int) -> None:
        """Called before every capture and replay of ``size``: ``host`` is the step's ``HostLengths`` (its real rows
        only; None for the all-padding capture at start-up) and ``max_drafts`` the most drafts a decode row
        verifies (rows hold at most ``max_drafts + 1`` queries; optimistic key lengths exceed the true ones by at
        most ``max_drafts``). Host values only: nothing here may read the device. Default: ignored."""
        return None

    @abstractmethod
    def capture(self, size: int, fn: Callable[..., Any], static_inputs: dict[str, torch.Tensor]) -> Any:
        """Warm up, record ``fn(**static_inputs)`` as the graph of ``size``; -> its static outputs."""

    @abstractmethod
    def replay(self, size: int) -> Any:
        """Run the graph of ``size`` on the current contents of its static inputs; -> its static outputs."""


class EagerReplayRunner(GraphRunner):
    """No capture: ``replay`` re-runs ``fn`` on the static inputs and writes into the captured outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fns: dict[int, Callable[..., Any]] = {}

    def capture(self, size: int, fn: Callable[..., Any], static_inputs: dict[str, torch.Tensor]) -> Any:
        out = fn(**static_inputs)  # the "warm-up"; its outputs become the static outputs
        self.fns[size], self.static_in[size], self.static_out[size] = fn, static_inputs, out
        self.num_captures += 1
        return out

    def replay(self, size: int) -> Any:
        fresh = self.fns[size](**self.static_in[size])
        tree_map(lambda o, n: None if o is None else o.copy_(n), self.static_out[size], fresh)
        self.num_replays += 1
        return self.static_out[size]
