"""The comparison rules (DESIGN §8), pure functions over recorded traces.

* fp32: tokens identical, every position.
* bf16: vLLM's logprobs-close rule (``tests/models/utils.py: check_logprobs_close``): walk both sequences; at
  the first position where the tokens differ, each side's token must be among the other's top-k logprobs;
  after that position the sequences may diverge freely, so comparison stops.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Verdict:
    ok: bool
    message: str


def tokens_identical(a: list[int], b: list[int]) -> Verdict:
    if a == b:
        return Verdict(True, f"{len(a)} tokens identical")
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return Verdict(
        False,
        f"tokens differ at position {first}: {a[first : first + 4]} vs {b[first : first + 4]} "
        f"(lengths {len(a)}, {len(b)})",
    )


def logprobs_close(
    a_tokens: list[int], a_top: list[list[int]], b_tokens: list[int], b_top: list[list[int]]
) -> Verdict:
    """``*_top[i]``: the top-k token ids at position i (most likely first)."""
    for i, (x, y) in enumerate(zip(a_tokens, b_tokens)):
        if x == y:
            continue
        if x in b_top[i] and y in a_top[i]:
            return Verdict(True, f"first difference at {i} ({x} vs {y}) is within both top-{len(a_top[i])}")
        return Verdict(
            False,
            f"position {i}: {x} vs {y}; {x} in other's top: {x in b_top[i]}, "
            f"{y} in this top: {y in a_top[i]}",
        )
    if len(a_tokens) != len(b_tokens):
        return Verdict(False, f"same prefix but lengths differ ({len(a_tokens)} vs {len(b_tokens)})")
    return Verdict(True, f"{len(a_tokens)} tokens identical")


def compare_trace(dtype: str, a: dict, b: dict) -> Verdict:
    """Apply the rule for ``dtype`` to two traces ``{"tokens": [...], "top": [[ids...] per position]}``."""
    if dtype == "float32":
        return tokens_identical(a["tokens"], b["tokens"])
    return logprobs_close(a["tokens"], a["top"], b["tokens"], b["top"])
