"""Request admission: how a request enters the engine (``add_request``, ``add_requests``, ``fork_request``).

Every request is validated in full (params against the model, prompt, tokenizer needs) before any of a batch is
queued, so bad input raises ``ValueError`` / ``TypeError`` and leaves the engine unchanged. An admitted request gets
its sequence id, seed, detokenizer and stop checker, and enters the C++ scheduler at once, or once its
structured-output grammar has compiled (``_admit_compiled``, run at the start of each step).

A mixin of ``LLMEngine``: it reads the engine's ``config``, ``tokenizer``, ``scheduler``, ``worker``, request tables
(``_requests``, ``_by_seq``) and ``_grammars``, and finishes requests through ``OutputProcessing``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from deepinfer_npu import _core
from deepinfer_npu.engine.detokenizer import IncrementalDetokenizer
from deepinfer_npu.engine.input_processing import tokenize_prompt
from deepinfer_npu.engine.output_router import OutputSink
from deepinfer_npu.engine.request import Request, RequestGroup
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.engine.stop_checker import StopChecker
from deepinfer_npu.sampling import derive_seed

logger = logging.getLogger(__name__)


class RequestAdmission:
    """Validates, queues and forks requests (``LLMEngine``'s request side)."""

    def add_request(
        self,
        request_id: str,
        prompt: str | dict | Sequence[int] | None,
        sampling_params: SamplingParams | None = None,
        *,
        output_sink: OutputSink | None = None,
    ) -> None:
        """Queue a request. ``prompt``: text, ``{"prompt_token_ids": [...]}`` / ``{"prompt": text}``, or ids.

        ``sampling_params=None`` takes :meth:`default_sampling_params`. Without ``output_sink`` the request's
        outputs are returned by ``step()``; with one, every output of the request is handed to it instead.
        """
        self.add_requests([(request_id, prompt, sampling_params)], output_sink=output_sink)

    def add_requests(self, requests: Iterable[tuple], *, output_sink: OutputSink | None = None) -> None:
        """Queue several ``(request_id, prompt, sampling_params)`` at once, all or nothing: every request is
        validated before any is queued, so a ``ValueError`` / ``TypeError`` leaves the engine unchanged."""
        with self.lock:
            requests = list(requests)
            checked, ids = [], set()
            for index, (request_id, prompt, params) in enumerate(requests):
                request_id = str(request_id)
                try:
                    if request_id in self._requests or request_id in ids:
                        raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
                    ids.add(request_id)
                    checked.append(self._validate(request_id, prompt, params))
                except (ValueError, TypeError) as e:
                    if len(requests) == 1:
                        raise
                    raise type(e)(f"{e} (index {index} of the {len(requests)} submitted; none was queued)") from e
            self._warn_capped(checked)
            for request_id, text, prompt_ids, params in checked:
                self._enqueue(request_id, text, prompt_ids, params, output_sink)


    def _validate(self, request_id: str, prompt, params) -> tuple[str, str | None, list[int], SamplingParams]:
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {request_id!r}: sampling_params must be a SamplingParams, "
                            f"got {type(params).__name__}")
        self._check_params(request_id, params)
        text, ids = self._tokenize(request_id, prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"request {request_id!r}: stop strings need a tokenizer, and {self.config.model_dir} has no "
                "tokenizer.json; use stop_token_ids instead"
            )
        return request_id, text, ids, params

    def _warn_capped(self, checked: list) -> None:
        """One line when max_model_len, not max_tokens, will end some of these requests."""
        capped = [(rid, len(ids), p.max_tokens) for rid, _, ids, p in checked
                  if p.max_tokens is not None and len(ids) < self.max_model_len < len(ids) + p.max_tokens]
        if capped:
            rid, n_prompt, max_tokens = capped[0]
            logger.warning(
                "%d of %d requests ask for more tokens than max_model_len=%d holds (e.g. %r: %d prompt + "
                "max_tokens=%d); they stop at max_model_len with finish_reason='length'",
                len(capped), len(checked), self.max_model_len, rid, n_prompt, max_tokens)

    def _enqueue(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                 output_sink: OutputSink | None) -> None:
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63 - 1))
        req = self._new_request(request_id, text, ids, params, seed)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        if params.n > 1:  # completions 1..n-1 fork off this one at the prompt's end, each with its own seed
            req.group = RequestGroup(request_id, params.n, [req])
            req.fork_seeds = [derive_seed(seed, i) for i in range(1, params.n)]
        if params.structured_outputs is not None:  # scheduled once its grammar is compiled
            self._grammars.start(req)
        else:
            self.scheduler.add_seq(req.seq_id, ids, self._max_new_tokens(params, len(ids)))
        self._requests[request_id] = req
        self._by_seq[req.seq_id] = req
        self._router.register(request_id, output_sink)

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling enter the scheduler (or fail, naming the reason)."""
        if not self._grammars.awaiting:
            return
        if not self.scheduler.has_unfinished() and not self.worker.has_pending_step:
            self._grammars.wait(0.05)  # nothing else to run: do not spin
        for req, error in self._grammars.take_compiled():
            if req.finished:
                continue
            if error is not None:
                self._finish(req, "abort", message=f"structured output grammar failed to compile: {error}",
                             notify_scheduler=False)
                self._pending_outputs.append(self._make_output(req))
                continue
            self.scheduler.add_seq(req.seq_id, req.prompt_token_ids,
                                   self._max_new_tokens(req.params, len(req.prompt_token_ids)))

    def _new_request(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                     seed: int) -> Request:
        """A Request with its detokenizer, stop checker and logprob lists, on a new sequence id."""
        req = Request(request_id=request_id, seq_id=self._next_seq_id, prompt=text, prompt_token_ids=list(ids),
                      params=params, seed=seed)
        self._next_seq_id += 1
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                     params.skip_special_tokens)
        if params.logprobs is not None:
            req.logprobs = []
            req.cumulative_logprob = 0.0
        req.stop_checker = StopChecker(params, self._eos_ids, self.max_model_len, len(ids))
        if params.uses_penalties:  # the device token counts exist from the first request that needs them
            self.worker.slots.enable_penalties(self.vocab_size)
        return req

    def _max_new_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        # max_tokens=None: limited by max_model_len only (a prompt too long for it is ignored by the scheduler).
        return params.max_tokens if params.max_tokens is not None else max(1, self.max_model_len - prompt_len)

    def _check_params(self, request_id: str, params: SamplingParams) -> None:
        """Checks that need the model (SamplingParams validated the rest at construction)."""
        bad = [t for t in params.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: stop_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})"
            )
        bad = sorted(t for t in params.logit_bias or {} if t >= self.vocab_size)
        if bad:
            raise ValueError(
                f"request {request_id!r}: logit_bias token id(s) {bad} are outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        self._grammars.check(request_id, params)

    def _tokenize(self, request_id: str, prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(request_id, prompt, self.tokenizer, self.vocab_size, self.config.model_dir)

    def fork_request(self, parent_id: str, child_id: str, sampling_params: SamplingParams | None = None) -> None:
        """Branch ``child_id`` off a running request: the child shares the parent's KV blocks and state slot
        (copy-on-write at its first step, seed §5.4) and starts with the parent's prompt and outputs so far.

        The parent must have finished its prefill. Fork right after the parent's first tokens: the state slot is
        copied when the child is first scheduled, and a parent that ran far ahead by then would hand the child a
        drafter state from later positions (drafts are only proposals, so outputs stay exact either way).
        """
        with self.lock:
            self._fork(str(parent_id), str(child_id), sampling_params)

    def _fork(self, parent_id: str, child_id: str, sampling_params: SamplingParams | None) -> None:
        parent = self._requests.get(parent_id)
        if parent is None or parent.finished:
            raise ValueError(f"fork_request: parent {parent_id!r} is not an unfinished request")
        if child_id in self._requests:
            raise ValueError(f"request_id {child_id!r} is already in use by an unfinished request")
        status = self.scheduler.get_seq_status(parent.seq_id)
        if status not in (_core.SeqStatus.PROMPTED, _core.SeqStatus.RUNNING):
            raise ValueError(f"fork_request: parent {parent_id!r} has not finished its prefill (status {status})")
        params = sampling_params if sampling_params is not None else parent.params
        if params.n != 1:
            raise ValueError(f"fork_request: a forked request is one completion (n=1), got n={params.n}")
        self._check_params(child_id, params)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63 - 1))
        child = self._new_request(child_id, parent.prompt, parent.prompt_token_ids, params, seed)
        child.rebuild_penalties = params.uses_penalties
        child_max = self._max_new_tokens(params, len(child.prompt_token_ids))
        self.scheduler.fork_seq(parent.seq_id, child.seq_id, child_max)
        self._requests[child_id] = child
        self._by_seq[child.seq_id] = child
        self._grammars.fork(child, parent, list(parent.output_token_ids))
        if child.grammar is not None:
            child.grammar.drafts = None  # the parent may be steps ahead of the drafts the child verifies first
        if parent.output_token_ids:
            # Inherited tokens go through the child's stop checks (a smaller max_tokens may end it at once).
            inherited = None
            if child.logprobs is not None and parent.logprobs is not None:
                inherited = parent.logprobs_raw[: len(parent.output_token_ids)]
            self._append_tokens(child, list(parent.output_token_ids), inherited)
            self.stats["generation_tokens"] -= len(child.output_token_ids)
            if child.finished:
                self._pending_outputs.append(self._make_output(child))
