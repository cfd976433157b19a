"""Request outputs, mirroring vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``.

``finish_reason`` is one of the strings in :class:`FinishReason` (``"stop"``, ``"length"``, ``"abort"``,
``"preempted"``, ``"ignored"``) or ``None`` while the request runs. ``stop_reason`` is, as in vLLM, the stop
string or stop token id that ended generation (``None`` for EOS or other reasons). A human-readable
explanation (e.g. why a request was ignored) travels in ``CompletionOutput.finish_message``.

Logprobs follow vLLM: per generated token a ``dict[token_id, Logprob]`` holding the top-``k`` tokens and the
sampled one; see :func:`make_logprobs_dict`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "FinishReason",
    "Logprob",
    "SampleLogprobs",
    "CompletionOutput",
    "RequestMetrics",
    "RequestOutput",
    "make_logprobs_dict",
]


class FinishReason:
    """The finish-reason strings (plain ``str`` values, so ``out.finish_reason == "stop"`` works)."""

    STOP = "stop"  #: EOS, a stop token id or a stop string
    LENGTH = "length"  #: ``max_tokens`` or ``max_model_len`` reached
    ABORT = "abort"  #: aborted by the user
    PREEMPTED = "preempted"  #: preempted for lack of KV cache (with ``stop_preempted_request``)
    IGNORED = (
        "ignored"  #: never scheduled (e.g. prompt longer than ``max_model_len``); see ``finish_message``
    )

    ALL: frozenset[str] = frozenset({STOP, LENGTH, ABORT, PREEMPTED, IGNORED})


@dataclass
class Logprob:
    """Log-probability of one token (vLLM's ``Logprob``).

    ``rank`` is the 1-based rank of the token in the model's distribution (1 = most likely); ``decoded_token``
    its text when a tokenizer is available.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per generated token: ``{token_id: Logprob}``.
SampleLogprobs = list[dict[int, Logprob]]


def make_logprobs_dict(
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    sampled_id: int,
    sampled_logprob: float,
    sampled_rank: int,
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """Build one position's logprobs dict from sampler results (top-``k`` entries plus the sampled token).

    The sampled token comes first (as in vLLM); top entries get ranks ``1..k``. ``decode`` maps a token id to
    its text (``None`` leaves ``decoded_token`` empty).
    """

    def text(tok: int) -> str | None:
        return decode(tok) if decode is not None else None

    out: dict[int, Logprob] = {
        int(sampled_id): Logprob(float(sampled_logprob), int(sampled_rank), text(int(sampled_id)))
    }
    for rank, (tok, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
        tok = int(tok)
        if tok not in out:
            out[tok] = Logprob(float(lp), rank, text(tok))
    return out


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM field names).

    Attributes:
        index: completion index within the request (``0..n-1``).
        text: generated text so far (cumulative).
        token_ids: generated token ids so far (cumulative; a stop token / EOS that ended generation is
            included).
        cumulative_logprob: sum of the sampled tokens' logprobs when logprobs were requested, else ``None``.
        logprobs: per generated token ``{token_id: Logprob}`` when requested, else ``None``.
        finish_reason: ``None`` while running, else one of :class:`FinishReason`.
        stop_reason: the stop string or stop token id that ended generation; ``None`` otherwise.
        finish_message: human-readable detail for the finish reason (e.g. why the request was ignored).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_message: str | None = None

    def finished(self) -> bool:
        """True once a finish reason is set (vLLM's ``CompletionOutput.finished()``)."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        parts = [
            f"index={self.index}",
            f"text={self.text!r}",
            f"token_ids={_short_list(self.token_ids)}",
            f"cumulative_logprob={self.cumulative_logprob}",
            f"logprobs={'None' if self.logprobs is None else f'<{len(self.logprobs)} positions>'}",
            f"finish_reason={self.finish_reason}",
            f"stop_reason={self.stop_reason!r}",
        ]
        if self.finish_message:
            parts.append(f"finish_message={self.finish_message!r}")
        return f"CompletionOutput({', '.join(parts)})"


@dataclass
class RequestMetrics:
    """Timestamps of a request (``time.monotonic()`` seconds; ``None`` until reached), as vLLM's."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_generated_tokens: int = 0


@dataclass
class RequestOutput:
    """Output of one request (vLLM field names).

    Attributes:
        request_id: the id given to ``add_request`` (a string).
        prompt: the prompt text, or ``None`` when the request came as token ids.
        prompt_token_ids: the prompt's token ids.
        outputs: one :class:`CompletionOutput` per completion (``SamplingParams.n``; ``index`` 0..n-1).
        finished: whether the whole request finished (every completion).
        metrics: optional timing information.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: one entry per prompt token, ``None`` for the
            first, then ``{token_id: Logprob}`` holding the prompt token (its logprob and rank under the model's
            distribution at the previous position) and the top-``k`` there; ``None`` otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={_short_text(self.prompt)}, "
            f"prompt_token_ids={_short_list(self.prompt_token_ids)}, outputs={self.outputs!r}, "
            f"finished={self.finished})"
        )


def _short_list(ids: Sequence[int], limit: int = 16) -> str:
    ids = list(ids)
    if len(ids) <= limit:
        return repr(ids)
    head = ", ".join(str(i) for i in ids[: limit // 2])
    tail = ", ".join(str(i) for i in ids[-(limit // 4) :])
    return f"[{head}, ... ({len(ids)} total) ..., {tail}]"


def _short_text(text: str | None, limit: int = 200) -> str:
    if text is None or len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + f"...({len(text)} chars)"
