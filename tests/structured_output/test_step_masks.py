"""A step's structured-output ban masks (``step_masks``) against a per-token oracle, and what building them costs
the host: one host-to-device copy and a fixed handful of device ops per step whatever the number of constrained
rows, and mask fills on the calling thread (xgrammar starts a new thread pool on every threaded call)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import xgrammar as xgr
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.engine.tokenizer import load_tokenizer
from deepinfer_npu.structured_output import StructuredOutputsParams, matcher, step_masks
from deepinfer_npu.structured_output.grammar import GrammarCompilerPool
from deepinfer_npu.structured_output.matcher import RequestGrammar, allowed_mask, new_bitmask

from .test_grammar import _valid_tokens, random_schema

pytestmark = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "tokenizer.json").exists(), reason="no tokenizer")
VOCAB = 4096
_VIEWS = {"view", "_unsafe_view", "reshape", "unsqueeze", "slice", "alias", "detach", "lift_fresh", "expand"}


@pytest.fixture(scope="module")
def pool():
    tok = load_tokenizer(str(REFERENCE_MODEL_DIR))
    p = GrammarCompilerPool(tok, VOCAB, tok.eos_token_ids)
    yield p
    p.shutdown()


class _DeviceOps(TorchDispatchMode):
    """Counts the aten ops that compute (each is a launch on a device); views and host-tensor wrapping are free."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class _ToDevice:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, a: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        self.calls += 1
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def _batch(pool, rng: random.Random, gen: torch.Generator, n: int, max_q: int):
    """``n`` rows, about half constrained (random schemas, a choice), each somewhere into its output, with drafts
    the grammar accepts, rejects part-way or lacks; per token the draft it verifies (the assumed one, another
    token, or none at the row's last position) -> (grammars, row, j, draft_next)."""
    constraints = [StructuredOutputsParams(json=random_schema(random.Random(s))) for s in range(4)]
    constraints.append(StructuredOutputsParams(choice=["yes", "no"]))
    grammars = []
    for _ in range(n):
        if rng.random() < 0.5:
            grammars.append(None)
            continue
        g = RequestGrammar(pool.compile(rng.choice(constraints)).result(timeout=60), VOCAB)
        g.accept(_valid_tokens(g, rng.randint(0, 10), gen))
        d = _valid_tokens(g, rng.randint(0, max_q - 1), gen) if max_q > 1 else []
        if d and rng.random() < 0.3:
            d[rng.randrange(len(d))] = rng.randrange(VOCAB)
        g.drafts = np.asarray(d, dtype=np.int64) if d or rng.random() < 0.5 else None
        grammars.append(g)
    q = [rng.randint(1, max_q) for _ in range(n)]
    row = torch.tensor([r for r in range(n) for _ in range(q[r])], dtype=torch.int64)
    j = torch.tensor([p for r in range(n) for p in range(q[r])], dtype=torch.int64)
    draft_next = []
    for r in range(n):
        g = grammars[r]
        d = [] if g is None or g.drafts is None else g.drafts.tolist()
        for p in range(q[r]):
            if p == q[r] - 1:
                draft_next.append(-1)
            else:
                draft_next.append(d[p] if p < len(d) and rng.random() < 0.8 else rng.randrange(VOCAB))
    return grammars, row, j, torch.tensor(draft_next, dtype=torch.int64)


def _oracle(grammars, row, j, draft_next, max_q: int) -> torch.Tensor:
    """Per token: the grammar's mask after the row's first ``j`` assumed drafts (all banned past them), and the
    token's own draft banned where it differs from the assumed one; nothing banned in unconstrained rows."""
    out = torch.zeros(len(row), VOCAB, dtype=torch.bool)
    for t, (r, p, dn) in enumerate(zip(row.tolist(), j.tolist(), draft_next.tolist())):
        g = grammars[r]
        if g is None:
            continue
        d = [] if g.drafts is None else g.drafts[: max_q - 1].tolist()
        masks = new_bitmask(len(d) + 1, VOCAB)
        g.fill(masks, 0, d)
        out[t] = ~allowed_mask(masks, VOCAB)[p] if p <= len(d) else True
        if dn >= 0 and (p >= len(d) or d[p] != dn):
            out[t, dn] = True
    return out


@pytest.mark.parametrize("max_q", [1, 2, 4])
def test_decode_masks_match_the_per_token_oracle(pool, max_q):
    rng, gen = random.Random(max_q), torch.Generator().manual_seed(max_q)
    for _ in range(12):
        grammars, row, j, draft_next = _batch(pool, rng, gen, rng.randint(1, 10), max_q)
        got = step_masks.decode_banned(grammars, len(grammars), max_q, row, j, draft_next, VOCAB, _ToDevice())
        if all(g is None for g in grammars):
            assert got is None
            continue
        assert torch.equal(got, _oracle(grammars, row, j, draft_next, max_q))


