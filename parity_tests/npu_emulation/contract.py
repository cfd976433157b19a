"""Contract bookkeeping for the emulated ops: violations raise, and every emulated op call is counted (tests assert which fused
ops the backend actually used)."""

from __future__ import annotations

from collections import Counter

CALLS: Counter[str] = Counter()


class ContractError(AssertionError):
    """The backend called a torch_npu op outside its documented contract."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ContractError(message)


def record(op: str) -> None:
    CALLS[op] += 1
