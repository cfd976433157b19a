"""CUDA graph capture and replay per total_q size (``torch.cuda.CUDAGraph``), with static device buffers.

Per total_q (DESIGN §6: sizes 1, 2, 4, ... up to the interval, then every 8): a decode step's token count picks
the graph; padding rows point at block 0 / state slot 0. Every per-step input (token ids, positions, slot mapping,
block tables, seqlens) lives in a static buffer refreshed with device-to-device copies, so ZOS corrections made
on the device flow into the replay with no host involvement. Unlike the NPU runner there is no host-parameter
patching: the TileLang MLA decode kernel takes seqlens as device tensors and its grid depends only on host values
fixed per graph (batch rows, block-table width, the bucketed max query length).

Not exercised by the engine yet: the worker does not ask for a graph runner today (HAL ``graph_runner()``), so
every decode step currently runs eagerly (the first session's benchmark numbers are eager numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer_npu.hal.graph_sizes import graph_sizes as _shared_graph_sizes

GRAPH_INTERVAL_ENV = "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL"


def graph_sizes(max_tokens: int, interval: int | None = None) -> list[int]:
    """Graph sizes for this backend (shared rule: ``deepinfer_npu.hal.graph_sizes``; interval from
    ``DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL``)."""
    return _shared_graph_sizes(max_tokens, interval, env=GRAPH_INTERVAL_ENV)


class CudaGraphRunner:
    """Capture ``fn(**static_inputs)`` once per size; replay after copying fresh inputs into the buffers."""

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static_in: dict[int, dict[str, torch.Tensor]] = {}
        self.static_out: dict[int, Any] = {}
        self.pool = None

    def pick(self, total_q: int) -> int | None:
        """Smallest captured size >= ``total_q`` (None: run eagerly)."""
        fits = [s for s in self.graphs if s >= total_q]
        return min(fits) if fits else None

    def capture(self, size: int, fn: Callable[..., Any], static_inputs: dict[str, torch.Tensor]) -> Any:
        # Warm-up on a side stream (as torch recommends): lazy allocations, cuBLAS handles and TileLang
        # compilation happen outside the capture.
        side = torch.cuda.Stream(device=self.device_index)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(**static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(**static_inputs)
        if self.pool is None:
            self.pool = graph.pool()  # later graphs share the memory pool
        self.graphs[size], self.static_in[size], self.static_out[size] = graph, static_inputs, out
        return out

    def replay(self, size: int, inputs: dict[str, torch.Tensor]) -> Any:
        """Copy ``inputs`` (device tensors, each at most the buffer's length) into the static buffers (the rest
        keeps the padding written at capture) and replay."""
        for name, value in inputs.items():
            self.static_in[size][name][: value.shape[0]].copy_(value, non_blocking=True)
        self.graphs[size].replay()
        return self.static_out[size]
