"""``StructuredOutputsParams``: what a request's output must match (vLLM's names and validation).

Exactly one constraint per request: ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice``
(one of a list of strings), ``grammar`` (EBNF, GBNF style as xgrammar reads it) or ``json_object=True`` (any JSON
object). ``disable_any_whitespace`` makes JSON output compact (no free whitespace between tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutputsParams"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or json_object=True, "
                f"got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(parsed).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty EBNF string")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal for constraints that compile to the same grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            value = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        return kind, str(value), self.disable_any_whitespace
