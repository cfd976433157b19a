"""LLMEngine: requests in, RequestOutputs out, one ``step()`` at a time (vLLM's offline engine API).

Python owns requests, tokenization, stop checks and outputs; the C++ ``Scheduler`` owns sequences, blocks and the
policy; the ``Worker`` owns the step. Bad input raises ``ValueError`` at ``add_request`` and never disturbs the
requests already running; a request the scheduler cannot serve (prompt longer than ``max_model_len``, more blocks
than the pool) finishes with ``finish_reason="ignored"`` and a message naming the limit.

Thread safety: every public method takes ``self.lock`` (re-entrant), so threads may share one engine. Each
request's outputs go to whoever added it (``engine/output_router.py``), whichever thread runs the step.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable

import numpy as np

from deepinfer_npu import _core
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.distributed.step_vote import agree_decode_size, confirm_step, vote_prefill
from deepinfer_npu.engine.engine_stats import SpecCounters, new_counters, stats_report
from deepinfer_npu.engine.generation_config import load_generation_defaults
from deepinfer_npu.engine.grammar_requests import GrammarRequests
from deepinfer_npu.engine.input_processing import build_step_requests
from deepinfer_npu.engine.output_router import OutputRouter
from deepinfer_npu.engine.outputs import CompletionOutput, RequestOutput, make_logprobs_dict
from deepinfer_npu.engine.request import Request
from deepinfer_npu.engine.request_admission import RequestAdmission
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.engine.tokenizer import load_tokenizer
from deepinfer_npu.hal.registry import get_backend
from deepinfer_npu.model_executor.model_config import DeepseekModelConfig
from deepinfer_npu.spec.factory import build_drafter
from deepinfer_npu.spec.varlen import VarlenController
from deepinfer_npu.worker.model_runner import ModelRunner
from deepinfer_npu.worker.step_io import StepPlan, StepRequests, StepResult
from deepinfer_npu.worker.worker import DUMMY_SEQ_ID, Worker, dummy_plan

logger = logging.getLogger(__name__)

_SCHEDULER_FINISH_REASONS = {
    _core.SeqStatus.FINISHED_IGNORED: "ignored",
    _core.SeqStatus.FINISHED_PREEMPTED: "preempted",
    _core.SeqStatus.FINISHED_ABORTED: "abort",
}
_FINISH_STATUS = {"stop": _core.SeqStatus.FINISHED_STOPPED, "length": _core.SeqStatus.FINISHED_LENGTH}


class LLMEngine(RequestAdmission):
    """Offline engine. ``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        config.check_model_dir()
        self.backend = get_backend(config.backend)
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
        self.runner = ModelRunner(config, self.backend, self.model_config)
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

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the outputs of requests added without an output sink that
        progressed or finished (also those produced by steps other threads ran since the last call)."""
        with self.lock:
            return self._router.route(self._step(), for_step_caller=True)

    def step_for_sinks(self) -> None:
        """Run one step for callers waiting on output sinks (``LLM.generate``): sink outputs go to their sinks,
        the outputs of sink-less requests are kept for the next ``step()``."""
        with self.lock:
            self._router.route(self._step(), for_step_caller=False)

    def attach_step_group(self, group) -> None:
        """Run every step in lockstep with the other data-parallel ranks of ``group`` (a gloo CPU group): the
        two-round vote decides the step kind for all, and a rank with nothing scheduled runs a dummy step so the
        expert-parallel collectives inside the model pair up (``distributed/step_vote.py``)."""
        self._step_group = group

    def _step(self) -> list[RequestOutput]:
        if self._step_group is not None:
            return self._step_lockstep()
        if threading.get_ident() != self._stepping_thread:
            self._bind_device_to_thread()
        t0 = time.perf_counter()
        self._admit_compiled()
        outputs, self._pending_outputs = self._pending_outputs, []
        vote = self.scheduler.prefill_vote()
        out = self.scheduler.schedule(vote != 0)
        outputs += self._finished_by_scheduler(out.finished)
        if vote != 0 and out.kind == _core.StepKind.PREFILL and out.num_seqs == 0:
            # Round two of the vote on one rank: nothing could be prefilled, run decode instead.
            out = self.scheduler.schedule(False)
            outputs += self._finished_by_scheduler(out.finished)
        if out.num_seqs == 0:
            results = self.worker.flush()
        else:
            results = self._run_plan(StepPlan.from_schedule(self._step_id, out, out.kind == _core.StepKind.PREFILL))
        outputs += self._apply_results(results)
        self.stats["step_ms"] += (time.perf_counter() - t0) * 1e3
        return outputs

    def _step_lockstep(self) -> list[RequestOutput]:
        if threading.get_ident() != self._stepping_thread:
            self._bind_device_to_thread()
        group = self._step_group
        t0 = time.perf_counter()
        self._admit_compiled()
        outputs, self._pending_outputs = self._pending_outputs, []
        prefill = vote_prefill(self.scheduler.prefill_vote(), group)
        out = self.scheduler.schedule(prefill)
        outputs += self._finished_by_scheduler(out.finished)
        agreed = confirm_step(prefill, out.num_seqs if prefill else 0, out.num_seqs, group)
        if prefill and not agreed.prefill:  # round two: no rank could prefill; every rank decodes instead
            prefill = False
            out = self.scheduler.schedule(False)
            outputs += self._finished_by_scheduler(out.finished)
            any_work = agree_decode_size(out.num_seqs, group) > 0
        else:
            any_work = agreed.any_work
        self.last_step_had_work = any_work
        if out.num_seqs:
            results = self._run_plan(StepPlan.from_schedule(self._step_id, out, prefill))
        elif any_work:
            results = self.worker.execute_dummy_step(prefill, self._step_requests(dummy_plan(prefill)))
        else:
            results = self.worker.flush()
        outputs += self._apply_results([r for r in results if not _is_dummy(r)])
        self.stats["step_ms"] += (time.perf_counter() - t0) * 1e3
        return outputs

    def _run_plan(self, plan: StepPlan) -> list[StepResult]:
        self._step_id += 1
        results = self.worker.execute_model_step(plan, self._step_requests(plan))
        self.stats["num_steps"] += 1
        self.stats["prefill_steps" if plan.is_prefill else "decode_steps"] += 1
        if plan.is_prefill:
            self.stats["prompt_tokens"] += plan.num_tokens
        return results

    def _bind_device_to_thread(self) -> None:
        """The current device is per thread (CUDA, NPU): a step run by another thread than the one that built
        the engine selects the engine's device first."""
        self._stepping_thread = threading.get_ident()
        if self.backend.device_type == "cpu":
            return
        import torch

        module = getattr(torch, self.backend.device_type, None)
        if module is not None and hasattr(module, "set_device"):
            module.set_device(self.backend.device_index)

    def _step_requests(self, plan: StepPlan) -> StepRequests:
        return build_step_requests(plan, self._by_seq, self.config.nextn, self.max_model_len, self._eos_ids)

    def _apply_results(self, results: list[StepResult]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for res in results:
            self.stats["forward_ms"] += res.forward_ms
            self.stats["sample_ms"] += res.sample_ms
            self.stats["model_ms"] += res.model_ms
            self.stats["host_wait_ms"] += res.host_wait_ms
            if res.num_drafts is not None and self.config.nextn:
                self._record_spec(res)
            if self.varlen is not None:
                self.varlen.observe(res)
            counts = np.array([len(t) for t in res.token_ids], dtype=np.int32)
            flat = np.array([t for toks in res.token_ids for t in toks], dtype=np.int32)
            self.scheduler.update(res.seq_ids, counts, flat)
            touched: dict[str, Request] = {}  # one output per request (a group's completions share it)
            for i, seq_id in enumerate(res.seq_ids.tolist()):
                req = self._by_seq.get(seq_id)
                tokens = res.token_ids[i]
                if req is None or req.finished:
                    continue
                if i in res.prompt_logprobs:
                    self._append_prompt_logprobs(req, res.prompt_logprobs[i])
                if not tokens:
                    continue
                forked = self._fork_completions(req, res.fork_tokens[i]) if i in res.fork_tokens else []
                self._append_tokens(req, tokens, res.logprobs[i] if res.logprobs else None)
                for child, (token, entry) in forked:
                    self._append_tokens(child, [token], [entry] if entry is not None else None)
                touched.setdefault(req.request_id, req)
            outputs += [self._make_output(req) for req in touched.values()]
        return outputs

    def _fork_completions(self, parent: Request, samples: list[tuple]) -> list[tuple[Request, tuple]]:
        """Completions ``1..n-1`` of ``parent``'s group, forked at its prompt's end: each shares the prompt's KV
        blocks copy-on-write and starts from its own first sample (``samples[i-1]``: token, logprob entry)."""
        if not parent.fork_seeds or parent.group is None:
            return []
        forked = []
        child_max = self._max_new_tokens(parent.params, len(parent.prompt_token_ids))
        for index, (seed, sample) in enumerate(zip(parent.fork_seeds, samples), start=1):
            child = self._new_request(parent.request_id, parent.prompt, parent.prompt_token_ids, parent.params,
                                      seed)
            child.index, child.group = index, parent.group
            child.prompt_logprobs = parent.prompt_logprobs
            child.rebuild_penalties = parent.params.uses_penalties
            self.scheduler.fork_seq(parent.seq_id, child.seq_id, child_max, last_token=int(sample[0]))
            parent.group.members.append(child)
            self._by_seq[child.seq_id] = child
            self._grammars.fork(child, parent, [int(sample[0])])
            forked.append((child, sample))
        parent.fork_seeds = []
        return forked

    def _append_prompt_logprobs(self, req: Request, entries: list[tuple]) -> None:
        """Prompt positions computed by a prefill chunk, in order (a recomputed prompt adds nothing)."""
        if req.prompt_logprobs is None:
            return
        prompt = req.prompt_token_ids
        for lp, rank, top_ids, top_lps in entries:
            pos = len(req.prompt_logprobs)
            if pos >= len(prompt):
                break
            req.prompt_logprobs.append(self._logprob_dict(prompt[pos], (lp, rank, top_ids, top_lps)))

    def _record_spec(self, res: StepResult) -> None:
        live = np.array([self._by_seq.get(int(s)) is not None for s in res.seq_ids], dtype=bool)
        self.spec_counters.record(self.stats, res, live)

    def _append_tokens(self, req: Request, tokens: list[int], logprobs) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        kept, reason, stop_reason = req.stop_checker.append(tokens, req.detokenizer)
        req.output_token_ids.extend(tokens[:kept])
        self.stats["generation_tokens"] += kept
        if req.detokenizer is not None:
            req.output_text = req.stop_checker.text
        if req.logprobs is not None and logprobs:
            for tok, entry in zip(tokens[:kept], logprobs[:kept]):
                req.logprobs.append(self._logprob_dict(tok, entry))
                req.logprobs_raw.append(entry)
                req.cumulative_logprob += entry[0]
        if reason is None and req.grammar is not None:
            if req.grammar.failed:  # cannot happen while masks are applied; never hand out invalid output quietly
                reason = "abort"
                req.stop_checker.finish_message = "a generated token broke the structured output grammar"
                logger.error("request %r: %s", req.request_id, req.stop_checker.finish_message)
            elif req.grammar.is_terminated:
                reason = "stop"
        if reason is not None:
            req.stop_reason = stop_reason
            self._finish(req, reason, message=req.stop_checker.finish_message)

    def _logprob_dict(self, token_id: int, entry) -> dict:
        sampled_lp, sampled_rank, top_ids, top_lps = entry
        decode = None
        if self.tokenizer is not None:
            decode = lambda tid: self.tokenizer.decode([tid], skip_special_tokens=False)  # noqa: E731
        return make_logprobs_dict(top_ids, top_lps, token_id, sampled_lp, sampled_rank, decode)

    def _finished_by_scheduler(self, finished) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        for seq_id, status, message in finished:
            req = self._by_seq.get(int(seq_id))
            if req is None or req.finished:
                continue
            reason = _SCHEDULER_FINISH_REASONS.get(status, "abort")
            if reason == "preempted":
                self.stats["preempted_requests"] += 1
            elif reason == "ignored":
                self.stats["ignored_requests"] += 1
            self._finish(req, reason, message=str(message), notify_scheduler=False)
            touched.setdefault(req.request_id, req)
        return [self._make_output(req) for req in touched.values()]

    def _finish(self, req: Request, reason: str, message: str | None = None, notify_scheduler: bool = True):
        req.finished = True
        req.finish_reason = reason
        if self.varlen is not None:
            self.varlen.calibrator.forget(req.seq_id)
        req.finish_message = message
        req.finished_time = time.monotonic()
        if notify_scheduler and reason in _FINISH_STATUS:
            self.scheduler.finish(req.seq_id, _FINISH_STATUS[reason])
        self._by_seq.pop(req.seq_id, None)
        if req.group is not None and req.fork_seeds:  # ended before its prompt did: so do the other completions
            for index in range(1, req.group.n):
                twin = Request(request_id=req.request_id, seq_id=-1, prompt=req.prompt,
                               prompt_token_ids=req.prompt_token_ids, params=req.params, seed=req.fork_seeds[0],
                               finished=True, finish_reason=reason, finish_message=message, index=index,
                               group=req.group, logprobs=[] if req.logprobs is not None else None,
                               cumulative_logprob=req.cumulative_logprob)
                req.group.members.append(twin)
            req.fork_seeds = []
        if req.done:
            self._requests.pop(req.request_id, None)

    def _make_output(self, req: Request) -> RequestOutput:
        """The request's cumulative output: one CompletionOutput per completion (``n``), finished when all are."""
        members = req.group.members if req.group is not None else [req]
        completions = [
            CompletionOutput(
                index=m.index,
                text=m.output_text,
                token_ids=list(m.output_token_ids),
                cumulative_logprob=m.cumulative_logprob,
                logprobs=list(m.logprobs) if m.logprobs is not None else None,
                finish_reason=m.finish_reason,
                stop_reason=m.stop_reason,
                finish_message=m.finish_message,
            )
            for m in members
        ]
        first = members[0]
        return RequestOutput(
            request_id=req.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=req.done,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
        )

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict:
        with self.lock:
            return stats_report(self)


def _is_dummy(result: StepResult) -> bool:
    return result.seq_ids.size == 1 and int(result.seq_ids[0]) == DUMMY_SEQ_ID