def test_prefill_masks_match_the_per_row_masks(pool):
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    grammars, *_ = _batch(pool, rng, gen, 8, 1)
    if all(g is None for g in grammars):
        grammars[0] = RequestGrammar(pool.compile(StructuredOutputsParams(choice=["yes", "no"])).result(), VOCAB)
    sample_rows = np.array([0, 1, 1, 3, 5, 7])  # a forked request samples twice from its row
    got = step_masks.prefill_banned(grammars, sample_rows, VOCAB, _ToDevice())
    for s, i in enumerate(sample_rows.tolist()):
        expected = torch.zeros(VOCAB, dtype=torch.bool)
        if grammars[i] is not None:
            masks = new_bitmask(1, VOCAB)
            grammars[i].fill(masks, 0)
            expected = ~allowed_mask(masks, VOCAB)[0]
        assert torch.equal(got[s], expected)


@pytest.mark.parametrize("max_q", [1, 4])
def test_one_copy_and_a_fixed_number_of_device_ops_per_step(pool, max_q):
    """The device work of the masks does not grow with the constrained rows: one host-to-device copy of one
    buffer and the same ops for 1 or 24 constrained rows (two without drafts: a word-and and a compare), once the
    bit constants are on the device."""
    compiled = pool.compile(StructuredOutputsParams(choice=["yes", "no"])).result()
    counts = []
    for constrained in (1, 24):
        n = 32
        grammars = [RequestGrammar(compiled, VOCAB) if i < constrained else None for i in range(n)]
        row = torch.arange(n).repeat_interleave(max_q)
        j = torch.arange(max_q).repeat(n)
        draft_next = torch.where(j < max_q - 1, 7, -1)
        step_masks.decode_banned(grammars, n, max_q, row, j, draft_next, VOCAB, _ToDevice())  # the bit constants
        to_device = _ToDevice()
        with _DeviceOps() as ops:
            step_masks.decode_banned(grammars, n, max_q, row, j, draft_next, VOCAB, to_device)
        assert to_device.calls == 1
        counts.append(sorted(ops.ops))
    assert counts[0] == counts[1]
    if max_q == 1:
        assert counts[0] == ["bitwise_and", "eq"]


def test_small_batches_fill_on_the_calling_thread(pool, monkeypatch):
    """xgrammar's threaded batch fill starts a thread pool per call ("auto": half the host's cores): a step's
    masks are filled on one thread unless the batch is large, and never with more threads than this process's
    CPUs allow."""
    made = []
    real = xgr.BatchGrammarMatcher

    def record(max_threads="auto"):
        made.append(max_threads)
        return real(max_threads=1)

    monkeypatch.setattr(matcher, "_batch", {})
    monkeypatch.setattr(xgr, "BatchGrammarMatcher", record)
    compiled = pool.compile(StructuredOutputsParams(choice=["yes", "no"])).result()
    for rows in (1, 16, matcher.PARALLEL_FILL_ROWS - 1):
        grammars = [RequestGrammar(compiled, VOCAB) for _ in range(rows)]
        matcher.fill_rows(grammars, new_bitmask(rows, VOCAB), list(range(rows)), [[7]] * rows)
    assert made == [1]  # one single-threaded batch matcher, made once and reused
    cpus = len(os.sched_getaffinity(0))
    for rows in (64, 256, 4096):
        assert 1 <= matcher.fill_threads(rows) <= max(1, min(8, cpus // 2))


def test_an_ended_grammar_allows_only_stop_tokens(pool):
    """A grammar that accepted its stop token (its request stops after this step) fills a row of stop tokens,
    next to a live one; xgrammar itself refuses to fill a mask after the end."""
    tok = load_tokenizer(str(REFERENCE_MODEL_DIR))
    compiled = pool.compile(StructuredOutputsParams(choice=["yes", "no"])).result()
    ended, live = RequestGrammar(compiled, VOCAB), RequestGrammar(compiled, VOCAB)
    ended.accept(tok.encode("yes", add_special_tokens=False) + [tok.eos_token_ids[0]])
    assert ended.is_terminated and not ended.failed
    bitmask = new_bitmask(2, VOCAB)
    matcher.fill_rows([live, ended], bitmask, [0, 1])
    allowed = allowed_mask(bitmask, VOCAB)
    assert set(allowed[1].nonzero().flatten().tolist()) == set(ended.matcher.stop_token_ids)
    expected = new_bitmask(1, VOCAB)
    live.matcher.fill_next_token_bitmask(expected, 0)
    assert torch.equal(bitmask[0], expected[0])
