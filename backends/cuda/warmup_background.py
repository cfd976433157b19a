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
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from deepinfer_npu.hal.types import KernelWarmupPlan

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_building: set[tuple[str, tuple]] = set()  # (module, config) a background build has claimed in this process
_procs: list[subprocess.Popen] = []  # the live builds' worker processes (stopped at exit)
_threads: list[threading.Thread] = []
_last_build_s: list[float] = []  # each finished background build's wall time


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
          mark: Callable[[str, tuple], None], low_priority: bool = True) -> int:
    """Build ``configs`` on a daemon thread through ``fill(configs, workers=, background=, running=)`` (the
    warm-up's ``fill_disk_cache``: -> the failures) in ``workers`` processes (``low_priority``: at the lowest CPU
    priority), then ``mark(module, config)`` each one built -> how many configurations it took (those another
    background build of this process has not already claimed)."""
    with _lock:
        todo = {n: [c for c in cfgs if (n, c) not in _building] for n, cfgs in configs.items()}
        todo = {n: cfgs for n, cfgs in todo.items() if cfgs}
        _building.update((n, c) for n, cfgs in todo.items() for c in cfgs)
    count = sum(len(c) for c in todo.values())
    if count:
        thread = threading.Thread(target=_build, args=(todo, max(1, workers), fill, mark, low_priority),
                                  name="deepinfer-kernel-background-build", daemon=True)
        _threads.append(thread)
        thread.start()
    return count


def _build(configs: dict[str, list[tuple]], workers: int, fill: Callable[..., list[str]],
           mark: Callable[[str, tuple], None], low_priority: bool) -> None:
    t0 = time.perf_counter()
    try:
        failures = fill(configs, workers=workers, background=low_priority, running=_procs)
    except Exception as e:  # noqa: BLE001 - a step that needs one of these compiles it where it runs
        logger.warning("kernel warm-up: the background build failed (%s: %s); those kernels compile at first use",
                       type(e).__name__, e)
        return
    jobs = [(name, cfg) for name, cfgs in configs.items() for cfg in cfgs]
    failed = {job for job in jobs for f in failures if f.startswith(f"{job[0]} {job[1]}:")}
    unattributed = [f for f in failures if not any(f.startswith(f"{n} {c}:") for n, c in jobs)]
    if not unattributed:  # a worker that died or ran out of time leaves no trace of what it built: mark nothing
        for name, cfg in jobs:
            if (name, cfg) not in failed:
                mark(name, cfg)
    seconds = time.perf_counter() - t0
    _last_build_s.append(seconds)
    count = sum(len(c) for c in configs.values())
    if failures:
        logger.warning("kernel warm-up: background build of %d configs ended in %.1f s; not built (compiled at "
                       "first use, where the error shows): %s", count, seconds, "; ".join(failures))
    else:
        logger.info("kernel warm-up: %d background configs built in %.1f s", count, seconds)


def wait(timeout: float) -> float | None:
    """Wait up to ``timeout`` seconds for this process's background builds -> the last one's wall time, or None
    when one is still running (or none ran)."""
    deadline = time.monotonic() + timeout
    for thread in list(_threads):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return None
    return _last_build_s[-1] if _last_build_s else None


@atexit.register
def _stop_workers() -> None:
    """No build outlives the process that started it (a daemon thread does not run its cleanup at exit)."""
    for proc in list(_procs):
        if proc.poll() is None:
            proc.kill()
