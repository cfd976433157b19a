"""NPU graph capture and replay per total_q size (``torch.npu.NPUGraph``), with device-side step metadata and the
fused attention's host lengths re-issued before every replay (``graph_task_update_begin/end``).

**Verified by the CPU contract emulation only** (parity_tests/npu_emulation/graphs.py records and re-executes the
captured device work); nothing here has run on an NPU.

What is graphed: the worker's decode forward (``worker/decode_graphs.py``: one graph per decode size ``S`` from
``hal.graph_sizes``, static input buffers, padding rows on block 0), when ``EngineConfig.enable_graphs=True`` (off
by default on this backend: ``Backend.graphs_by_default`` stays False until graphs are verified on an NPU).
Everything a step changes flows in through static device buffers refreshed before replay — token ids, positions,
slot mapping, block tables, ``seqlens_q/k`` (ZOS-corrected on the device by ``zos_fixup``) and, for the fused
attention, this runner's own per-step metadata buffer (below) — so ZOS corrections need no host patching: the true
key lengths stay on the device and ``ops_mla.mla_attention_fia_graph`` hides the rejected-draft keys by the same
device-side query shift as the eager path.

**Unavoidable host patching.** ``npu_fused_infer_attention_score`` takes ``actual_seq_lengths`` (TND: cumulative
query ends) and ``actual_seq_lengths_kv`` as *host* int lists, baked into the captured task. As the documentation
and vllm-ascend do, each FIA call is captured in its own task group (``.out`` form with a workspace from
``_npu_fused_infer_attention_score_get_max_workspace``, after ``ExternalEvent.wait/reset`` on the capture stream)
and, before every replay, re-issued on an update stream with the step's lists between
``torch.npu.graph_task_update_begin(update_stream, handle)`` and ``graph_task_update_end(update_stream)``, then
``event.record(update_stream)`` releases the captured wait. Docs: Ascend/pytorch (op-plugin) docs/context
``torch_npu-npu-graph_task_group_begin.md`` (and ``_end``, ``graph_task_update_begin/_end``); usage:
vllm_ascend/compilation/acl_graph.py ``update_mla_attn_params``, vllm_ascend/attention/mla_v1.py
``_forward_decode`` (capturing branch). The lists are the CPU's own (exact query lengths, optimistic key lengths
under ZOS): no device value is read. Where vllm-ascend synchronises the host before replay (so an update cannot
overtake the previous replay of the same graph), we make the update stream wait for the current stream on the
device instead (``update_stream.wait_stream``), keeping the launch path sync-free — unverified on hardware.

**Static FIA layout per graph.** A graph fixes every tensor shape, so the FIA query rows ``R`` and the pseudo-request
("piece") count ``P`` of each size are fixed capacities; a step's pieces (``ops_mla.plan_fia`` on its host lengths,
padding rows included) are packed into them and the slack goes to dummy pieces on block 0 (1..16 rows each, as many
keys as rows, outputs dropped) — every piece keeps 1..16 queries and at least as many keys. With ``k`` = most drafts
per row (the shortfall bound), ``S`` tokens and the 16-query window: ``k = 0`` gives ``P = R = S`` (one row per
token, ``sparse_mode=0``, no mask); ``k > 0`` gives ``M = S*k``, ``D = ceil(M/15)``, ``P = S + D``,
``R = S + M + D`` (``sparse_mode=3`` with the 2048x2048 mask). The price: up to ``(k + 1)``x query rows per graph
versus ``S`` (zero rows and short dummy pieces: compute, not KV traffic). Per step, the packed plan's token
placement (row of each token before the shift, its request, its piece's padding), each row's host key length and
each piece's block-table row travel in one int64 buffer (``[4*S + P]``) by one host-to-device copy, ordered on the
stream after the previous replay. Torchair's tiling-sink mode takes the lengths as device tensors instead — the
route to drop the patching.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer_npu.hal.graph_runner import GraphRunner

from . import ops_mla, runtime
from .ops_mla import FiaTask


@dataclass(frozen=True)
class FiaGraphLayout:
    """Static FIA shapes of the graph of ``size`` tokens (module docstring)."""

    size: int
    max_drafts: int
    max_q: int
    pieces: int
    rows: int

    @property
    def single_row(self) -> bool:
        """Every piece is one query row (no drafts): ``sparse_mode=0`` without a mask, as in eager."""
        return self.max_drafts == 0

    @classmethod
    def for_size(cls, size: int, max_drafts: int, max_q: int) -> FiaGraphLayout:
        if max_drafts < 0 or max_drafts > max_q - 1:
            raise ValueError(f"NPU decode graphs take 0..{max_q - 1} drafts per row with FIA's {max_q}-query "
                             f"window (a shortfall of k needs k padding rows), got {max_drafts}")
        if max_drafts == 0:
            return cls(size, 0, max_q, size, size)
        m = size * max_drafts
        d = max(1, math.ceil(m / (max_q - 1)))
        return cls(size, max_drafts, max_q, size + d, size + m + d)

    def plan_step(self, host, kernel_bound: int | None) -> FiaStepPlan:
        """Pack a step (``HostLengths`` of its real rows, or None: all padding) into this layout."""
        s = self.size
        if host is None:
            q, k, exact, bound = [1] * s, [1] * s, True, None
        else:
            q, k = [int(v) for v in host.seqlens_q], [int(v) for v in host.seqlens_k]
            t = sum(q)
            if t > s or len(q) > s:
                raise ValueError(f"a step of {t} tokens in {len(q)} rows does not fit the graph of {s}")
            if any(v > self.max_drafts + 1 for v in q):
                raise ValueError(f"a row verifies more than {self.max_drafts} drafts: {q}")
            q, k = q + [1] * (s - t), k + [1] * (s - t)  # DecodeGraphs' padding rows: q = k = 1 on block 0
            exact = bool(host.seqlens_k_exact)
            bound = host.max_kv_shortfall if host.max_kv_shortfall is not None else kernel_bound
            bound = self.max_drafts if bound is None else int(bound)
            if not exact and bound > self.max_drafts:
                raise ValueError(f"shortfall bound {bound} exceeds the graph's {self.max_drafts}")
        if exact or self.max_drafts == 0:
            plan = ops_mla.plan_fia(q, k, self.max_q, True)
        else:
            plan = ops_mla.plan_fia(q, k, self.max_q, False, bound)
        ends, kv, src = list(plan.ends), list(plan.kv_lens), list(plan.src)
        used_pieces, used_rows = len(ends), plan.rows
        spare_pieces, spare_rows = self.pieces - used_pieces, self.rows - used_rows
        if len(plan.dest) != s or not (0 <= spare_pieces <= spare_rows <= self.max_q * spare_pieces):
            raise AssertionError(f"FIA graph layout {self} cannot hold {used_pieces} pieces / {used_rows} rows")
        for i in range(spare_pieces):  # dummy pieces on the zero block-table row (index s): block 0
            n = spare_rows // spare_pieces + (1 if i < spare_rows % spare_pieces else 0)
            ends.append(ends[-1] + n if ends else n)
            kv.append(n)
            src.append(s)
        k_row = k + [0] * (s - len(k))
        meta = [*plan.dest, *plan.token_req, *plan.piece_pad, *k_row, *src]
        return FiaStepPlan(ends=ends, kv_lens=kv, meta=meta, real_rows=used_rows)


@dataclass
class FiaStepPlan:
    ends: list[int]  # actual_seq_lengths (TND cumulative query ends), len == layout.pieces, last == layout.rows
    kv_lens: list[int]  # actual_seq_lengths_kv (host; optimistic under ZOS)
    meta: list[int]  # [dest(S) | token_req(S) | piece_pad(S) | host key length per row(S) | piece row(P)]
    real_rows: int  # FIA rows before the dummy pieces


@dataclass
class FiaGraphState:
    """Per size: the static layout, the device metadata buffer, the captured FIA tasks and the current plan."""

    layout: FiaGraphLayout
    meta: torch.Tensor  # int64 [4*S + P] on the device (static: the graph reads it)
    plan: FiaStepPlan | None = None
    tasks: list[FiaTask] = field(default_factory=list)
    workspace: torch.Tensor | None = None
    pending: bool = False  # a plan was set since the last replay: its lists must be issued before replaying

    def views(self) -> dict[str, torch.Tensor]:
        s, p = self.layout.size, self.layout.pieces
        m = self.meta
        return {"dest": m[:s], "token_req": m[s:2 * s], "piece_pad": m[2 * s:3 * s], "k_host": m[3 * s:4 * s],
                "piece_row": m[4 * s:4 * s + p]}


class NpuGraphRunner(GraphRunner):
    """``hal.graph_runner.GraphRunner`` on ``torch.npu.NPUGraph``: capture ``fn(**static_inputs)`` once per size,
    patch FIA's host lengths per step (``set_step_host_lengths``), replay. Not run on an NPU (module docstring)."""

    def __init__(self, device_index: int = 0, kernels=None, device: torch.device | None = None) -> None:
        super().__init__()
        self.ns = runtime.npu_namespace()
        self.device_index = device_index
        self.kernels = kernels
        self.device = device if device is not None else torch.device(runtime.device_type(), device_index)
        self.graphs: dict[int, Any] = {}
        self.fia: dict[int, FiaGraphState] = {}
        self.pool = None
        self._update_stream = None
        self.num_task_updates = 0

    # ---- host lengths -------------------------------------------------------------------------------------
    def _max_q(self) -> int:
        lim = getattr(self.kernels, "limits", None) or (self.kernels._lim() if self.kernels is not None else None)
        return int(lim.fia_max_q_per_request) if lim is not None else 16

    def _state(self, size: int, max_drafts: int) -> FiaGraphState:
        state = self.fia.get(size)
        if state is None or state.layout.max_drafts != max_drafts:
            if size in self.graphs:
                raise RuntimeError(f"graph of size {size} was captured for {state.layout.max_drafts} drafts")
            layout = FiaGraphLayout.for_size(size, max_drafts, self._max_q())
            meta = torch.zeros(4 * size + layout.pieces, dtype=torch.int64, device=self.device)
            state = self.fia[size] = FiaGraphState(layout, meta)
        return state

    def set_step_host_lengths(self, size: int, host: Any, max_drafts: int) -> None:
        """Plan the step into the size's static FIA layout, copy its device metadata into the static buffer
        (host-to-device, queued on the current stream after the previous replay) and keep its host lists for the
        task update issued right before the replay. Reads nothing from the device."""
        state = self._state(size, max_drafts)
        bound = getattr(self.kernels, "kv_shortfall_bound", None)
        state.plan = state.layout.plan_step(host, bound)
        src = torch.tensor(state.plan.meta, dtype=torch.int64)
        if self.device.type == "cpu":
            state.meta.copy_(src)
        else:  # pinned staging: an async copy that does not block the host
            state.meta.copy_(src.pin_memory(), non_blocking=True)
        state.pending = True

    def _issue(self, state: FiaGraphState) -> None:
        """Re-issue every captured FIA task with the current plan's host lists (vllm-ascend's
        ``update_mla_attn_params``; doc: torch_npu-npu-graph_task_group_begin.md)."""
        ns, npu = self.ns, runtime.load()
        if self._update_stream is None:
            self._update_stream = ns.Stream()
        stream = self._update_stream
        stream.wait_stream(ns.current_stream())  # after the previous replay of this graph, on the device
        lists = {"actual_seq_lengths": list(state.plan.ends), "actual_seq_lengths_kv": list(state.plan.kv_lens)}
        with ns.stream(stream):
            for task in state.tasks:
                ns.graph_task_update_begin(stream, task.handle)
                npu.npu_fused_infer_attention_score.out(*task.args, **{**task.kwargs, **lists})
                ns.graph_task_update_end(stream)
                task.event.record(stream)
                self.num_task_updates += 1
        state.pending = False

    # ---- capture / replay ---------------------------------------------------------------------------------
    def pick(self, total_q: int) -> int | None:
        """Smallest captured size >= ``total_q`` (None: run eagerly)."""
        fits = [s for s in self.graphs if s >= total_q]
        return min(fits) if fits else None

    def capture(self, size: int, fn: Callable[..., Any], static_inputs: dict[str, torch.Tensor]) -> Any:
        if size not in self.fia:  # no step handed over (a caller outside DecodeGraphs): all-padding plan
            self.set_step_host_lengths(size, None, 0)
        state = self.fia[size]
        ns = self.ns
        # Capturing may synchronise on purpose: lift the launch path's sync debug mode for it (as on CUDA).
        previous = ns.get_sync_debug_mode() if hasattr(ns, "get_sync_debug_mode") else None
        if previous is not None:
            ns.set_sync_debug_mode(0)
        token = ops_mla.enter_graph(state)
        try:
            # Warm-up on a side stream: lazy allocations, op compilation and the FIA plan happen uncaptured.
            side = ns.Stream()
            side.wait_stream(ns.current_stream())
            with ns.stream(side):
                fn(**static_inputs)
            ns.current_stream().wait_stream(side)
            state.tasks, state.workspace = [], None
            graph = ns.NPUGraph()
            with ns.graph(graph, pool=self.pool):
                out = fn(**static_inputs)
        finally:
            ops_mla.exit_graph(token)
            if previous is not None:
                ns.set_sync_debug_mode(previous)
        if self.pool is None:
            self.pool = graph.pool()  # later (smaller) graphs share the memory pool
        self.graphs[size], self.static_in[size], self.static_out[size] = graph, static_inputs, out
        state.pending = True  # the captured waits need a record: issue the lists before the first replay
        self.num_captures += 1
        return out

    def replay(self, size: int) -> Any:
        """Issue the step's FIA host lists (task updates), then replay on the static buffers' contents (their
        owner writes them: ``DecodeGraphs`` keeps a record of what they hold)."""
        state = self.fia.get(size)
        if state is not None and state.tasks:
            if not state.pending:
                raise RuntimeError(f"graph of size {size}: set_step_host_lengths must precede every replay (the "
                                   "captured fused attention needs this step's host lengths)")
            self._issue(state)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.static_out[size]
