"""Emulated NPU graphs: ``torch.npu.NPUGraph`` capture / replay and the task-group update API, from their
documentation — faithful to what the backend relies on, on the CPU.

Docs: Ascend/pytorch (op-plugin) docs/context ``torch_npu-npu-graph_task_group_begin.md`` (also ``_end``,
``graph_task_update_begin`` / ``_end``; the example there captures ``npu_fused_infer_attention_score.out`` with a
``workspace`` from ``_npu_fused_infer_attention_score_get_max_workspace`` between ``graph_task_group_begin/end``
after ``ExternalEvent.wait/reset`` on the capture stream, then re-issues the op with new
``actual_seq_lengths`` inside ``graph_task_update_begin(update_stream, handle)`` / ``graph_task_update_end`` and
``event.record(update_stream)`` before ``g.replay()``); usage: vllm_ascend/compilation/acl_graph.py
(``update_mla_attn_params``) and vllm_ascend/attention/mla_v1.py (``_forward_decode`` while capturing).

How capture is emulated: inside ``torch.npu.graph(g)`` every aten op is *recorded* (a ``TorchDispatchMode``) and
every emulated torch_npu op is recorded as one task (its CPU body runs unrecorded: it stands for one device
kernel). ``g.replay()`` re-executes the recorded tasks in order on the same tensors — no Python of the caller runs
again — so exactly what a real graph keeps is kept: tensor addresses, shapes, and every host value of capture time
(Python ints, host lists, tensors built from host data). Functional ops write their fresh results into the
capture-time outputs (the graph's pool), in-place ops mutate their captured arguments, view ops are not re-run
(their capture-time views still alias the same storage), ``empty`` allocates nothing. What a real capture rejects
raises :class:`ContractError` here: host reads of device values (``item``/``tolist``/``bool``/...) and ops with
data-dependent output shapes (``nonzero``, boolean indexing, ``bincount``, ``repeat_interleave`` without
``output_size``). Task updates may change host parameters only: every tensor argument of the re-issued op must be
the captured one (same storage, shape, strides, dtype). A replay whose graph waits on an ``ExternalEvent`` that was
not recorded since the graph last reset it raises (on the device it would block: the update was skipped).

Not emulated: anything about timing, streams running concurrently (all work is synchronous), memory pools.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .contract import ContractError, check

aten = torch.ops.aten

_HOST_READ_OPS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::item"}
_DATA_DEPENDENT_OPS = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
                       "aten::unique_consecutive", "aten::bincount", "aten::masked_scatter"}
_EMPTY_OPS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
              "aten::new_empty_strided"}
_HOST_READ_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class _State:
    def __init__(self) -> None:
        self.capturing: NPUGraph | None = None
        self.capture_stream: Any = None
        self.suspended = 0  # > 0 while an emulated torch_npu op's CPU body runs (one device kernel)
        self.group_start: int | None = None
        self.update: list | None = None  # [handle, next task index] between graph_task_update_begin/end


STATE = _State()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _copy_results(captured, fresh) -> None:
    for old, new in zip(_tensors(captured), _tensors(fresh)):
        if old is not new:
            old.copy_(new)


# ---- tasks ----------------------------------------------------------------------------------------------------
def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _tensors(tree)}


class AtenTask:
    """One recorded aten op (composite ops such as ``aten::to`` or ``aten::linear`` may arrive undecomposed under
    inference mode: whether a result aliases an input is therefore read from the storages, not the schema —
    ``to`` returns its input when no conversion is needed and a new tensor otherwise)."""

    def __init__(self, func, args, kwargs, out) -> None:
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out
        schema = func._schema
        mutating = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        outs = _tensors(out)
        aliasing = bool(outs) and _storages(outs) <= _storages((args, kwargs))
        if schema.name in _EMPTY_OPS:
            self.kind = "empty"  # allocation only: no kernel
        elif mutating:
            self.kind = "mutating"  # re-run: mutates its captured arguments
        elif aliasing:
            self.kind = "view"  # the captured view still aliases the (updated) storage
        else:
            self.kind = "functional"  # re-run, result written into the captured output

    def run(self) -> None:
        if self.kind in ("empty", "view"):
            return
        fresh = self.func(*self.args, **self.kwargs)
        if self.func._schema.name.startswith("c10d::"):
            # a captured collective is ordered on the device stream: the next kernel sees its result; gloo's
            # returned Work must be waited for to give the same order
            for item in fresh if isinstance(fresh, (tuple, list)) else (fresh,):
                if hasattr(item, "wait"):
                    item.wait()
            return
        if self.kind == "functional":
            _copy_results(self.out, fresh)


class NpuOpTask:
    """One emulated torch_npu op (one device kernel): re-run with its current (possibly updated) arguments."""

    def __init__(self, name: str, fn, args, kwargs, out) -> None:
        self.name, self.fn, self.args, self.kwargs, self.out = name, fn, args, kwargs, out
        self.updates = 0

    def run(self) -> None:
        STATE.suspended += 1
        try:
            fresh = self.fn(*self.args, **self.kwargs)
        finally:
            STATE.suspended -= 1
        _copy_results(self.out, fresh)


class _EventTask:
    def __init__(self, event: ExternalEvent, kind: str) -> None:
        self.event, self.kind = event, kind

    def run(self) -> None:
        if self.kind == "reset":
            self.event.recorded = False
            return
        check(self.event.recorded,
              "NPUGraph replay: a captured ExternalEvent.wait found no record since the graph last reset the event "
              "(each replay needs its task update: graph_task_update_begin/end then event.record(update_stream)); "
              "on the device the replay would block")


@dataclass
class TaskGroupHandle:
    """What ``graph_task_group_end`` returns: the tasks captured between begin and end."""

    graph: NPUGraph
    tasks: list[NpuOpTask] = field(default_factory=list)


# ---- recording modes ------------------------------------------------------------------------------------------
class _Recorder(TorchDispatchMode):
    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if STATE.suspended:
            return func(*args, **kwargs)
        name = func._schema.name
        check(name not in _HOST_READ_OPS,
              f"NPU graph capture: {name} reads a device value on the host (a sync; the capture would fail)")
        check(name not in _DATA_DEPENDENT_OPS,
              f"NPU graph capture: {name} has a data-dependent output shape (a sync; the capture would fail)")
        if name == "aten::repeat_interleave" and func._overloadname == "Tensor":
            check(kwargs.get("output_size") is not None,
                  "NPU graph capture: repeat_interleave without output_size has a data-dependent shape")
        if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            check(not any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx),
                  "NPU graph capture: boolean indexing has a data-dependent shape")
        out = func(*args, **kwargs)
        self.graph.tasks.append(AtenTask(func, args, kwargs, out))
        return out


class _HostReadGuard(TorchFunctionMode):
    """``tolist``/``numpy``/... read device memory without an aten op: a capture cannot contain them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not STATE.suspended and getattr(func, "__name__", "") in _HOST_READ_METHODS:
            raise ContractError(f"NPU graph capture: Tensor.{func.__name__}() reads device memory on the host")
        return func(*args, **kwargs)


