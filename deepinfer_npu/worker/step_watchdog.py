"""The step watchdog: a process whose device never finishes a step ends with a message instead of waiting forever.

A kernel that never ends (a deadlock inside it, or between kernels resident on one SM) leaves the host in the step's
``Event.synchronize()`` for good: no exception, no log line, a server holding its clients' connections. CUDA has no
timed wait, so the worker marks that wait (``StepReadback._post_process``, where each step's results are waited for)
and a daemon thread checks the mark: a wait longer than ``DEEPINFER_STEP_TIMEOUT`` seconds (default 600, above
``distributed_timeout_s``' 300 so that a lost rank's error, which names the rank, comes first; SGLang's
``--watchdog-timeout`` does the same) logs which step it was, prints every thread's Python stack and exits the process
with ``STEP_TIMEOUT_EXIT_CODE``. A stuck device cannot be recovered from inside the process (its context is unusable),
so a supervisor restarts it; exiting is what keeps it from serving nothing while looking alive. Other host waits
(graph capture, a benchmark's own ``torch.cuda.synchronize``, launches under ``CUDA_LAUNCH_BLOCKING``) are not
watched.

Cost on the hot path: a context manager, a clock read and a lambda a step (about a microsecond). The thread wakes
every ``poll_s`` (at most a second) and ends when its watchdog is collected (the engine dropped).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager

logger = logging.getLogger("deepinfer_npu.worker")

#: the exit code of a process the watchdog ended (EX_SOFTWARE)
STEP_TIMEOUT_EXIT_CODE = 70


def exit_process(message: str) -> None:
    """The default action: the message and every thread's stack on the process's stderr (file descriptor 2, whatever
    ``sys.stderr`` was replaced by), then ``os._exit``, whatever the reporting raised (the main thread is blocked
    inside the device runtime, so no exception can reach it)."""
    try:  # the raw writes first: a logging handler's lock held by the stuck thread must not keep the process alive
        os.write(2, f"deepinfer_npu: {message}\n".encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
        logger.error("%s", message)
    finally:
        os._exit(STEP_TIMEOUT_EXIT_CODE)


def _watch(ref: weakref.ref) -> None:
    """The thread's loop; holds its watchdog only while checking it, so that the engine can be collected."""
    while True:
        dog = ref()
        if dog is None or dog.fired:
            return
        poll = dog.poll_s
        since = dog._since
        if since is not None and time.monotonic() - since > dog.timeout_s:
            dog.fired = True
            what = dog._what() if callable(dog._what) else dog._what
            dog.on_timeout(
                f"{what} has not finished on {dog.device} after {time.monotonic() - since:.0f} s "
                f"(DEEPINFER_STEP_TIMEOUT={dog.timeout_s:g}): a kernel never ended, and a stuck device cannot be "
                f"recovered in this process, so it exits with code {STEP_TIMEOUT_EXIT_CODE}; the Python stacks of "
                f"its threads follow. On CUDA, to see which kernel and where its warps wait: run again with "
                f"DEEPINFER_STEP_TIMEOUT=0 and, once it stalls, `cuda-gdb -p <pid> -batch -ex 'info cuda kernels' "
                f"-ex 'info cuda warps'`; a run with DEEPINFER_PDL_OFF=all (kernels launched without programmatic "
                f"dependent launch) shows whether the overlap of kernels is involved")
            return
        del dog
        time.sleep(poll)


class StepWatchdog:
    """Ends the process when one :meth:`waiting` block lasts longer than ``timeout_s`` seconds (0: never)."""

    def __init__(self, timeout_s: float, device: str = "the device",
                 on_timeout: Callable[[str], None] = exit_process, poll_s: float | None = None) -> None:
        if timeout_s < 0:
            raise ValueError(f"step watchdog: timeout {timeout_s} s must be >= 0 (0 turns it off)")
        self.timeout_s = float(timeout_s)
        self.device = device
        self.on_timeout = on_timeout
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.01, self.timeout_s / 10))
        self._since: float | None = None  # monotonic start of the wait in progress
        self._what: str | Callable[[], str] = ""
        self._thread: threading.Thread | None = None
        self.fired = False

    @contextmanager
    def waiting(self, what: str | Callable[[], str]):
        """Mark a host wait for the device; ``what`` (or what it returns, asked only if the wait times out) names it
        in the message."""
        if self.timeout_s <= 0:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=_watch, args=(weakref.ref(self),), name="deepinfer-step-watchdog",
                                            daemon=True)
            self._thread.start()
        self._what = what
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None
