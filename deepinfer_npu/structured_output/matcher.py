"""One request's grammar state: an xgrammar matcher advanced on the tokens the request keeps, and the rows of
the token bitmask for its next sampling position and for each draft position after it.

Draft positions: the matcher accepts the drafts tentatively, fills the mask at each position and is rolled back,
so a draft the grammar rejects makes every later position's mask all-false beyond it (the verifier then rejects
there). The bitmask layout is xgrammar's: int32 words, bit ``t % 32`` of word ``t // 32`` allows token ``t``.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import xgrammar as xgr
except ImportError:  # only structured output needs it: the engine imports and serves the other requests
    xgr = None

__all__ = ["RequestGrammar", "allowed_mask", "fill_rows", "new_bitmask"]

_batch: xgr.BatchGrammarMatcher | None = None  # xgrammar's threaded batch calls (one pool for the process)


def _batch_matcher() -> xgr.BatchGrammarMatcher:
    global _batch
    if _batch is None:
        _batch = xgr.BatchGrammarMatcher(max_threads="auto")
    return _batch


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask ``[rows, ceil(vocab / 32)]`` (xgrammar's layout), every token allowed."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def allowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[rows, vocab_size]`` from an int32 bitmask ``[rows, ceil(vocab / 32)]`` (the reference unpacking;
    any device)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class RequestGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.failed = False  # a kept token the grammar did not accept (only possible for a bug or a forced token)
        self.drafts: np.ndarray | None = None  # the drafts proposed for the request's next step (speculation)

    def fresh(self) -> RequestGrammar:
        """A matcher of the same grammar at its start (a forked completion replays its own tokens)."""
        return RequestGrammar(self.compiled, self.vocab_size)

    def accept(self, tokens: list[int]) -> None:
        """Advance over the tokens the request kept (stops at the grammar's end)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(t)):
                self.failed = True
                return

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] | np.ndarray = ()) -> None:
        """Fill rows ``row .. row + len(drafts)`` of ``bitmask``: the next position, then the position after each
        draft. Past a draft the grammar rejects, rows are all-false (the verifier rejects that draft anyway).
        One request's :func:`fill_rows`."""
        fill_rows([self], bitmask, [row], [list(drafts)])

    def _only_stop(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for t in self.matcher.stop_token_ids:
            bit = 1 << (t % 32)
            bitmask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words: bit 31 is the sign


def fill_rows(grammars: list[RequestGrammar], bitmask: torch.Tensor, rows: list[int],
              drafts: list[list[int]] | None = None) -> None:
    """``RequestGrammar.fill`` for many requests at once: grammar ``i`` fills rows ``rows[i] ..
    rows[i] + len(drafts[i])`` (the next position, then the position after each draft). Each draft depth is one
    threaded xgrammar call over every request still accepting, so the cost per step grows with the draft depth,
    not with the number of constrained requests."""
    batch = _batch_matcher()
    drafts = drafts if drafts is not None else [[] for _ in grammars]
    accepted = [0] * len(grammars)
    live = list(range(len(grammars)))
    k = 0
    while live:
        running = []
        for i in live:
            if grammars[i].matcher.is_terminated():
                grammars[i]._only_stop(bitmask, rows[i] + k)  # the grammar ended: only a stop token may follow
            else:
                running.append(i)
        if running:
            batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in running], bitmask,
                                                [rows[i] + k for i in running])
        deeper = [i for i in running if k < len(drafts[i])]
        ok = batch.batch_accept_token([grammars[i].matcher for i in deeper], [int(drafts[i][k]) for i in deeper]) \
            if deeper else []
        accepts = dict(zip(deeper, ok))
        for i in live:
            if k < len(drafts[i]) and not accepts.get(i, False):
                bitmask[rows[i] + k + 1: rows[i] + len(drafts[i]) + 1] = 0  # rejected here: all-false after it
        live = [i for i, a in zip(deeper, ok) if a]
        for i in live:
            accepted[i] += 1
        k += 1
    back = [i for i in range(len(grammars)) if accepted[i]]
    if back:
        batch.batch_rollback([grammars[i].matcher for i in back], [accepted[i] for i in back])
