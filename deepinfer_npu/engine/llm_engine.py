"""LLMEngine: requests in, RequestOutputs out, one ``step()`` at a time (vLLM's offline engine API).

Python owns requests, tokenization, stop checks and outputs; the C++ ``Scheduler`` owns sequences, blocks and the
policy; the ``Worker`` owns the step. Bad input raises ``ValueError`` at ``add_request`` and never disturbs the
requests already running; a request the scheduler cannot serve (prompt longer than ``max_model_len``, more blocks
than the pool) finishes with ``finish_reason="ignored"`` and a message naming the limit.

Thread safety: every public method takes ``self.lock`` (re-entrant), so threads may share one engine. Each
request's outputs go to whoever added it (``engine/output_router.py``), whichever thread runs the step.

This file builds the engine and holds its state; the behaviour is in three mixins over that state:
``RequestAdmission`` (``request_admission.py``: add, validate, fork), ``StepLoop`` (``step_loop.py``: schedule,
launch, lockstep with other ranks) and ``OutputProcessing`` (``output_processing.py``: results, finishing, outputs).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable

import numpy as np

from deepinfer_npu import _core
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.engine.engine_stats import SpecCounters, new_counters, stats_report
from deepinfer_npu.engine.generation_config import load_generation_defaults
from deepinfer_npu.engine.grammar_requests import GrammarRequests
from deepinfer_npu.engine.output_processing import OutputProcessing
from deepinfer_npu.engine.output_router import OutputRouter
from deepinfer_npu.engine.outputs import RequestOutput
from deepinfer_npu.engine.request import Request
from deepinfer_npu.engine.request_admission import RequestAdmission
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.engine.step_loop import StepLoop
from deepinfer_npu.engine.tokenizer import load_tokenizer
from deepinfer_npu.hal.registry import get_backend
from deepinfer_npu.model_executor.model_config import DeepseekModelConfig
from deepinfer_npu.spec.factory import build_drafter
from deepinfer_npu.spec.varlen import VarlenController
from deepinfer_npu.worker.kernel_warmup import expected_kernel_warmup_plan
from deepinfer_npu.worker.model_runner import ModelRunner
from deepinfer_npu.worker.worker import Worker

logger = logging.getLogger(__name__)


class LLMEngine(RequestAdmission, StepLoop, OutputProcessing):
    """Offline engine. ``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        config.check_model_dir()
        self.backend = get_backend(config.backend)
        if config.max_num_batched_tokens is None:  # the backend's own step size (hal/backend.py)
            config.max_num_batched_tokens = self.backend.default_max_num_batched_tokens
        self.model_config = DeepseekModelConfig.from_pretrained(config.model_dir)
        config.check_weights()  # before the runner allocates weights and KV cache
        self.generation_defaults = load_generation_defaults(config.model_dir)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit} "
                f"({config.model_dir / 'config.json'})"
            )
        self.max_model_len = config.max_model_len or limit
        self.tokenizer = load_tokenizer(config.model_dir)
        self.runner = ModelRunner(config, self.backend, self.model_config, on_model_built=self._start_kernel_builds)
        sched_cfg = self._scheduler_config()
        self.scheduler = _core.Scheduler(sched_cfg)
        self.drafter = build_drafter(config, self.runner)
        self.worker = Worker(self.runner, self.backend, config.zero_overhead_scheduling,
                             num_state_slots=sched_cfg.num_state_slots, drafter=self.drafter,
                             varlen=config.varlen_verification)
        self.varlen = None
        if self.drafter is not None and config.varlen_verification:
            self.varlen = VarlenController(self, sched_cfg)
        self.vocab_size = self.model_config.vocab_size
        self.lock = threading.RLock()
        self._router = OutputRouter()
        self._stepping_thread = threading.get_ident()
        self._step_group = None  # a CPU process group: steps in lockstep with other data-parallel ranks
        self.last_step_had_work = True

        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._grammars = GrammarRequests(self.tokenizer, self.vocab_size, self._eos_ids)
        self._grammars.by_seq = self._by_seq
        self.worker.result_listener = self._grammars.advance
        self._pending_outputs: list[RequestOutput] = []
        self._next_seq_id = 0
        self._seed_rng = np.random.default_rng(config.seed)
        self._step_id = 0
        self.stats = new_counters()
        self.spec_counters = SpecCounters(config.nextn)

    def _start_kernel_builds(self, runner: ModelRunner) -> None:
        """``ModelRunner``'s hook before the weights load: the kernel set starts building what the worker's
        warm-up will need (``KernelSet.start_early_warmup``, from the plan the model as built implies), so that
        the load and the builds overlap. Best effort: the warm-up builds whatever this missed."""
        if not self.config.kernel_warmup:
            return
        try:
            plan = expected_kernel_warmup_plan(runner)
        except Exception as e:  # noqa: BLE001 - an unusual model layout: the warm-up lists its own plan later
            logger.info("early kernel builds not started: the expected plan failed: %s: %s", type(e).__name__, e)
            return
        self.backend.kernels.start_early_warmup(plan)

    def _scheduler_config(self):
        c = self.config
        cfg = _core.SchedulerConfig()
        cfg.max_num_seqs = c.max_num_seqs
        cfg.max_num_batched_tokens = c.max_num_batched_tokens
        cfg.max_model_len = self.max_model_len
        cfg.block_size = c.block_size
        cfg.num_kv_blocks = self.runner.num_kv_blocks
        cfg.state_slot_ratio = c.state_slot_ratio
        cfg.nextn = c.nextn
        cfg.max_num_prompts = c.max_num_prompts
        cfg.prefill_max_sum_seqlen_k = c.prefill_max_sum_seqlen_k
        cfg.prefill_attempt_interval = c.prefill_attempt_interval
        cfg.prefill_any_attempt_interval = c.prefill_any_attempt_interval
        cfg.stop_preempted_request = c.stop_preempted_request
        cfg.enable_chunked_prefill = c.enable_chunked_prefill
        cfg.validate()
        return cfg

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's ``generation_config.json`` defaults (temperature, top_k, top_p),
        as vLLM's ``LLM.get_default_sampling_params``."""
        return SamplingParams(**self.generation_defaults)

    @functools.cached_property
    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        eos = self.model_config.eos_token_id
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
        return sorted(i for i in ids if 0 <= i < self.vocab_size)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort one or several requests in any state; their final output (``finish_reason="abort"``) is
        returned by the next ``step()``. Unknown ids are ignored, as in vLLM."""
        if isinstance(request_id, (str, bytes)) or not isinstance(request_id, Iterable):
            ids = [request_id]
        else:
            ids = list(request_id)
        with self.lock:
            for rid in ids:
                req = self._requests.get(str(rid))
                if req is None or req.done:
                    continue
                for member in (req.group.members if req.group is not None else [req]):
                    if not member.finished:
                        if member.grammar_future is not None:  # never scheduled: still compiling
                            self._grammars.discard(member)
                        else:
                            self.scheduler.abort(member.seq_id)
                        self._finish(member, "abort", message="aborted by the caller", notify_scheduler=False)
                self.stats["aborted_requests"] += 1
                self._pending_outputs.append(self._make_output(req))

    def has_unfinished_requests(self) -> bool:
        """True while a request runs, a step is in flight, or outputs wait for ``step()`` to return them."""
        with self.lock:
            return (bool(self._requests) or bool(self._pending_outputs) or self.worker.has_pending_step
                    or self._router.has_kept())

    def get_num_unfinished_requests(self) -> int:
        with self.lock:
            return len(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        with self.lock:
            return list(self._requests)

    def get_stats(self) -> dict:
        with self.lock:
            return stats_report(self)

    def prepare_structured_output(self):
        """Build the grammar compiler (xgrammar's import, the tokenizer's vocabulary for it) on a thread, off the
        request path (``GrammarRequests.prepare``) -> the thread, or None where structured output cannot run."""
        return self._grammars.prepare()

    @property
    def structured_output_ready(self) -> bool:
        return self._grammars.ready

