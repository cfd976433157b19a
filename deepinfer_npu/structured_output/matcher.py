"""One request's grammar state: an xgrammar matcher advanced on the tokens the request keeps, and the rows of
the token bitmask for its next sampling position and for each draft position after it.

Draft positions: the matcher accepts the drafts tentatively, fills the mask at each position and is rolled back,
so a draft the grammar rejects makes every later position's mask all-false beyond it (the verifier then rejects
there). The bitmask layout is xgrammar's: int32 words, bit ``t % 32`` of word ``t // 32`` allows token ``t``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = ["RequestGrammar", "allowed_mask", "fill_rows", "new_bitmask"]

# xgrammar's BatchGrammarMatcher starts (and joins) a new thread pool on every threaded call, and its "auto" is half
# of std::thread::hardware_concurrency(): every core of the host, not the CPUs this process may use. Starting a
# thread costs tens of µs (a one-row fill: ~8 µs on one thread, ~100-170 µs on two), so "auto" costs each step
# time that grows with the host's cores, whatever the batch, far beyond the fill itself. Rows are filled by one
# call on the calling thread (one crossing into C++ for the whole batch); only batches large enough to pay for
# starting threads get a few.
PARALLEL_FILL_ROWS = 64  # fewer rows: one thread
_ROWS_PER_THREAD = 32
_batch: dict[int, xgr.BatchGrammarMatcher] = {}


def fill_threads(rows: int) -> int:
    """Threads of a batched mask fill of ``rows`` rows."""
    if rows < PARALLEL_FILL_ROWS:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(rows // _ROWS_PER_THREAD, cpus // 2, 8))


def xgrammar():
    """The xgrammar module, imported at the first grammar (its import, with transformers and TVM's FFI under it,
    takes seconds: every engine and rank process would pay it at start-up, structured output or not)."""
    import xgrammar as xgr

    return xgr


def _batch_matcher(rows: int) -> xgr.BatchGrammarMatcher:
    threads = fill_threads(rows)
    batch = _batch.get(threads)
    if batch is None:
        batch = _batch[threads] = xgrammar().BatchGrammarMatcher(max_threads=threads)
    return batch


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
        self.matcher = xgrammar().GrammarMatcher(compiled)
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

    def _only_stop(self, words: np.ndarray, row: int) -> None:
        """Row ``row`` of the bitmask ``words`` (as unsigned words) allows the stop tokens only."""
        words[row] = 0
        for t in self.matcher.stop_token_ids:
            words[row, t // 32] |= np.uint32(1 << (t % 32))


def fill_rows(grammars: list[RequestGrammar], bitmask: torch.Tensor, rows: list[int],
              drafts: list[list[int]] | None = None) -> None:
    """``RequestGrammar.fill`` for many requests at once: grammar ``i`` fills rows ``rows[i] ..
    rows[i] + len(drafts[i])`` (the next position, then the position after each draft). Each draft depth is one
    batched xgrammar call over every request still accepting (``fill_threads`` threads)."""
    batch = _batch_matcher(len(grammars))
    matchers = [g.matcher for g in grammars]
    words = None  # the bitmask's memory as unsigned words, for the rows set here (an ended grammar, a rejection)
    if drafts is None or not any(len(d) for d in drafts):  # the next position only: one call
        running = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if len(running) < len(matchers):
            words = bitmask.numpy().view(np.uint32)
            for i in sorted(set(range(len(matchers))) - set(running)):
                grammars[i]._only_stop(words, rows[i])  # the grammar ended: only a stop token may follow
        if running:
            batch.batch_fill_next_token_bitmask([matchers[i] for i in running], bitmask, [rows[i] for i in running])
        return
    accepted = [0] * len(grammars)
    live = list(range(len(grammars)))
    k = 0
    while live:
        running = []
        for i in live:
            if matchers[i].is_terminated():
                words = bitmask.numpy().view(np.uint32) if words is None else words
                grammars[i]._only_stop(words, rows[i] + k)
            else:
                running.append(i)
        if running:
            batch.batch_fill_next_token_bitmask([matchers[i] for i in running], bitmask,
                                                [rows[i] + k for i in running])
        deeper = [i for i in running if k < len(drafts[i])]
        ok = batch.batch_accept_token([matchers[i] for i in deeper], [int(drafts[i][k]) for i in deeper]) \
            if deeper else []
        accepts = dict(zip(deeper, ok))
        for i in live:
            if k < len(drafts[i]) and not accepts.get(i, False):
                words = bitmask.numpy().view(np.uint32) if words is None else words
                words[rows[i] + k + 1: rows[i] + len(drafts[i]) + 1] = 0  # rejected here: all-false after it
        live = [i for i, a in zip(deeper, ok) if a]
        for i in live:
            accepted[i] += 1
        k += 1
    back = [i for i in range(len(grammars)) if accepted[i]]
    if back:
        batch.batch_rollback([matchers[i] for i in back], [accepted[i] for i in back])
