"""LLMEngine: requests in, RequestOutputs out, one ``step()`` at a time (vLLM's offline engine API).

Python owns requests, tokenization, stop checks and outputs; the C++ ``Scheduler`` owns sequences, blocks and the
policy; the ``Worker`` owns the step. Bad input raises ``ValueError`` at ``add_request`` and never disturbs the
requests already running; a request the scheduler cannot serve (prompt longer than ``max_model_len``, more blocks
than the pool) finishes with ``finish_reason="ignored"`` and a message naming the limit.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Sequence

import numpy as np

from deepinfer_npu import _core
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.engine.detokenizer import IncrementalDetokenizer
from deepinfer_npu.engine.outputs import CompletionOutput, RequestOutput, make_logprobs_dict
from deepinfer_npu.engine.request import Request
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.engine.stop_checker import StopChecker
from deepinfer_npu.engine.tokenizer import load_tokenizer
from deepinfer_npu.hal.registry import get_backend
from deepinfer_npu.model_executor.model_config import DeepseekModelConfig
from deepinfer_npu.sampling import SamplingTensors, min_tokens_banned_ids
from deepinfer_npu.worker.model_runner import ModelRunner
from deepinfer_npu.worker.step_io import StepPlan, StepResult
from deepinfer_npu.worker.worker import Worker

logger = logging.getLogger(__name__)

_SCHEDULER_FINISH_REASONS = {
    _core.SeqStatus.FINISHED_IGNORED: "ignored",
    _core.SeqStatus.FINISHED_PREEMPTED: "preempted",
    _core.SeqStatus.FINISHED_ABORTED: "abort",
}
_FINISH_STATUS = {"stop": _core.SeqStatus.FINISHED_STOPPED, "length": _core.SeqStatus.FINISHED_LENGTH}


class LLMEngine:
    """Offline engine. ``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.backend = get_backend(config.backend)
        self.model_config = DeepseekModelConfig.from_pretrained(config.model_dir)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit} "
                f"({config.model_dir / 'config.json'})"
            )
        self.max_model_len = config.max_model_len or limit
        self.tokenizer = load_tokenizer(config.model_dir)
        self.runner = ModelRunner(config, self.backend, self.model_config)
        self.scheduler = _core.Scheduler(self._scheduler_config())
        self.worker = Worker(self.runner, self.backend, config.zero_overhead_scheduling)
        self.vocab_size = self.model_config.vocab_size

        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._next_seq_id = 0
        self._seed_rng = np.random.default_rng(config.seed)
        self._step_id = 0
        self.stats = {
            "num_steps": 0, "prefill_steps": 0, "decode_steps": 0, "prompt_tokens": 0,
            "generation_tokens": 0, "preempted_requests": 0, "ignored_requests": 0, "aborted_requests": 0,
            "forward_ms": 0.0, "sample_ms": 0.0, "step_ms": 0.0,
        }

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

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | dict | Sequence[int] | None,
        sampling_params: SamplingParams | None = None,
    ) -> None:
        """Queue a request. ``prompt``: text, ``{"prompt_token_ids": [...]}`` / ``{"prompt": text}``, or ids."""
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(request_id, prompt)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63 - 1))
        req = Request(request_id=request_id, seq_id=self._next_seq_id, prompt=text, prompt_token_ids=ids,
                      params=params, seed=seed)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        if params.logprobs is not None:
            req.logprobs = []
            req.cumulative_logprob = 0.0
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"request {request_id!r}: stop strings need a tokenizer, and {self.config.model_dir} has no "
                "tokenizer.json; use stop_token_ids instead"
            )
        req.stop_checker = StopChecker(params, self._eos_ids, self.max_model_len, len(ids))
        self._next_seq_id += 1
        # max_tokens=None: limited by max_model_len only (a prompt too long for it is ignored by the scheduler).
        max_new = params.max_tokens if params.max_tokens is not None else max(1, self.max_model_len - len(ids))
        self.scheduler.add_seq(req.seq_id, ids, max_new)
        self._requests[request_id] = req
        self._by_seq[req.seq_id] = req

    @functools.cached_property
    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        eos = self.model_config.eos_token_id
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
        return sorted(ids)

    def _tokenize(self, request_id: str, prompt) -> tuple[str | None, list[int]]:
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
            else:
                raise ValueError(f"request {request_id!r}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            ids = prompt
        else:
            raise ValueError(f"request {request_id!r}: unsupported prompt type {type(prompt).__name__}")
        if ids is None:
            if self.tokenizer is None:
                raise ValueError(
                    f"request {request_id!r}: model directory {self.config.model_dir} has no tokenizer.json; "
                    "pass token ids as {'prompt_token_ids': [...]}"
                )
            if not text:
                raise ValueError(f"request {request_id!r}: the prompt is empty")
            ids = self.tokenizer.encode(text)
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (no tokens)")
        for pos, tok in enumerate(ids):
            if not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"request {request_id!r}: token id {tok} at position {pos} is out of the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        return text, ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort one or several requests in any state; their final output (``finish_reason="abort"``) is
        returned by the next ``step()``. Unknown ids are ignored, as in vLLM."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self._requests.get(str(rid))
            if req is None or req.finished:
                continue
            self.scheduler.abort(req.seq_id)
            self.stats["aborted_requests"] += 1
            self._finish(req, "abort", message="aborted by the caller", notify_scheduler=False)
            self._pending_outputs.append(self._make_output(req))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs) or self.worker.has_pending_step

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return outputs of requests that progressed or finished."""
        t0 = time.perf_counter()
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
            is_prefill = out.kind == _core.StepKind.PREFILL
            plan = StepPlan.from_schedule(self._step_id, out, is_prefill)
            self._step_id += 1
            sampling = self._sampling_tensors(plan)
            results = self.worker.execute_model_step(plan, sampling)
            self.stats["num_steps"] += 1
            self.stats["prefill_steps" if is_prefill else "decode_steps"] += 1
            if is_prefill:
                self.stats["prompt_tokens"] += plan.num_tokens
        outputs += self._apply_results(results)
        self.stats["step_ms"] += (time.perf_counter() - t0) * 1e3
        return outputs

    def _sampling_tensors(self, plan: StepPlan) -> SamplingTensors:
        """Per sampled row: the request's params, seed and the output position of the token sampled."""
        params, seeds, offsets, banned = [], [], [], []
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            if plan.is_prefill and not plan.is_last_chunk[i]:
                continue
            req = self._by_seq.get(seq_id)
            p = req.params if req is not None else SamplingParams(temperature=0.0)
            params.append(p)
            seeds.append(req.seed if req is not None else 0)
            position = (req.num_output_tokens + req.num_inflight_tokens) if req is not None else 0
            offsets.append(position)
            banned.append(min_tokens_banned_ids(p, position, self._eos_ids))
            if req is not None:
                req.num_inflight_tokens += 1
        return SamplingTensors.from_params(
            params, seeds, offsets, vocab_size=self.vocab_size,
            banned_token_ids=banned if any(banned) else None, device=self.runner.device,
        )

    def _apply_results(self, results: list[StepResult]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for res in results:
            self.stats["forward_ms"] += res.forward_ms
            self.stats["sample_ms"] += res.sample_ms
            counts = np.array([len(t) for t in res.token_ids], dtype=np.int32)
            flat = np.array([t for toks in res.token_ids for t in toks], dtype=np.int32)
            self.scheduler.update(res.seq_ids, counts, flat)
            for i, seq_id in enumerate(res.seq_ids.tolist()):
                req = self._by_seq.get(seq_id)
                tokens = res.token_ids[i]
                if req is None or req.finished or not tokens:
                    continue
                req.num_inflight_tokens = max(0, req.num_inflight_tokens - len(tokens))
                self._append_tokens(req, tokens, res.logprobs[i] if res.logprobs else None)
                outputs.append(self._make_output(req))
        return outputs

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
                req.cumulative_logprob += entry[0]
        if reason is not None:
            req.stop_reason = stop_reason
            self._finish(req, reason)

    def _logprob_dict(self, token_id: int, entry) -> dict:
        sampled_lp, sampled_rank, top_ids, top_lps = entry
        decode = None
        if self.tokenizer is not None:
            decode = lambda tid: self.tokenizer.decode([tid], skip_special_tokens=False)  # noqa: E731
        return make_logprobs_dict(top_ids, top_lps, token_id, sampled_lp, sampled_rank, decode)

    def _finished_by_scheduler(self, finished) -> list[RequestOutput]:
        outputs = []
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
            outputs.append(self._make_output(req))
        return outputs

    def _finish(self, req: Request, reason: str, message: str | None = None, notify_scheduler: bool = True):
        req.finished = True
        req.finish_reason = reason
        req.finish_message = message
        req.finished_time = time.monotonic()
        if notify_scheduler and reason in _FINISH_STATUS:
            self.scheduler.finish(req.seq_id, _FINISH_STATUS[reason])
        self._requests.pop(req.request_id, None)
        self._by_seq.pop(req.seq_id, None)

    def _make_output(self, req: Request) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=req.output_text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            finish_message=req.finish_message,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.finished,
        )

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict:
        s = dict(self.stats)
        s["preemptions"] = int(self.scheduler.num_preemptions)  # finished or recomputed
        s["kv_usage"] = float(self.scheduler.kv_usage())
        s["num_kv_blocks"] = self.runner.num_kv_blocks
        s["backend"] = self.backend.name
        return s
