"""Worker: the single entry of every step, in the seed's four phases (§4.2, §6.2).

``execute_model_step`` always does:

1. launch the forward of step N (no waiting);
2. post-process step N-1 if it was deferred — the only place that waits (on N-1's sample-end event);
3. launch sampling / draft verification and drafting of step N;
4. post-process N at once for prefill steps or with zero-overhead scheduling (ZOS) off; a ZOS decode step is kept
   and post-processed by the next call, so the CPU schedules N+1 while the device still runs N.

Under ZOS the scheduler plans N+1 before N's results are known. Everything a row needs from N lives in per-slot
device buffers (``SlotState``): the row's first input token, its drafts and their confidences, and the
``seqlens_k`` correction; ``zos_fixup`` corrects the lengths and re-splits the drafts on the device. The launch
path runs under ``backend.forbid_sync()``. The CPU backend runs the identical code, only without overlap, so ZOS on
and off produce identical tokens.

The phases live in mixins over the worker's state: ``ForwardLaunch`` (``forward_launch.py``, phase 1),
``SampleLaunch`` (``sample_launch.py``, phase 3 and drafting), ``StepReadback`` (``step_readback.py``, phases 2 and
4) and ``DeviceTransfers`` (``device_transfers.py``, the copies that never wait). This file builds the worker (decode
graphs, kernel warm-up) and runs the phases in order.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from deepinfer_npu import envs
from deepinfer_npu.hal.graph_runner import GraphRunner
from deepinfer_npu.spec.drafter import Drafter
from deepinfer_npu.worker.decode_graphs import DecodeGraphs, decode_graph_max_tokens
from deepinfer_npu.worker.device_transfers import DeviceTransfers
from deepinfer_npu.worker.forward_launch import ForwardLaunch
from deepinfer_npu.worker.kernel_warmup import build_kernel_warmup_plan
from deepinfer_npu.worker.model_runner import ModelRunner
from deepinfer_npu.worker.sample_launch import SampleLaunch
from deepinfer_npu.worker.slot_state import SlotState
from deepinfer_npu.worker.step_io import DeviceStepState, StepPlan, StepRequests, StepResult
from deepinfer_npu.worker.step_readback import StepReadback
from deepinfer_npu.worker.step_watchdog import StepWatchdog

logger = logging.getLogger(__name__)


DUMMY_SEQ_ID = -1  # the padding sequence of a dummy step (no request has it)
# graph_capture="auto" captures every graph at start-up up to this many (decode sizes 1, 2, 4, then every 8 up to
# 360 tokens a step: max_num_seqs 256 without drafts is 35), else each at its first use
STARTUP_CAPTURE_MAX_GRAPHS = 48


class Worker(ForwardLaunch, SampleLaunch, StepReadback, DeviceTransfers):
    """The step: ``execute_model_step`` (the four phases), ``execute_dummy_step``, ``flush``."""

    def __init__(self, runner: ModelRunner, backend, zero_overhead_scheduling: bool, num_state_slots: int,
                 drafter: Drafter | None = None, varlen: bool = False) -> None:
        self.runner = runner
        self.backend = backend
        self.kernels = backend.kernels
        self.device = runner.device
        self.zos = zero_overhead_scheduling
        self.drafter = drafter
        self.k = drafter.num_speculative_tokens if drafter is not None else 0
        self.varlen = varlen and drafter is not None
        self.slots = SlotState(num_state_slots, self.k, self.device)
        self.prev: DeviceStepState | None = None  # deferred ZOS decode step awaiting post-processing
        # Called with the results of each step that has a constrained row as soon as they are post-processed, before
        # the next sampling is launched (the engine advances structured-output grammars there).
        self.result_listener = None
        self.step_watchdog = StepWatchdog(envs.STEP_TIMEOUT, device=str(self.device))  # the step's wait, bounded
        self._decode_sampling_cache: tuple | None = None  # _decode_sampling_inputs' last batch
        self.graphs = self._build_graphs()  # the decode-graph plumbing; nothing captured yet
        # Every kernel variant the steps can reach, compiled now: before any capture, and before the first step
        # (which a stall of seconds per TileLang configuration would otherwise land in). None: kernel_warmup off.
        self.kernel_warmup: str | None = self._warm_up_kernels()
        if self.graphs is not None and self._capture_at_startup():
            self._capture_graphs()
        self.graph_steps = 0  # decode steps run from a captured graph
        # Set to a list to time steps on the device: each launched step appends ``(is_prefill, start, end)``
        # timing events, start before its first device op, end with its sample-end event (benchmarks/bench_zos.py).
        self.step_events: list | None = None

    def _build_graphs(self) -> DecodeGraphs | None:
        """``EngineConfig.enable_graphs`` and a backend graph runner -> the decode-graph plumbing, else None."""
        cfg = self.runner.config
        requested = getattr(cfg, "enable_graphs", False)
        if requested is None:  # auto: the backend's default
            requested = bool(getattr(self.backend, "graphs_by_default", False))
            explicit = False
        else:
            explicit = True
        if not requested:
            return None
        if getattr(cfg, "quantization", None) is not None:  # a quantised op's reference path may read host values
            mc = self.runner.model_config
            why = self.kernels.quantization_capture_refusal(
                cfg.quantization, hidden_size=mc.hidden_size,
                moe_intermediate_size=mc.moe_intermediate_size if mc.n_routed_experts else 0)
            if why is not None:  # a warning even under the default: eager decode is several times slower
                logger.warning("decode graphs are off%s: %s", "" if explicit else " (the backend's default is on)",
                               why)
                return None
        if self.drafter is not None:  # the drafter's propose gets graphs of its own (asked first: its own pool)
            draft_runner = self.backend.graph_runner()
            if isinstance(draft_runner, GraphRunner) and self.drafter.enable_graphs(draft_runner, cfg.max_num_seqs):
                logger.info("drafter %s: propose replayed from graphs", self.drafter.name)
        graph_runner = self.backend.graph_runner()
        if not isinstance(graph_runner, GraphRunner):
            if explicit:
                logger.warning("enable_graphs: backend %s has no graph runner for the worker; decode runs eagerly",
                               self.backend.name)
            return None
        max_tokens = decode_graph_max_tokens(cfg, self.k)
        capture = self.drafter.capture_layer_ids if self.drafter is not None else None
        hook = None
        if self.drafter is not None and getattr(self.backend, "drafter_hook_in_graphs", False):
            hook = self.drafter.main_forward_hook_in_graph()
        return DecodeGraphs(self.runner, graph_runner, self.k, max_tokens, capture, extra_width=2 * self.k,
                            drafter_hook=hook)

    def _capture_at_startup(self) -> bool:
        """``graph_capture``: "startup" always, "lazy" never, "auto" when the decode and propose graphs number at
        most ``STARTUP_CAPTURE_MAX_GRAPHS`` (about 90 ms each on an H200 at V2-Lite shape: a few seconds at start-up,
        where an offline run whose batch sweeps the sizes would otherwise capture them inside the run)."""
        mode = self.runner.config.graph_capture
        if mode != "auto":
            return mode == "startup"
        propose_graphs = getattr(self.drafter, "propose_graphs", None)
        count = len(self.graphs.sizes) + (len(propose_graphs.sizes) if propose_graphs is not None else 0)
        at_startup = count <= STARTUP_CAPTURE_MAX_GRAPHS
        logger.info("decode graphs: %d sizes, captured %s (graph_capture='auto': at start-up up to %d)", count,
                    "at start-up" if at_startup else "at first use", STARTUP_CAPTURE_MAX_GRAPHS)
        return at_startup

    def _capture_graphs(self) -> None:
        """Capture every decode graph (and the drafter's propose graphs) now (:meth:`_capture_at_startup`)."""
        self.graphs.capture_all()
        propose_graphs = getattr(self.drafter, "propose_graphs", None)
        if propose_graphs is not None:
            propose_graphs.capture_all()

    def _warm_up_kernels(self) -> str | None:
        """``KernelSet.warmup`` once, with the shapes this engine's steps can have (``EngineConfig.kernel_warmup``);
        -> its summary (the CUDA kernel set logs its own progress), None when turned off."""
        if not self.runner.config.kernel_warmup:
            return None
        varlen = self.varlen and self.zos and self.backend.supports_device_resplit  # as _launch_forward's re-split
        try:
            plan = build_kernel_warmup_plan(self.runner, k=self.k, varlen=varlen, drafter=self.drafter,
                                            graphs=self.graphs)
        except Exception as e:  # noqa: BLE001 - an unusual model layout must not stop start-up: kernels compile lazily
            logger.warning("kernel warm-up skipped: building its plan failed: %s: %s", type(e).__name__, e)
            return f"skipped: building the plan failed: {type(e).__name__}: {e}"
        summary = self.kernels.warmup(plan)
        logger.debug("kernel warm-up: %s", summary)
        return summary

    @property
    def has_pending_step(self) -> bool:
        return self.prev is not None

    def execute_model_step(self, plan: StepPlan, reqs: StepRequests) -> list[StepResult]:
        results: list[StepResult] = []
        t0 = time.perf_counter()
        with self.backend.forbid_sync():  # 1. launch forward N
            step = self._launch_forward(plan, reqs)
        t1 = time.perf_counter()
        if self.prev is not None:  # 2. post-process N-1 (waits on its sample-end event only)
            results.append(self._post_process(self.prev))
            self.prev = None
        t2 = time.perf_counter()
        with self.backend.forbid_sync():  # 3. launch sampling / verification + drafting of N
            self._launch_sample(step, reqs)
        t3 = time.perf_counter()
        step.t_forward_ms, step.t_sample_ms = (t1 - t0) * 1e3, (t3 - t2) * 1e3
        if plan.is_prefill or not self.zos:  # 4. post-process now, or keep N for the next call
            results.append(self._post_process(step))
        else:
            self.prev = step
        return results

    def execute_dummy_step(self, is_prefill: bool, reqs: StepRequests) -> list[StepResult]:
        """One padding row through the whole step (forward, sampling, drafting): an expert-parallel rank with
        nothing scheduled runs it so that its MoE collectives pair with the other ranks' real step. The row
        writes only the reserved block 0 and the dummy state slot 0; its result is dropped by the engine."""
        return self.execute_model_step(dummy_plan(is_prefill), reqs)

    def flush(self) -> list[StepResult]:
        """Post-process a deferred step when no further step is launched."""
        if self.prev is None:
            return []
        state, self.prev = self.prev, None
        return [self._post_process(state)]


def dummy_plan(is_prefill: bool) -> StepPlan:
    """A one-token step for the padding sequence ``DUMMY_SEQ_ID`` on block 0 and state slot 0."""
    one = np.ones(1, dtype=np.int32)
    empty = np.zeros((0, 2), dtype=np.int32)
    return StepPlan(step_id=-1, is_prefill=is_prefill, seq_ids=np.full(1, DUMMY_SEQ_ID, dtype=np.int64),
                    seqlens_q=one, seqlens_k=one.copy(), is_last_chunk=np.ones(1, dtype=np.bool_),
                    input_ids=np.zeros(1, dtype=np.int32), block_tables=np.zeros((1, 1), dtype=np.int32),
                    state_slots=np.zeros(1, dtype=np.int32), clone_blocks=empty, clone_states=empty.copy(),
                    zero_states=np.zeros(0, dtype=np.int32))
