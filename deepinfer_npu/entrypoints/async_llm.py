"""``AsyncLLM``: the engine behind an asyncio server.

The engine runs in its own thread: it takes submissions and aborts from a command queue, steps while requests are
unfinished and hands each output to the request's stream with ``loop.call_soon_threadsafe``. The event loop never
takes the engine lock and never waits on the device; ``generate`` awaits only its own request's outputs.

A request whose consumer goes away (client disconnect, cancelled task) is aborted, which returns its KV blocks and
state slot. ``max_waiting_requests`` bounds the requests that have not produced their first token yet; beyond it a
submission fails with :class:`QueueFullError` (the server answers 503 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from deepinfer_npu.config import EngineConfig
from deepinfer_npu.engine.outputs import RequestOutput
from deepinfer_npu.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: How often the engine thread refreshes the stats snapshot that ``/metrics`` reads.
STATS_INTERVAL_S = 0.25
#: How long an idle engine thread sleeps before it looks at the command queue again.
IDLE_WAIT_S = 0.05


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` requests; retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served any more."""


@dataclasses.dataclass
class RequestTimes:
    """Wall-clock marks of one request (``time.monotonic``), for the latency metrics."""

    arrival: float
    first_token: float | None = None
    last_output: float | None = None


class RequestStream:
    """One admitted request's cumulative outputs, filled from the engine thread, read with ``async for``.
    ``close()`` aborts the request unless it finished (call it in a ``finally``)."""

    def __init__(self, llm: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.llm = llm
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shutting down): nobody reads this stream any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.llm.abort(self.request_id)


class AsyncLLM:
    """Serve requests from coroutines. ``AsyncLLM(EngineConfig(...))`` starts the engine thread; ``generate``
    streams a request's cumulative outputs; ``shutdown`` stops it (aborting what is left)."""

    def __init__(self, config: EngineConfig, *, max_waiting_requests: int | None = None,
                 observer: Callable[[str, str, RequestOutput | None, RequestTimes], None] | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1 or None (unbounded), got {max_waiting_requests}")
        from deepinfer_npu.engine.llm import create_engine

        self.engine = create_engine(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = int(self.engine.max_model_len)
        self.vocab_size = int(self.engine.vocab_size)
        self.max_waiting_requests = max_waiting_requests
        self._observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._waiting: set[str] = set()  # engine thread only: submitted, no output yet
        self._times: dict[str, RequestTimes] = {}  # engine thread only
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self.dead_error: BaseException | None = None
        self.stats: dict = self.engine.get_stats()
        self.stats_time = time.monotonic()
        self.num_waiting = 0
        self.num_running = 0
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def prepare_structured_output(self):
        """Build the grammar compiler off the request path: one engine's on a thread (-> the thread, or None where
        structured output cannot run), a data-parallel engine's in each rank (-> per rank, whether it started)."""
        return self.engine.prepare_structured_output()

    # ------------------------------------------------------------------ public API (event loop side)
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None and not self._stopping.is_set()

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    async def add_request(self, request_id: str, prompt, sampling_params: SamplingParams) -> RequestStream:
        """Submit one request; returns once the engine admitted it. Raises ``ValueError`` / ``TypeError`` for a
        bad request, :class:`QueueFullError`, or :class:`EngineDeadError`."""
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", request_id, prompt, sampling_params, stream, admitted))
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been admitted meanwhile
            raise
        return stream

    async def generate(self, prompt, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its cumulative outputs until the finished one. Leaving the loop early
        (or cancellation) aborts the request."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op when it already finished); its blocks and state slot are returned."""
        self._send(("abort", request_id))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort every unfinished request, stop the engine thread and release the engine (rank processes)."""
        if self._stopping.is_set() and not self._thread.is_alive():
            return
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s (a step is stuck on the device?)", timeout_s)
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ------------------------------------------------------------------ engine thread
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._handle_commands()
                busy = self.engine.has_unfinished_requests()
                if busy:
                    self.engine.step_for_sinks()
                self._refresh_stats()
                if not busy:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
            self._abort_all("the server is shutting down")
        except BaseException as e:  # noqa: BLE001 - every stream learns why, then the thread ends
            logger.exception("the engine stopped on an error")
            self.dead_error = e
            self._fail_all(EngineDeadError(self._dead_message()))

    def _dead_message(self) -> str:
        if self.dead_error is not None:
            return f"the engine stopped on an error: {type(self.dead_error).__name__}: {self.dead_error}"
        return "the engine is shut down"

    def _handle_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            elif command[1] in self._streams:
                self.engine.abort_request(command[1])

    def _add(self, request_id: str, prompt, params: SamplingParams, stream: RequestStream,
             admitted: concurrent.futures.Future) -> None:
        if not admitted.set_running_or_notify_cancel():  # the caller went away before it was admitted
            return
        if self._stopping.is_set():
            admitted.set_exception(EngineDeadError("the server is shutting down"))
            return
        if self.max_waiting_requests is not None and len(self._waiting) >= self.max_waiting_requests:
            admitted.set_exception(QueueFullError(
                f"{len(self._waiting)} requests are waiting for their first token "
                f"(max_waiting_requests={self.max_waiting_requests}); retry later"))
            return
        times = RequestTimes(arrival=time.monotonic())
        try:
            self.engine.add_requests([(request_id, prompt, params)],
                                     output_sink=lambda out: self._deliver(out, stream, times))
        except Exception as e:  # noqa: BLE001 - the caller's error (bad prompt, ids, parameters)
            admitted.set_exception(e)
            return
        self._waiting.add(request_id)
        self._times[request_id] = times
        self._streams[request_id] = stream
        self._count()
        admitted.set_result(None)
        self._observe("added", request_id, None, times)

    def _deliver(self, out: RequestOutput, stream: RequestStream, times: RequestTimes) -> None:
        rid = out.request_id
        now = time.monotonic()
        event = "output"
        if rid in self._waiting:
            self._waiting.discard(rid)
            if any(c.token_ids for c in out.outputs):
                times.first_token, event = now, "first_token"
        self._observe(event, rid, out, times)
        times.last_output = now
        if out.finished:
            self._streams.pop(rid, None)
            self._times.pop(rid, None)
            self._waiting.discard(rid)
            self._observe("finished", rid, out, times)
        self._count()
        stream.put_threadsafe(out)

    def _count(self) -> None:
        self.num_waiting = len(self._waiting)
        self.num_running = len(self._streams) - self.num_waiting

    def _observe(self, event: str, request_id: str, out: RequestOutput | None, times: RequestTimes) -> None:
        if self._observer is not None:
            try:
                self._observer(event, request_id, out, times)
            except Exception:  # noqa: BLE001 - metrics never take the engine down
                logger.exception("metrics observer failed on %s", event)

    def _refresh_stats(self) -> None:
        now = time.monotonic()
        if now - self.stats_time >= STATS_INTERVAL_S:
            self.stats = self.engine.get_stats()
            self.stats_time = now

    def _abort_all(self, reason: str) -> None:
        ids = list(self._streams)
        if ids:
            logger.warning("aborting %d unfinished requests: %s", len(ids), reason)
            self.engine.abort_request(ids)
            self.engine.step_for_sinks()  # hands the abort outputs to their streams
        self._drain_rejected(reason)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_threadsafe(error)
        self._streams.clear()
        self._drain_rejected(str(error))

    def _drain_rejected(self, reason: str) -> None:
        """Submissions still queued will not run: their callers get the reason."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add" and not command[-1].done():
                command[-1].set_exception(EngineDeadError(reason))