def graph_aware(name: str, fn, device_task: bool = True):
    """Wrap an emulated torch_npu op: recorded as one task while capturing, matched against the handle's task
    (host parameters replaced) between ``graph_task_update_begin/end``, else run. ``device_task=False``: a host-side
    call (e.g. sizing a workspace) that runs at capture and is not part of the graph."""

    def op(*args, **kwargs):
        if STATE.update is not None:
            handle, i = STATE.update
            check(i < len(handle.tasks), f"graph task update: more ops re-issued than the group holds ({name})")
            task = handle.tasks[i]
            check(task.name == name, f"graph task update: re-issued {name}, the group captured {task.name}")
            old, new = _tensors((task.args, task.kwargs)), _tensors((args, kwargs))
            check(len(old) == len(new) and all(_same_tensor(a, b) for a, b in zip(old, new)),
                  f"graph task update of {name}: tensor arguments must be the captured ones (host parameters only)")
            task.args, task.kwargs = args, kwargs
            task.updates += 1
            STATE.update[1] = i + 1
            return task.out
        if STATE.capturing is None or STATE.suspended:
            return fn(*args, **kwargs)
        STATE.suspended += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            STATE.suspended -= 1
        if device_task:
            STATE.capturing.tasks.append(NpuOpTask(name, fn, args, kwargs, out))
        return out

    op.__name__ = name
    op.__wrapped__ = fn
    return op


