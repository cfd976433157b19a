"""The step watchdog (deepinfer_npu/worker/step_watchdog.py): a host wait for the device that outlasts
DEEPINFER_STEP_TIMEOUT ends the process with the step named and every thread's stack, a shorter one does nothing,
and the worker's one wait a step is the one watched."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from deepinfer_npu import envs
from deepinfer_npu.worker.step_watchdog import STEP_TIMEOUT_EXIT_CODE, StepWatchdog


def test_a_wait_past_the_timeout_fires_once_with_its_name():
    fired = []
    dog = StepWatchdog(0.2, device="cuda:0", on_timeout=fired.append, poll_s=0.02)
    with dog.waiting("decode step 7 (256 tokens, 256 sequences)"):
        time.sleep(0.6)
    assert len(fired) == 1 and dog.fired
    assert fired[0].startswith("decode step 7 (256 tokens, 256 sequences) has not finished on cuda:0 after ")
    assert "DEEPINFER_STEP_TIMEOUT=0.2" in fired[0] and f"code {STEP_TIMEOUT_EXIT_CODE}" in fired[0]
    assert "DEEPINFER_PDL_OFF=all" in fired[0] and "info cuda kernels" in fired[0]  # the next things to try, named


def test_waits_shorter_than_the_timeout_do_not_fire():
    fired = []
    dog = StepWatchdog(0.3, on_timeout=fired.append, poll_s=0.02)
    for i in range(10):  # 10 x 0.1 s of waiting in all, none alone past 0.3 s
        with dog.waiting(f"step {i}"):
            time.sleep(0.1)
        time.sleep(0.05)
    time.sleep(0.4)  # no wait in progress: nothing to time
    assert fired == [] and not dog.fired


def test_zero_is_off_and_negative_is_refused(monkeypatch):
    dog = StepWatchdog(0, on_timeout=lambda m: pytest.fail(m))
    with dog.waiting("step"):
        time.sleep(0.05)
    assert dog._thread is None  # no thread started
    with pytest.raises(ValueError, match="must be >= 0"):
        StepWatchdog(-1)
    monkeypatch.setenv("DEEPINFER_STEP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DEEPINFER_STEP_TIMEOUT='soon': expected seconds >= 0"):
        envs.STEP_TIMEOUT
    monkeypatch.setenv("DEEPINFER_STEP_TIMEOUT", "2.5")
    assert envs.STEP_TIMEOUT == 2.5
    monkeypatch.delenv("DEEPINFER_STEP_TIMEOUT")
    assert envs.STEP_TIMEOUT == 600.0


def test_the_default_action_ends_a_process_stuck_in_a_wait():
    """A child process blocks forever inside a watched wait (as a host does in Event.synchronize() on a kernel that
    never ends): it exits with the watchdog's code, the step named and the main thread's stack on stderr."""
    code = textwrap.dedent("""
        import threading
        from deepinfer_npu.worker.step_watchdog import StepWatchdog
        dog = StepWatchdog(0.5, device="cuda:0", poll_s=0.05)
        def device_wait():
            threading.Event().wait()  # never set
        with dog.waiting("prefill step 3 (131072 tokens, 256 sequences)"):
            device_wait()
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == STEP_TIMEOUT_EXIT_CODE, proc.stderr
    assert time.monotonic() - t0 < 30
    assert "prefill step 3 (131072 tokens, 256 sequences) has not finished on cuda:0" in proc.stderr
    assert "in device_wait" in proc.stderr  # the stuck thread's stack


def test_the_worker_watches_its_step_wait():
    """StepReadback._post_process waits for the step's end event inside the worker's watchdog, named by the step."""
    from types import SimpleNamespace

    from deepinfer_npu.worker.step_readback import StepReadback

    fired = []
    dog = StepWatchdog(0.2, device="cuda:0", on_timeout=fired.append, poll_s=0.02)

    class StuckEvent:
        def synchronize(self):
            time.sleep(0.6)  # the device "never" finishes
            raise RuntimeError("stop here")  # the rest of post-processing is not the subject

    readback = StepReadback()
    readback.step_watchdog = dog
    plan = SimpleNamespace(is_prefill=False, step_id=12, num_tokens=64, num_seqs=64)
    with pytest.raises(RuntimeError, match="stop here"):
        readback._post_process(SimpleNamespace(plan=plan, sample_end_event=StuckEvent()))
    assert len(fired) == 1 and fired[0].startswith("decode step 12 (64 tokens, 64 sequences) has not finished")


def test_the_thread_ends_with_its_watchdog():
    """An engine dropped takes its watchdog's thread with it (no thread a process per engine ever built)."""
    import gc

    dog = StepWatchdog(5.0, on_timeout=lambda m: pytest.fail(m), poll_s=0.02)
    with dog.waiting("step"):
        pass
    thread = dog._thread
    assert thread.is_alive()
    del dog
    gc.collect()
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_the_exit_happens_even_when_stderr_is_replaced():
    """Reporting goes to file descriptor 2 whatever sys.stderr is (a notebook's, a StringIO): the process still
    exits with the watchdog's code."""
    code = textwrap.dedent("""
        import io, sys, threading
        from deepinfer_npu.worker.step_watchdog import StepWatchdog
        sys.stderr = io.StringIO()
        dog = StepWatchdog(0.3, poll_s=0.05)
        with dog.waiting("decode step 1 (1 tokens, 1 sequences)"):
            threading.Event().wait()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == STEP_TIMEOUT_EXIT_CODE, proc.stderr
    assert "decode step 1 (1 tokens, 1 sequences) has not finished" in proc.stderr
