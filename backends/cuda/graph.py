"""CUDA graph capture and replay per total_q size (``torch.cuda.CUDAGraph``), with static device buffers.

Per total_q (DESIGN §6: sizes 1, 2, 4, ... up to the interval, then every 8): a decode step's token count picks
the graph; padding rows point at block 0 / state slot 0. Every per-step input (token ids, positions, slot mapping,
block tables, seqlens) lives in a static buffer refreshed with device-to-device copies, so ZOS corrections made
on the device flow into the replay with no host involvement. Unlike the NPU runner there is no host-parameter
patching: the TileLang MLA decode kernel takes seqlens as device tensors and its grid depends only on host values
fixed per graph (batch rows, block-table width, the bucketed max query length).

A capture after the first does not empty torch's device and pinned-host caches, as ``torch.cuda.graph`` does on
entry: a lazy capture in a running engine would otherwise hand back the blocks the next steps allocate again
(``cudaMalloc`` / ``cudaHostAlloc`` inside later steps). vLLM skips that clean-up after its first graph too. A
capture that runs out of memory empties them and tries once more.

Driven by the worker's ``DecodeGraphs`` (``deepinfer_npu/worker/decode_graphs.py``) when
``EngineConfig.enable_graphs`` is set; the interface is ``deepinfer_npu.hal.graph_runner.GraphRunner``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_npu import envs
from deepinfer_npu.hal.graph_runner import GraphRunner
from deepinfer_npu.hal.graph_sizes import graph_sizes as _shared_graph_sizes


def graph_sizes(max_tokens: int, interval: int | None = None) -> list[int]:
    """Graph sizes for this backend (shared rule: ``deepinfer_npu.hal.graph_sizes``; interval from
    ``DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL``)."""
    return _shared_graph_sizes(max_tokens, interval or envs.CUDAGRAPH_BATCH_SIZE_INTERVAL)


class CudaGraphRunner(GraphRunner):
    """Capture ``fn(**static_inputs)`` once per size; replay on what the buffers' owner wrote into them."""

    def __init__(self, device_index: int = 0) -> None:
        super().__init__()
        self.device_index = device_index
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_stream: torch.cuda.Stream | None = None

    def pick(self, total_q: int) -> int | None:
        """Smallest captured size >= ``total_q`` (None: run eagerly)."""
        fits = [s for s in self.graphs if s >= total_q]
        return min(fits) if fits else None

    def capture(self, size: int, fn: Callable[..., Any], static_inputs: dict[str, torch.Tensor]) -> Any:
        # Capturing synchronises the device on purpose (torch.cuda.graph does): lift the launch path's sync debug
        # mode for it. An op that really syncs still fails the capture (the worker then runs eagerly).
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return self._capture(size, fn, static_inputs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def _capture(self, size: int, fn: Callable[..., Any], static_inputs: dict[str, torch.Tensor]) -> Any:
        # Warm-up on a side stream (as torch recommends): lazy allocations, cuBLAS handles and TileLang
        # compilation happen outside the capture.
        side = torch.cuda.Stream(device=self.device_index)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(**static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:  # the first graph: free what the caches hold, as torch.cuda.graph does
            self._free_cached_blocks()
        try:
            graph, out = self._record(fn, static_inputs)
        except torch.OutOfMemoryError:
            self._free_cached_blocks()
            graph, out = self._record(fn, static_inputs)
        if self.pool is None:
            self.pool = graph.pool()  # later graphs share the memory pool
        self.graphs[size], self.static_in[size], self.static_out[size] = graph, static_inputs, out
        self.num_captures += 1
        return out

    def _free_cached_blocks(self) -> None:
        torch.cuda.synchronize(self.device_index)
        torch.cuda.empty_cache()

    def _record(self, fn: Callable[..., Any], static_inputs: dict[str, torch.Tensor]):
        """``torch.cuda.graph``'s capture without its cache clean-up: on a stream of its own, after the work queued
        before it; -> (graph, outputs)."""
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(device=self.device_index)
        stream, graph = self.capture_stream, torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                out = fn(**static_inputs)
            except BaseException:
                with contextlib.suppress(Exception):  # the capture is invalid already; report fn's error
                    graph.capture_end()
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return graph, out

    def replay(self, size: int) -> Any:
        """Replay on the static buffers' contents (their owner writes them: ``DecodeGraphs`` keeps a record of what
        they hold)."""
        self.graphs[size].replay()
        self.num_replays += 1
        return self.static_out[size]
