"""Per-request state kept by the Python engine (the C++ core keeps the scheduling state of the same sequence).

A request with ``n > 1`` is a :class:`RequestGroup`: completion 0 is the request that is prefilled; completions
``1..n-1`` are forked from it at the prompt's end, each a :class:`Request` (its own sequence) with the same
``request_id`` and its ``index``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deepinfer_npu.engine.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's RNG seed (its own, or drawn from the engine's generator at add time)
    detokenizer: object | None = None
    stop_checker: object | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    logprobs: list | None = None
    logprobs_raw: list = field(default_factory=list)  # sampler entries behind ``logprobs`` (fork inherits them)
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None  # [None, {id: Logprob}, ...] as prompt positions are computed
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_message: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None
    index: int = 0  # completion index within its group
    group: RequestGroup | None = None
    fork_seeds: list[int] = field(default_factory=list)  # seeds of completions 1..n-1 not forked yet
    rebuild_penalties: bool = False  # a fork: its device token counts are rebuilt at its first step
    grammar: object | None = None  # structured output: its RequestGrammar once compiled
    grammar_future: object | None = None  # structured output: the compilation it waits for (not scheduled yet)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def done(self) -> bool:
        """The whole request finished (every completion of its group)."""
        return self.group.finished if self.group is not None else self.finished


@dataclass
class RequestGroup:
    """The ``n`` completions of one request, in index order (completions 1..n-1 appear when forked)."""

    request_id: str
    n: int
    members: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.members) == self.n and all(m.finished for m in self.members)
