"""The step watchdog: a process whose device never finishes a step ends with a message instead of waiting forever.

A kernel that never ends (a deadlock inside it, or between kernels resident on one SM) leaves the host in
``Event.synchronize()`` for good: no exception, no log line, the server holding its clients' connections. CUDA has
no timed wait, so the worker marks its one wait a step (``StepReadback._post_process``) and a daemon thread checks
the mark: a wait longer than ``DEEPINFER_STEP_TIMEOUT`` seconds (default 600, above ``distributed_timeout_s``' 300
so that a lost rank's error, which names the rank, comes first; SGLang's ``--watchdog-timeout`` does the same) logs
which step it was, prints every thread's Python stack and exits the process with
``STEP_TIMEOUT_EXIT_CODE``. A stuck device cannot be recovered from inside the process (its context is unusable),
so a supervisor restarts it; exiting is what keeps it from serving nothing while looking alive.

Cost on the hot path: two attribute writes a step. The thread wakes every ``poll_s`` (at most a second).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

logger = logging.getLogger("deepinfer_npu.worker")

#: the exit code of a process the watchdog ended (EX_SOFTWARE)
STEP_TIMEOUT_EXIT_CODE = 70


def exit_process(message: str) -> None:
    """The default action: the message, every thread's stack on stderr, then ``os._exit`` (the main thread is
    blocked inside the device runtime, so no exception can reach it)."""
    logger.error("%s", message)
    print(f"deepinfer_npu: {message}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(STEP_TIMEOUT_EXIT_CODE)


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
        self._what = ""
        self._thread: threading.Thread | None = None
        self.fired = False

    @contextmanager
    def waiting(self, what: str):
        """Mark a host wait for the device; ``what`` names it in the message."""
        if self.timeout_s <= 0:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="deepinfer-step-watchdog", daemon=True)
            self._thread.start()
        self._what = what
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while not self.fired:
            time.sleep(self.poll_s)
            since = self._since
            if since is None:
                continue
            waited = time.monotonic() - since
            if waited > self.timeout_s:
                self.fired = True
                self.on_timeout(
                    f"{self._what} has not finished on {self.device} after {waited:.0f} s "
                    f"(DEEPINFER_STEP_TIMEOUT={self.timeout_s:g}): a kernel never ended, and a stuck device cannot "
                    f"be recovered in this process, so it exits with code {STEP_TIMEOUT_EXIT_CODE}; the Python "
                    f"stacks of its threads follow")
