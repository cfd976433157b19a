"""Per-request stop handling (EOS, stop token ids, stop strings, min/max tokens, max_model_len).

A step may commit several tokens for one request (speculative decoding accepts drafts plus a bonus token), so
:meth:`StopChecker.process` walks the new tokens **in order**, detokenizes each, and stops at the first token
that ends the request; the tokens after it are dropped. The checks for one token, in vLLM's order:

1. fewer than ``min_tokens`` generated (counting this one)  → no EOS / stop-id / stop-string stop;
2. EOS (any of the model's EOS ids) unless ``ignore_eos``    → ``"stop"``, ``stop_reason=None``;
3. a ``stop_token_ids`` member                                → ``"stop"``, ``stop_reason=<token id>``;
4. a stop string appears in the text (it may span tokens)     → ``"stop"``, ``stop_reason=<the string>``; the
   text is cut before it (after it with ``include_stop_str_in_output``); of several, the earliest occurrence
   wins;
5. ``max_tokens`` generated                                   → ``"length"``;
6. prompt + output reach ``max_model_len``                    → ``"length"``.

The token that ends generation stays in ``output_token_ids`` (as in vLLM); for EOS / stop ids its *text* is
removed unless ``include_stop_str_in_output``. When the request finishes, text the detokenizer held back (an
incomplete character) is flushed, except after a stop string (it lies beyond the cut).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from deepinfer_npu.engine.detokenizer import IncrementalDetokenizer
from deepinfer_npu.engine.outputs import FinishReason
from deepinfer_npu.engine.sampling_params import SamplingParams

__all__ = ["StopChecker", "StopCheckResult", "find_stop_string"]


class StopCheckResult(NamedTuple):
    """Result of one :meth:`StopChecker.process` call (unpacks as a 3-tuple).

    ``num_tokens_kept``: how many of the new tokens are committed (all of them unless the request finished,
    then up to and including the finishing token). ``finish_reason`` / ``stop_reason``: ``None`` while
    running.
    """

    num_tokens_kept: int
    finish_reason: str | None
    stop_reason: int | str | None


def find_stop_string(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Look for a stop string that ends within the last ``num_new_chars`` characters of ``text``.

    Returns ``(stop_string, truncate_to)`` — the text should become ``text[:truncate_to]`` — or ``None``. Only
    occurrences overlapping the new characters are considered (older text was checked before), so a stop
    string spanning token boundaries is found on the token that completes it. Of several matches the earliest
    start wins (the shorter string on a tie).
    """
    if num_new_chars <= 0 or not stop:
        return None
    best: tuple[int, int, str] | None = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx >= 0 and (best is None or (idx, len(s)) < (best[0], best[1])):
            best = (idx, len(s), s)
    if best is None:
        return None
    idx, length, s = best
    return s, (idx + length if include_stop_str_in_output else idx)


