"""NPU graph capture and replay per total_q size (``torch.npu.NPUGraph``), with device-side step metadata.

Why per total_q: a decode step's token count picks the graph (DESIGN §6: sizes 1, 2, 4, ... then every 8);
padding rows point at block 0 / slot 0. Every input a step changes — token ids, positions, slot mapping, block
tables, seqlens — lives in a static device buffer that the launch path refreshes with device-to-device copies,
so ZOS corrections made on the device (seqlens_k by accepted count, input ids gathered from the previous step)
flow into the replay with no host involvement.

The one exception is FIA's ``actual_seq_lengths(_kv)``: eager torch_npu takes them as host int lists baked
into
the captured task. Those must be re-issued with ``torch.npu.graph_task_update_begin/end`` on a side stream
before replay (vllm_ascend/compilation/acl_graph.py: ``update_attn_params``; Ascend/pytorch docs
pytorch_npugraph_desc.md). :meth:`NpuGraphRunner.patch_host_params` is that hook: unavoidable host patching,
said so. Under ZOS the lists patched in are the CPU's own (exact query lengths, optimistic key lengths): the
true key lengths stay on the device and ops_mla.mla_attention_fia hides the excess keys by a device-side
query shift, so patching needs no device read (vllm-ascend instead syncs the stream before replay). What a graph
must still fix is the padded row count of that shift (host-planned per step); torchair's tiling-sink mode takes
the lengths as device tensors instead — the route to drop the patch (docs/ascend.md).

Not exercised by the engine yet: the worker's decode graphs (``worker/decode_graphs.py``) drive runners of the
``deepinfer_npu.hal.graph_runner.GraphRunner`` interface, which fixes host lengths per graph; FIA needs the
per-step host patching above, so this runner is not one and ``enable_graphs`` runs decode eagerly on Ascend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer_npu.hal.graph_sizes import graph_sizes as _shared_graph_sizes

from . import runtime

GRAPH_INTERVAL_ENV = "DEEPINFER_NPUGRAPH_BATCH_SIZE_INTERVAL"


def graph_sizes(max_tokens: int, interval: int | None = None) -> list[int]:
    """Graph sizes for this backend (shared rule: ``deepinfer_npu.hal.graph_sizes``; interval from
    ``DEEPINFER_NPUGRAPH_BATCH_SIZE_INTERVAL``)."""
    return _shared_graph_sizes(max_tokens, interval, env=GRAPH_INTERVAL_ENV)


class NpuGraphRunner:
    """Capture ``fn(**static_inputs)`` once per size; replay after copying fresh inputs into the buffers."""

    def __init__(self, device_index: int = 0) -> None:
        self.ns = runtime.npu_namespace()
        self.device_index = device_index
        self.graphs: dict[int, Any] = {}
        self.static_in: dict[int, dict[str, torch.Tensor]] = {}
        self.static_out: dict[int, Any] = {}
        self.fns: dict[int, Callable[..., Any]] = {}
        self.pool = None

    def pick(self, total_q: int) -> int | None:
        """Smallest captured size >= ``total_q`` (None: run eagerly)."""
        fits = [s for s in self.graphs if s >= total_q]
        return min(fits) if fits else None

    def capture(self, size: int, fn: Callable[..., Any], static_inputs: dict[str, torch.Tensor]) -> Any:
        fn(**static_inputs)  # warm-up: lazy allocations and op compilation happen outside the capture
        graph = self.ns.NPUGraph()
        with self.ns.graph(graph, pool=self.pool):
            out = fn(**static_inputs)
        if self.pool is None:
            self.pool = graph.pool()  # later (smaller) graphs share the memory pool
        self.graphs[size], self.static_in[size], self.static_out[size] = graph, static_inputs, out
        self.fns[size] = fn
        return out

    def replay(self, size: int, inputs: dict[str, torch.Tensor]) -> Any:
        """Copy ``inputs`` (device tensors, each at most the buffer's length) into the static buffers, pad the
        rest with the buffer's fill convention (already there from capture), and replay."""
        for name, value in inputs.items():
            buf = self.static_in[size][name]
            buf[: value.shape[0]].copy_(value, non_blocking=True)
        if runtime.emulated():
            # The CPU emulation cannot record device work: re-run and write into the captured outputs, which
            # is what a real replay does to them.
            fresh = self.fns[size](**self.static_in[size])
            torch.utils._pytree.tree_map(lambda o, n: o.copy_(n), self.static_out[size], fresh)
        else:
            self.graphs[size].replay()
        return self.static_out[size]

    def patch_host_params(self, size: int, handle: Any, reissue: Callable[[], None], stream: Any) -> None:
        """Re-issue one captured task (e.g. FIA with new host ``actual_seq_lengths_kv``) in place, on
        ``stream``: ``graph_task_update_begin(stream, handle)``, the op call,
        ``graph_task_update_end(stream)``.
        ``handle`` comes from ``graph_task_group_begin/end`` around that op during capture."""
        with self.ns.stream(stream):
            self.ns.graph_task_update_begin(stream, handle)
            reissue()
            self.ns.graph_task_update_end(stream)
