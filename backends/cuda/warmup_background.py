"""Kernel configurations that only a fallback path reaches, built after start-up instead of before it.

With a bf16 cache, prefill steps attend on decompressed keys (``ops/mla_prefill_mha.py``, torch's flash attention).
The absorbed path's causal prefill kernels (``mla_decode``'s prefill variant, one per query bucket: 8 of the V2-Lite
shape's 50 configurations, about a fifth of the warm-up's compile time) then run only where that path refuses a
step: a padded step, a failed flash call. Start-up does not wait for them. Once the engine is ready, worker
processes build them into TileLang's disk cache at the lowest CPU priority (the engine's own threads come first), and
a step that needs one before then compiles it where it runs, as it would without a warm-up. The workers are stopped
when the process exits; what they finished stays in the cache and is marked compiled for the next start.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from deepinfer_npu.hal.types import KernelWarmupPlan

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_building: set[tuple] = set()  # (key, module, config) a background build of this process has claimed
_procs: list[subprocess.Popen] = []  # the live builds' worker processes (stopped at exit)
_threads: list[threading.Thread] = []
_keyed: list[tuple[object, threading.Thread]] = []  # (key, thread) of each build, for wait_key
_finished: list[tuple[float, float]] = []  # (wall seconds, time.perf_counter() at the end) of each finished build


def split_deferred(kernels: Any, plan: KernelWarmupPlan, configs: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    """Move the configurations only a fallback reaches for ``plan`` out of ``configs`` -> ``{module: [config]}``
    (empty when every configuration is on a main path). ``mla_decode``'s prefill variant is ``(heads, m_tiles, 1,
    True, ...)``; it is a fallback when prefill on decompressed keys serves ``plan``'s prefill steps."""
    prefill_path = kernels.impl("mla_prefill_mha")
    if "mla_decode" not in configs or not prefill_path.serves_prefill(plan):
        return {}
    prefill = [c for c in configs["mla_decode"] if len(c) > 3 and c[3] is True]
    if not prefill:
        return {}
    configs["mla_decode"] = [c for c in configs["mla_decode"] if c not in prefill]
    if not configs["mla_decode"]:
        del configs["mla_decode"]
    return {"mla_decode": prefill}


def start(configs: dict[str, list[tuple]], workers: int, fill: Callable[..., list[str]],
          mark: Callable[[str, tuple], None], low_priority: bool = True, key: object = None,
          on_failed: Callable[[list[str]], None] | None = None) -> int:
    """Build ``configs`` on a daemon thread through ``fill(configs, workers=, background=, running=)`` (the
    warm-up's ``fill_disk_cache``: -> the failures) in ``workers`` processes (``low_priority``: at the lowest CPU
    priority, each in its own process group), then ``mark(module, config)`` each one built, and
    ``on_failed(failures)`` if some failed to build -> how many configurations it took: those no other background
    build of this process holds under the same ``key`` (what else the kernels are built for, e.g. the softmax
    scale)."""
    with _lock:
        todo = {n: [c for c in cfgs if (key, n, c) not in _building] for n, cfgs in configs.items()}
        todo = {n: cfgs for n, cfgs in todo.items() if cfgs}
        _building.update((key, n, c) for n, cfgs in todo.items() for c in cfgs)
    count = sum(len(c) for c in todo.values())
    if count:
        thread = threading.Thread(target=_build, args=(todo, max(1, workers), fill, mark, low_priority, key,
                                                       on_failed),
                                  name="deepinfer-kernel-background-build", daemon=True)
        _threads.append(thread)
        _keyed.append((key, thread))
        thread.start()
    return count


def _build(configs: dict[str, list[tuple]], workers: int, fill: Callable[..., list[str]],
           mark: Callable[[str, tuple], None], low_priority: bool, key: object = None,
           on_failed: Callable[[list[str]], None] | None = None) -> None:
    t0 = time.perf_counter()
    jobs = [(name, cfg) for name, cfgs in configs.items() for cfg in cfgs]
    marked: set[tuple[str, tuple]] = set()
    try:
        try:
            failures = fill(configs, workers=workers, background=low_priority, running=_procs)
        except Exception as e:  # noqa: BLE001 - a step that needs one of these compiles it where it runs
            logger.warning("kernel warm-up: the background build failed (%s: %s); those kernels compile at first "
                           "use", type(e).__name__, e)
            return
        failed = {job for job in jobs for f in failures if f.startswith(f"{job[0]} {job[1]}:")}
        unattributed = [f for f in failures if not any(f.startswith(f"{n} {c}:") for n, c in jobs)]
        if not unattributed:  # a worker that died or ran out of time leaves no trace of what it built: mark none
            for job in jobs:
                if job not in failed:
                    mark(*job)
                    marked.add(job)
        if failed and on_failed is not None:
            on_failed([f for f in failures if f not in unattributed])
    finally:
        with _lock:  # what was not built may be tried again by a later engine of this process
            _building.difference_update((key, n, c) for n, c in jobs if (n, c) not in marked)
    seconds = time.perf_counter() - t0
    _finished.append((seconds, time.perf_counter()))
    count = len(jobs)
    if failures:
        logger.warning("kernel warm-up: background build of %d configs ended in %.1f s; not built (built again by "
                       "the warm-up or at first use, where the error shows): %s", count, seconds, "; ".join(failures))
    else:
        logger.info("kernel warm-up: %d background configs built in %.1f s", count, seconds)


def wait(timeout: float) -> tuple[float, float] | None:
    """Wait up to ``timeout`` seconds for this process's background builds -> the last one's (wall seconds,
    ``time.perf_counter()`` when it ended), or None when one is still running (or none ran)."""
    deadline = time.monotonic() + timeout
    for thread in list(_threads):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return None
    return _finished[-1] if _finished else None


def wait_key(key: object, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for this process's builds started under ``key`` -> True when none is left
    running (or none was started)."""
    deadline = time.monotonic() + timeout
    for k, thread in list(_keyed):
        if k == key:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
    return True


@atexit.register
def _stop_workers() -> None:
    """No build outlives the process that started it (a daemon thread does not run its cleanup at exit): each
    worker's process group, its nvcc included. A worker whose engine process died without exiting (a signal, a
    crash) stops before its next configuration (``fill_worker_main``)."""
    for proc in list(_procs):
        if proc.poll() is None:
            kill_worker(proc, group=True)


def kill_worker(proc: subprocess.Popen, group: bool) -> None:
    """Stop a worker of :func:`fill_disk_cache` (``group``: a background worker, with its nvcc: its process
    group)."""
    try:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):  # already gone
        pass
