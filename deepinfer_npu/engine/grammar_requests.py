"""The engine's side of structured output: requests wait for their grammar before they are scheduled, and every
request's grammar follows the tokens it keeps.

A constrained request is checked when added (a schema or regex that does not parse is a ``ValueError`` naming it),
then its grammar compiles in the compiler pool's threads; the request enters the scheduler once that is done, so it
never holds up other requests. ``advance`` is the worker's result listener: it runs as soon as a step's results
are on the host, before the next step's sampling is launched, and moves each grammar past the step's tokens and
records the drafts proposed for the next step (the masks of the draft positions follow them).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import logging
import threading

from deepinfer_npu.engine.request import Request
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.worker.step_io import StepResult

logger = logging.getLogger(__name__)


class GrammarRequests:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._pool = None
        self._pool_lock = threading.Lock()  # the engine thread and prepare()'s thread may both build it
        self.awaiting: list[Request] = []
        self.by_seq: dict[int, Request] = {}  # the engine's map, for the listener

    @property
    def pool(self):
        with self._pool_lock:
            if self._pool is None:
                from deepinfer_npu.structured_output.grammar import GrammarCompilerPool

                self._pool = GrammarCompilerPool(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._pool

    @property
    def ready(self) -> bool:
        """Whether the compiler pool is built (a constrained request then only compiles its grammar)."""
        return self._pool is not None

    def prepare(self) -> threading.Thread | None:
        """Build the compiler pool (xgrammar's import, the tokenizer's vocabulary for it) on a daemon thread, so a
        long-lived server's first constrained request does not wait seconds for it -> the thread, or None where
        structured output cannot run (no tokenizer, no xgrammar: such requests are refused when they come)."""
        if self.tokenizer is None or importlib.util.find_spec("xgrammar") is None:
            return None

        def build() -> None:
            try:
                self.pool  # noqa: B018 - built for its side effect
            except Exception as e:  # noqa: BLE001 - the first constrained request builds it again and says why
                logger.warning("structured output: preparing the grammar compiler failed (%s: %s)",
                               type(e).__name__, e)

        thread = threading.Thread(target=build, name="deepinfer-grammar-prepare", daemon=True)
        thread.start()
        return thread

    def check(self, request_id: str, params: SamplingParams) -> None:
        if params.structured_outputs is None:
            return
        if self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: structured_outputs needs the model's tokenizer "
                             "(tokenizer.json), which this model directory lacks")
        if importlib.util.find_spec("xgrammar") is None:
            raise ValueError(f"request {request_id!r}: structured_outputs needs the xgrammar package, which is not "
                             "installed here (pip install xgrammar)")
        try:
            self.pool.check(params.structured_outputs)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None

    def start(self, req: Request) -> None:
        req.grammar_future = self.pool.compile(req.params.structured_outputs)
        self.awaiting.append(req)

    def take_compiled(self) -> list[tuple[Request, BaseException | None]]:
        """Requests whose compilation ended (each with its error, or None and ``req.grammar`` set)."""
        done = []
        for req in [r for r in self.awaiting if r.grammar_future.done()]:
            self.awaiting.remove(req)
            future, req.grammar_future = req.grammar_future, None
            error = future.exception()
            if error is None:
                from deepinfer_npu.structured_output.matcher import RequestGrammar

                req.grammar = RequestGrammar(future.result(), self.vocab_size)
            done.append((req, error))
        return done

    def wait(self, timeout_s: float) -> None:
        """Sleep until a compilation ends (at most ``timeout_s``): an engine with nothing else to run."""
        futures = [r.grammar_future for r in self.awaiting]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def discard(self, req: Request) -> None:
        """An aborted request that was still waiting for its grammar."""
        if req in self.awaiting:
            self.awaiting.remove(req)
        req.grammar_future = None

    def advance(self, res: StepResult) -> None:
        for i, seq_id in enumerate(res.seq_ids.tolist()):
            req = self.by_seq.get(seq_id)
            if req is not None and req.grammar is not None and res.token_ids[i]:
                req.grammar.accept(res.token_ids[i])
        if res.proposals is not None and res.proposing_rows is not None:
            for k, i in enumerate(res.proposing_rows.tolist()):
                req = self.by_seq.get(int(res.seq_ids[i]))
                if req is not None and req.grammar is not None:
                    req.grammar.drafts = res.proposals[k]

    @staticmethod
    def fork(child: Request, parent: Request, tokens: list[int]) -> None:
        """A completion forked off ``parent``: a matcher of its own over ``tokens`` (its outputs so far), and
        the parent's pending drafts, which its first step verifies."""
        if parent.grammar is None:
            return
        child.grammar = parent.grammar.fresh()
        child.grammar.accept(tokens)
        child.grammar.drafts = parent.grammar.drafts