class StopChecker:
    """Stop logic and output accumulation for one request (one completion).

    Args:
        params: the request's sampling parameters.
        eos_token_ids: the model's EOS ids (tokenizer + generation config); ignored with ``ignore_eos``.
        max_model_len: context limit, or ``None``.
        num_prompt_tokens: prompt length (for ``max_model_len``).
        detokenizer: the request's incremental detokenizer (here or in the first :meth:`append`), or ``None``
            when the model has no tokenizer: then ``params.stop`` must be empty and ``output_text`` stays
            ``""``.

    Attributes:
        output_token_ids: committed output tokens.
        output_text: committed output text (truncated at a stop string).
        finish_reason / stop_reason / finish_message: set once finished.
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        num_prompt_tokens: int = 0,
        detokenizer: IncrementalDetokenizer | None = None,
    ) -> None:
        self.params = params
        self.num_prompt_tokens = int(num_prompt_tokens)
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in eos_token_ids)
        self.stop_token_ids: frozenset[int] = frozenset(params.stop_token_ids or ())
        self.max_model_len = max_model_len
        self.detokenizer = detokenizer
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finish_message: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """Alias of ``output_text``."""
        return self.output_text

    def _finish(self, reason: str, stop_reason: int | str | None, message: str | None) -> None:
        self.finish_reason, self.stop_reason, self.finish_message = reason, stop_reason, message

    def _flush(self) -> None:
        if self.detokenizer is not None:
            self.output_text += self.detokenizer.flush()

    def _check_token(self, token_id: int, num_new_chars: int) -> None:
        """Run the checks for the token just appended (see the module docstring)."""
        p = self.params
        n_out = len(self.output_token_ids)
        if n_out >= p.min_tokens:
            stop_token: int | None = None
            if not p.ignore_eos and token_id in self.eos_token_ids:
                self._finish(FinishReason.STOP, None, "EOS token generated")
                stop_token = token_id
            elif token_id in self.stop_token_ids:
                self._finish(FinishReason.STOP, token_id, f"stop token id {token_id} generated")
                stop_token = token_id
            if stop_token is not None:
                self._flush()
                if not p.include_stop_str_in_output and self.detokenizer is not None:
                    tok_text = self.detokenizer.token_text(stop_token)
                    if tok_text and self.output_text.endswith(tok_text):
                        self.output_text = self.output_text[: -len(tok_text)]
                return
            if p.stop:
                hit = find_stop_string(self.output_text, num_new_chars, p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    stop_str, cut = hit
                    self.output_text = self.output_text[:cut]
                    self._finish(FinishReason.STOP, stop_str, f"stop string {stop_str!r} generated")
                    return
        if p.max_tokens is not None and n_out >= p.max_tokens:
            self._finish(FinishReason.LENGTH, None, f"max_tokens={p.max_tokens} reached")
        elif self.max_model_len is not None and self.num_prompt_tokens + n_out >= self.max_model_len:
            cut_short = f", before max_tokens={p.max_tokens}" if p.max_tokens is not None else ""
            self._finish(FinishReason.LENGTH, None,
                         f"max_model_len={self.max_model_len} reached ({self.num_prompt_tokens} prompt + "
                         f"{n_out} generated tokens{cut_short})")
        if self.finished:
            self._flush()

    def process(self, new_token_ids: Sequence[int]) -> StopCheckResult:
        """Commit ``new_token_ids`` in order until one finishes the request.

        Returns ``(num_tokens_kept, finish_reason, stop_reason)``. Tokens arriving after the request finished
        (a step that was in flight) are all dropped: ``(0, finish_reason, stop_reason)``.

        Raises:
            ValueError: ``params.stop`` is set but there is no detokenizer (the model has no tokenizer).
        """
        if self.finished:
            return StopCheckResult(0, self.finish_reason, self.stop_reason)
        if self.params.stop and self.detokenizer is None:
            raise ValueError("stop strings require a tokenizer, but the model has none (use stop_token_ids)")
        for i, tok in enumerate(new_token_ids):
            tok = int(tok)
            self.output_token_ids.append(tok)
            num_new_chars = 0
            if self.detokenizer is not None:
                delta = self.detokenizer.add_token(tok)
                self.output_text += delta
                num_new_chars = len(delta)
            self._check_token(tok, num_new_chars)
            if self.finished:
                return StopCheckResult(i + 1, self.finish_reason, self.stop_reason)
        return StopCheckResult(len(new_token_ids), None, None)

    def append(
        self, new_token_ids: Sequence[int], detokenizer: IncrementalDetokenizer | None = None
    ) -> StopCheckResult:
        """:meth:`process`, optionally attaching the request's detokenizer first (it must stay the same
        one)."""
        if detokenizer is not None:
            if self.detokenizer is not None and self.detokenizer is not detokenizer:
                raise ValueError("StopChecker.append: a different detokenizer than the one attached")
            self.detokenizer = detokenizer
        return self.process(new_token_ids)

    def finish_external(self, reason: str, message: str | None = None) -> None:
        """Record a finish decided elsewhere (``"abort"``, ``"preempted"``, ``"ignored"``); no flush of
        text."""
        if reason not in FinishReason.ALL:
            raise ValueError(f"unknown finish reason {reason!r}; expected one of {sorted(FinishReason.ALL)}")
        if not self.finished:
            self._finish(reason, None, message)
