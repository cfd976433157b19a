"""Per-request state kept by the Python engine (the C++ core keeps the scheduling state of the same sequence)."""

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
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_message: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
