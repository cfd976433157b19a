"""Output processing: a step's results into requests, requests' ends, and the ``RequestOutput`` of each.

``_apply_results`` hands each step's tokens to the scheduler and to their requests (forking the completions
1..n-1 of an ``n > 1`` request at its prompt's end), runs the stop checks and grammar ends, and collects one
cumulative output per request that progressed. ``_finish`` is the one place a request ends, whatever the reason
(stop, length, the scheduler's ignored / preempted, abort).

A mixin of ``LLMEngine``: it reads the engine's ``scheduler``, ``tokenizer``, ``config``, ``varlen``, ``stats``,
``spec_counters`` and request tables, and creates forked requests through ``RequestAdmission``.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from deepinfer_npu import _core
from deepinfer_npu.engine.outputs import CompletionOutput, RequestOutput, make_logprobs_dict
from deepinfer_npu.engine.request import Request
from deepinfer_npu.worker.step_io import StepResult

logger = logging.getLogger(__name__)

_SCHEDULER_FINISH_REASONS = {
    _core.SeqStatus.FINISHED_IGNORED: "ignored",
    _core.SeqStatus.FINISHED_PREEMPTED: "preempted",
    _core.SeqStatus.FINISHED_ABORTED: "abort",
}
_FINISH_STATUS = {"stop": _core.SeqStatus.FINISHED_STOPPED, "length": _core.SeqStatus.FINISHED_LENGTH}


class OutputProcessing:
    """Step results -> request state -> ``RequestOutput``s; finishing requests."""

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