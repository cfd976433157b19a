"""Incremental detokenization (vLLM-style prefix / read offsets).

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens, a token may end in the
middle of a character) and for SentencePiece-style decoders (the first token of a decode loses its leading
space). So, as vLLM and TGI do, each step decodes two windows that start at the same *prefix offset*:

* ``prefix_text = decode(ids[prefix_offset:read_offset])`` — text already emitted, plus a little context;
* ``new_text = decode(ids[prefix_offset:])`` — the same plus the new tokens;

and emits ``new_text[len(prefix_text):]`` once it does not end in U+FFFD (an incomplete character). Then the
windows slide: ``prefix_offset = read_offset``, ``read_offset = len(ids)``. ``read_offset`` always sits on a
clean character boundary, so the concatenation of the deltas equals decoding all the output tokens at once;
:meth:`IncrementalDetokenizer.flush` emits any held-back tail (e.g. invalid bytes) when the request finishes,
after which the text equals a full decode exactly.

The window starts in the last few prompt tokens so the first generated token is decoded in context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "INITIAL_DETOKENIZATION_OFFSET", "SupportsDecode"]

#: Number of prompt tokens used as decoding context for the first output token (vLLM uses 5).
INITIAL_DETOKENIZATION_OFFSET = 5

_REPLACEMENT_CHAR = "\ufffd"


class SupportsDecode(Protocol):
    """What the detokenizer needs from a tokenizer (``deepinfer_npu.engine.tokenizer.Tokenizer`` fits)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class IncrementalDetokenizer:
    """Per-request incremental detokenizer.

    Usage::

        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=True)
        for tok in generated:
            delta = detok.add_token(tok)   # new text ("" while a character is incomplete)
        tail = detok.flush()               # at finish: emit whatever is held back
        detok.output_text                  # == tokenizer.decode(generated) for byte-level tokenizers

    ``output_text`` is the concatenation of all deltas returned so far.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Keep only the prompt tail that serves as decoding context: it is the first prefix window.
        start = max(0, len(prompt_token_ids) - INITIAL_DETOKENIZATION_OFFSET)
        self._ids: list[int] = [int(t) for t in prompt_token_ids[start:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self.output_text = ""
        self.num_output_tokens = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _emit(self, allow_incomplete: bool) -> str:
        """Emit the text of ``ids[read_offset:]`` if complete (or ``allow_incomplete``) and slide the
        windows."""
        if self._read_offset >= len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset)
        if new_text.startswith(self._prefix_text):
            start = len(self._prefix_text)
        else:
            # Only when the context itself ended mid-character (e.g. a token-id prompt cut inside a
            # character): the character completed by the output is attributed to the output.
            start = _common_prefix_len(new_text, self._prefix_text)
        delta = new_text[start:]
        if not delta or (delta.endswith(_REPLACEMENT_CHAR) and not allow_incomplete):
            return ""
        # Slide: the new prefix window is what used to be the read window.
        self._prefix_text = self._decode(self._read_offset, len(self._ids))
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the newly decoded text (may be empty)."""
        self._ids.append(int(token_id))
        self.num_output_tokens += 1
        return self._emit(allow_incomplete=False)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append several tokens one by one; return the concatenated new text."""
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """Emit text held back because it ended in an incomplete character (call once the request
        finishes)."""
        return self._emit(allow_incomplete=True)

    def token_text(self, token_id: int) -> str:
        """Decoded text of a single token on its own (honours ``skip_special_tokens``)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=self.skip_special_tokens)