# ---- the torch.npu graph objects --------------------------------------------------------------------------------
class NPUGraph:
    """``torch.npu.NPUGraph``: filled by ``torch.npu.graph(g)``, ``replay()`` re-executes what was recorded."""

    def __init__(self) -> None:
        self.tasks: list = []
        self.captured = False
        self.num_replays = 0
        self._inference = False

    def pool(self) -> object:
        return ("emulated-pool", id(self))

    def replay(self) -> None:
        check(self.captured, "NPUGraph.replay() before capture")
        check(STATE.capturing is None, "NPUGraph.replay() inside a capture")
        with torch.inference_mode(self._inference):
            for task in self.tasks:
                task.run()
        self.num_replays += 1

    def reset(self) -> None:
        self.tasks, self.captured = [], False

    def num_tasks(self, kind: type | None = None) -> int:
        return sum(kind is None or isinstance(t, kind) for t in self.tasks)


class ExternalEvent:
    """``torch.npu.ExternalEvent``: ``wait``/``reset`` on the capture stream become tasks of the graph;
    ``record`` outside capture marks it recorded (what the captured wait needs at replay)."""

    def __init__(self) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        check(STATE.capturing is None, "ExternalEvent.record inside a capture (record it on the update stream)")
        self.recorded = True

    def wait(self, stream: Any = None) -> None:
        if STATE.capturing is not None:
            check(stream is STATE.capture_stream, "ExternalEvent.wait during capture must name the capture stream")
            STATE.capturing.tasks.append(_EventTask(self, "wait"))
        else:
            check(self.recorded, "ExternalEvent.wait outside a graph on an event never recorded (would block)")

    def reset(self, stream: Any = None) -> None:
        if STATE.capturing is not None:
            check(stream is STATE.capture_stream, "ExternalEvent.reset during capture must name the capture stream")
            STATE.capturing.tasks.append(_EventTask(self, "reset"))
        else:
            self.recorded = False


@contextlib.contextmanager
def capture(graph: NPUGraph, capture_stream: Any):
    check(STATE.capturing is None, "nested NPU graph capture")
    check(not graph.captured, "NPUGraph captured twice (reset() it first)")
    STATE.capturing, STATE.capture_stream = graph, capture_stream
    graph._inference = torch.is_inference_mode_enabled()
    guard, recorder = _HostReadGuard(), _Recorder(graph)
    try:
        with guard, recorder:
            yield
        check(STATE.group_start is None, "graph_task_group_begin without graph_task_group_end in the capture")
        graph.captured = True
    finally:
        STATE.capturing, STATE.capture_stream, STATE.group_start = None, None, None


def task_group_begin(stream: Any) -> None:
    check(STATE.capturing is not None, "graph_task_group_begin outside an NPU graph capture")
    check(stream is STATE.capture_stream, "graph_task_group_begin must name the capturing stream")
    check(STATE.group_start is None, "nested graph_task_group_begin")
    STATE.group_start = len(STATE.capturing.tasks)


def task_group_end(stream: Any) -> TaskGroupHandle:
    check(STATE.capturing is not None and STATE.group_start is not None, "graph_task_group_end without begin")
    check(stream is STATE.capture_stream, "graph_task_group_end must name the capturing stream")
    tasks = STATE.capturing.tasks[STATE.group_start:]
    STATE.group_start = None
    check(len(tasks) > 0 and all(isinstance(t, NpuOpTask) for t in tasks),
          "a task group must hold the updatable torch_npu op(s) only")
    return TaskGroupHandle(STATE.capturing, list(tasks))


def task_update_begin(stream: Any, handle: TaskGroupHandle, current_stream: Any) -> None:
    check(STATE.capturing is None, "graph_task_update_begin during a capture")
    check(STATE.update is None, "nested graph_task_update_begin")
    check(isinstance(handle, TaskGroupHandle), "graph_task_update_begin needs a handle from graph_task_group_end")
    check(stream is current_stream, "graph_task_update_begin(stream, ...) must run with that stream current "
          "(inside torch.npu.stream(update_stream), as documented)")
    STATE.update = [handle, 0]


def task_update_end(stream: Any) -> TaskGroupHandle:
    check(STATE.update is not None, "graph_task_update_end without begin")
    handle, n = STATE.update
    STATE.update = None
    check(n == len(handle.tasks), f"graph task update re-issued {n} of the group's {len(handle.tasks)} ops")
    return handle
