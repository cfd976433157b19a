"""CUDA kernel warm-up: every TileLang configuration the engine can reach, compiled at start-up.

TileLang kernels (``kernels_cuda/``) are JIT-compiled per configuration (seconds each, nvcc included) at the first
call that selects them, then cached in memory and on disk. A first call inside a served or timed step stalls it:
a DFlash benchmark on an H200 ran at 37 tok/s instead of ~480 while zos_fixup's re-split variants compiled inside
its first decode steps. ``CudaKernelSet.warmup`` therefore asks each selected op implementation
(``backends/cuda/ops/``) which configurations the engine's ``KernelWarmupPlan`` reaches and compiles them before the
first step through each module's own ``precompile`` (builds on the calling thread, nvcc in parallel threads).
Modules are compiled one after another: CPython 3.11's ``ast.parse`` is not thread-safe, so two modules must never
build (parse) their kernels at once. With TileLang's disk cache warm, a restart only re-parses (~0.1 s a config).

On a host with cores to spare and TileLang's disk cache on, :func:`fill_disk_cache` first lowers and compiles the
configurations in worker subprocesses (the lowering is Python and C++ passes under the GIL, about two minutes for
one ``mla_decode_ws`` configuration on one core, so one process builds one kernel at a time); the serial pass then
loads them from the disk cache, and still compiles (and reports) anything a worker could not.

A module whose compile fails is turned off in the kernel set: its ops fall back to the reference with the failure
as the reason (as a failed import does), and the summary names it; start-up continues.
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import functools
import hashlib
import importlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer_npu.hal.types import KernelWarmupPlan

from . import warmup_background
from .ops.base import tilelang_importable

logger = logging.getLogger(__name__)

#: the order modules compile in: the forward's, then verification and the ZOS correction
COMPILE_ORDER = ("rms_norm", "mla_rope_cache", "mla_decode", "mla_absorb", "skinny_gemm", "silu_mul", "moe_routing",
                 "moe_gemm", "moe_gemm_swap", "fp8_quant", "fp8_gemm", "fp8_grouped_gemm", "fp8_skinny_gemm",
                 "spec_verify", "zos_fixup", "decode_inputs")


def reachable_configs(kernels: Any, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
    """``{kernels_cuda module: [config, ...]}`` the kernel set's selection reaches for ``plan``, in compile order;
    modules with nothing to compile are left out."""
    configs = kernels.warmup_configs(plan, num_sms)
    order = {name: i for i, name in enumerate(COMPILE_ORDER)}
    return dict(sorted(configs.items(), key=lambda item: order.get(item[0], len(order))))


def _compile(name: str, mod, cfgs: list[tuple], plan: KernelWarmupPlan, device: torch.device) -> None:
    if name == "mla_decode":
        mod.precompile(cfgs, softmax_scale=float(plan.softmax_scale))
    elif name == "moe_gemm":
        # no precompile: its public get_kernel (one at a time), and expert_starts on an all-zero count vector,
        # which compiles the expert scan at its first launch
        for kind, cfg in cfgs:
            if kind == "gemm":
                mod.get_kernel(*cfg)
            else:
                mod.expert_starts(torch.zeros(cfg[0], dtype=torch.int64, device=device))
    else:
        mod.precompile(cfgs)


def _compile_retrying(name: str, mod, cfgs: list[tuple], plan: KernelWarmupPlan, device: torch.device) -> None:
    """:func:`_compile`, once more after a failure before the module is turned off: a build can fail for a reason
    of the moment (a compiler process killed on a loaded host, an I/O error), and turning a module off costs every
    later step its kernel (an FP8 engine, its decode graphs). The configurations built before the failure are in
    TileLang's cache, so the second attempt redoes only the rest; a second failure is the one reported."""
    try:
        _compile(name, mod, cfgs, plan, device)
    except Exception as e:  # noqa: BLE001 - retried once; the caller reports a second failure
        logger.warning("kernel warm-up: kernels_cuda.%s failed to build (%s: %s); trying once more", name,
                       type(e).__name__, str(e).strip()[:200])
        _compile(name, mod, cfgs, plan, device)


#: worker processes of :func:`fill_disk_cache` at most (each imports torch and TileLang: about 1 GB)
MAX_COMPILE_WORKERS = 16


FAILED_MARK = "warm-up worker failed: "  # a worker's failure lines (TileLang logs to stdout too)
#: one worker's whole share of the configurations (a cold lowering of the slowest takes minutes)
WORKER_TIMEOUT_S = 1800


def _fill_one(name: str, cfg: tuple, softmax_scale: float) -> None:
    """One configuration into TileLang's disk cache (in a worker process; no CUDA context needed)."""
    mod = importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}")
    if name == "mla_decode":
        mod.precompile([cfg], softmax_scale=softmax_scale)
    elif name == "moe_gemm":
        kind, c = cfg
        if kind == "gemm":  # the expert scan compiles at its first launch, in the serial pass
            mod.get_kernel(*c)
    else:
        mod.precompile([cfg])


def fill_worker_main() -> None:
    """A worker of :func:`fill_disk_cache`: ``repr`` of ``(softmax_scale, claims directory, [(module, config),
    ...])`` as its argument. It builds each job it claims first (a file created exclusively in the claims directory),
    so the workers share the list as a queue; a ``FAILED_MARK`` line per configuration that failed on stdout."""
    softmax_scale, claims, jobs, *rest = ast.literal_eval(sys.argv[1])
    background = bool(rest and rest[0])
    if background:  # the engine's threads come first (nvcc inherits the priority)
        os.nice(19)
    parent = os.getppid()
    for i, (name, cfg) in enumerate(jobs):
        if background and os.getppid() != parent:  # the engine's process is gone (killed, crashed): stop
            return
        if not claim(claims, i):
            continue
        try:
            _fill_one(name, cfg, softmax_scale)
        except Exception as e:  # noqa: BLE001 - reported; the serial pass compiles it again
            print(f"{FAILED_MARK}{name} {cfg}: {type(e).__name__}: {str(e).strip()[:200]}", flush=True)


def claim(claims: str, job: int) -> bool:
    """True for the one process that creates ``claims/<job>`` (O_EXCL: atomic between processes)."""
    try:
        os.close(os.open(os.path.join(claims, str(job)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def compiled_marker(name: str, cfg: tuple, softmax_scale: float | None = None) -> Path:
    """A file that says ``kernels_cuda.<name>``'s configuration ``cfg`` was compiled into this TileLang cache
    directory by the current kernel sources (``_prim_func_cache.cache_root``: a source change starts afresh) under
    the current ``DEEPINFER_PDL_OFF`` (a kernel built without PDL is another build). ``mla_decode``'s kernels are also
    built per ``softmax_scale`` (a compile-time constant), so it is in their key."""
    import tilelang

    from deepinfer_npu.kernels_cuda._pdl import off_prefixes
    from deepinfer_npu.kernels_cuda._prim_func_cache import cache_root

    scale = float(softmax_scale) if name == "mla_decode" and softmax_scale is not None else None
    pdl_off = off_prefixes()
    key = repr((name, cfg, os.path.abspath(tilelang.env.TILELANG_CACHE_DIR))
               + ((pdl_off,) if pdl_off else ()) + ((scale,) if scale else ()))
    return cache_root() / "compiled" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def mark_compiled(name: str, cfg: tuple, softmax_scale: float | None = None) -> None:
    try:
        path = compiled_marker(name, cfg, softmax_scale)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except Exception as e:  # noqa: BLE001 - without the marker the next start only spends worker processes
        logger.debug("kernel warm-up: could not mark %s %s compiled (%s)", name, cfg, e)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's or a test worker's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def compile_workers(num_jobs: int) -> int:
    """Worker processes for :func:`fill_disk_cache`: ``DEEPINFER_COMPILE_WORKERS``, or by default one a usable core
    (the caller only waits while they build), at most ``MAX_COMPILE_WORKERS``; 0 (no workers) when the disk cache is
    off (the workers' kernels could not reach this process) or fewer than two would run."""
    import tilelang

    from deepinfer_npu import envs

    if not tilelang.env.is_cache_enabled():
        return 0
    wanted = envs.COMPILE_WORKERS
    workers = min(num_jobs, usable_cores() if wanted is None else wanted, MAX_COMPILE_WORKERS)
    return workers if workers >= 2 else 0


#: seconds to lower and compile one configuration on one core, by module or ``module:kind`` (configurations whose
#: first item names a kernel kind), measured by ``benchmarks/bench_kernel_builds.py`` on the V2-Lite shape's
#: configurations (``benchmarks/results/cpu_kernel_builds.jsonl``); only their order matters (the queue's)
EXPECTED_BUILD_S = {
    "mla_decode": 10.5, "mla_decode:prefill": 9.0, "mla_decode:prefill_short": 14.0, "mla_decode:ws": 100.0,
    "moe_routing:route": 11.0, "spec_verify:accept": 10.0, "fp8_grouped_gemm": 10.0, "fp8_gemm": 9.0,
    "moe_gemm:gemm": 8.5, "skinny_gemm": 7.5, "fp8_skinny_gemm": 7.5, "moe_gemm_swap": 7.5, "moe_routing:permute": 7.5,
    "spec_verify:argmax": 6.0, "decode_inputs": 6.0, "moe_gemm:expert_scan": 0.0,
}
DEFAULT_BUILD_S = 4.0  # the elementwise and norm kernels: nvcc's fixed cost of TileLang's headers, most of it


def expected_build_s(name: str, cfg: tuple) -> float:
    """:data:`EXPECTED_BUILD_S` of one configuration (``DEFAULT_BUILD_S`` for a module it does not name)."""
    key = name
    if cfg and isinstance(cfg[0], str):
        key = f"{name}:{cfg[0]}"
    elif name == "mla_decode" and len(cfg) > 5 and cfg[5]:
        key = "mla_decode:ws"  # the warp-specialized kernel (128 heads): minutes of lowering
    elif name == "mla_decode" and len(cfg) > 3 and cfg[3] is True:  # the causal prefill variant, (h, m_tiles, s, True)
        key = "mla_decode:prefill_short" if cfg[1] <= 16 else "mla_decode:prefill"
    return EXPECTED_BUILD_S.get(key, EXPECTED_BUILD_S.get(name, DEFAULT_BUILD_S))


def warmup_job_order(configs: dict[str, list[tuple]]) -> list[tuple[str, tuple]]:
    """The ``(module, config)`` jobs of :func:`fill_disk_cache` in the order workers claim them: the longest
    expected builds first (:func:`expected_build_s`), ties in compile order. Workers take the next job as they
    free up, so a long build that starts last would end last: on the V2-Lite shape's 50 configurations, measured
    one at a time and replayed for 16 workers, this order ends in 24.4 s where the MLA kernels first and the rest
    in compile order end in 27.9 s."""
    jobs = [(name, cfg) for name, cfgs in configs.items() for cfg in cfgs]
    jobs.sort(key=lambda job: -expected_build_s(*job))  # stable
    return jobs


def fill_disk_cache(configs: dict[str, list[tuple]], softmax_scale: float, workers: int, background: bool = False,
                    running: list | None = None) -> list[str]:
    """Lower and compile every configuration of ``configs`` into TileLang's disk cache in ``workers`` Python
    subprocesses (not multiprocessing: a user script without a ``__main__`` guard must not be re-run) -> the
    failures the workers reported. The workers take jobs from one shared list, the MLA kernels (the slowest to
    lower) first, each job claimed by one worker as it frees up: a worker that drew slow jobs does not hold up the
    others' (a fixed share each did). A configuration a worker did not build is left to the serial pass, which
    compiles it again and reports its error. ``background``: the workers run at the lowest CPU priority;
    ``running``: a list the live worker processes are added to (and removed from when they end)."""
    jobs = warmup_job_order(configs)
    code = "from deepinfer_npu.backends.cuda.warmup import fill_worker_main; fill_worker_main()"
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="deepinfer-warmup-claims-") as claims:
        procs: list[subprocess.Popen] = []
        try:
            for _ in range(workers):
                # a background worker leads its own process group: stopping it stops its nvcc too
                procs.append(subprocess.Popen([sys.executable, "-c", code,
                                               repr((softmax_scale, claims, jobs, background))],
                                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, text=True, start_new_session=background))
                if running is not None:
                    running.append(procs[-1])
            deadline = time.monotonic() + WORKER_TIMEOUT_S
            for proc in procs:
                try:
                    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                    failures += [ln[len(FAILED_MARK):] for ln in out.splitlines() if ln.startswith(FAILED_MARK)]
                    if proc.returncode:
                        failures.append(f"a worker exited with {proc.returncode}")
                except subprocess.TimeoutExpired:
                    warmup_background.kill_worker(proc, background)
                    proc.communicate()
                    failures.append(f"a worker ran past {WORKER_TIMEOUT_S} s and was stopped")
        finally:  # an error or an interrupt here: no worker outlives the call (nor its claims directory)
            for proc in procs:
                if proc.poll() is None:
                    warmup_background.kill_worker(proc, background)
                    proc.wait()
                if running is not None and proc in running:
                    running.remove(proc)
    return failures


def _compiled_kernels(mod) -> list:
    """TileLang kernels held in a module's caches (dicts and lists of its globals)."""
    found = []
    for obj in list(vars(mod).values()):
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
        found += [v for v in list(values) if hasattr(getattr(v, "adapter", None), "get_exportable_executable")]
    return found


def _link(kernel) -> None:
    executable = kernel.adapter.get_exportable_executable()
    if hasattr(executable, "jit"):  # tvm.runtime.Executable: jit() builds and caches the runnable module
        executable.jit()


def _load_executables(mods: list) -> int:
    """Link and load each compiled kernel's host module now. TileLang builds it at a kernel's first call (a gcc run
    of the host wrapper, ~130 ms on an H200 host): seen as 0.5 s inside the first decode steps of a DFlash + varlen
    run whose kernels the warm-up had compiled but not called. Kernels loaded from TileLang's disk cache have it."""
    kernels = [k for m in mods for k in _compiled_kernels(m)]
    with cf.ThreadPoolExecutor(max(1, min(16, len(kernels)))) as ex:
        list(ex.map(_link, kernels))
    return len(kernels)


def _counts(configs: dict[str, list[tuple]]) -> str:
    if not configs:
        return "no TileLang kernel applies"
    parts = []
    for name, cfgs in configs.items():
        n_prefill = sum(1 for c in cfgs if name == "mla_decode" and len(c) > 3 and c[3])
        parts.append(f"{name}: {len(cfgs)}" + (f" ({n_prefill} prefill)" if n_prefill else ""))
    return ", ".join(parts)


def warm_up(kernels: Any, plan: KernelWarmupPlan) -> str:
    """Compile every configuration of :func:`reachable_configs`, module by module; -> ``"N configs in X s
    (module: n, ...)"`` plus the modules that failed or were skipped. A module that fails is turned off in the
    kernel set (its ops then run the reference, with this reason)."""
    t0 = time.perf_counter()
    if not tilelang_importable():
        return "nothing to warm up: tilelang is not installed (every TileLang op runs the reference)"
    try:
        configs = _listed(kernels, plan)
    except Exception as e:  # noqa: BLE001 - a bug here must not stop start-up; the kernels compile at first use
        logger.warning("kernel warm-up skipped: listing the configurations failed: %s: %s", type(e).__name__, e)
        return f"skipped: listing the configurations failed: {type(e).__name__}: {e}"
    skipped = _drop_unimportable(kernels, configs)
    # configurations an earlier process compiled are loaded by the serial pass: worker processes (seconds to start
    # each) only for the rest
    scale = float(plan.softmax_scale)
    later: dict[str, list[tuple]] = {}
    try:
        later = warmup_background.split_deferred(kernels, plan, configs)
        later_pending = _not_compiled(later, scale)
        later_workers = min(compile_workers(sum(len(c) for c in later_pending.values())), max(1, usable_cores() - 1))
    except Exception as e:  # noqa: BLE001 - a bug here must not stop start-up: everything is built now
        logger.warning("kernel warm-up: deferring the fallback-only configurations failed (%s: %s); building them "
                       "now", type(e).__name__, e)
        later_pending, later_workers = later, 0  # whatever was split off goes back below
    if later_pending and not later_workers:  # no disk cache for workers to fill (or one core): built now
        for name, cfgs in later.items():
            configs[name] = [*configs.get(name, []), *cfgs]
        later = later_pending = {}
    total = sum(len(c) for c in configs.values())
    logger.info("kernel warm-up: compiling %d TileLang kernel configs (%s) ...", total, _counts(configs))
    if not warmup_background.wait_key(_early_key(scale), WORKER_TIMEOUT_S):  # start_early's builds, marked
        logger.warning("kernel warm-up: the early build is still running after %d s; building the rest now",
                       WORKER_TIMEOUT_S)
    pending = _not_compiled(configs, scale)
    workers = compile_workers(sum(len(c) for c in pending.values()))
    if workers:
        t1 = time.perf_counter()
        try:
            lost = fill_disk_cache(pending, float(plan.softmax_scale), workers)
            logger.info("kernel warm-up: built in %d processes in %.1f s%s", workers, time.perf_counter() - t1,
                        f"; left to the serial pass: {'; '.join(lost)}" if lost else "")
        except Exception as e:  # noqa: BLE001 - e.g. no process can be spawned: the serial pass builds them all
            logger.warning("kernel warm-up: the parallel build failed (%s: %s); building one at a time",
                           type(e).__name__, e)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    failed: dict[str, str] = {}
    for i, (name, cfgs) in enumerate(configs.items(), 1):
        t1 = time.perf_counter()
        try:
            _compile_retrying(name, kernels.modules.get(name), cfgs, plan, device)
        except Exception as e:  # noqa: BLE001 - never fail start-up: the ops fall back to the reference
            why = f"warm-up compile failed: {type(e).__name__}: {str(e).strip()[:200]}"
            failed[name] = why
            kernels.modules.disable(name, f"kernels_cuda.{name} {why}")
            logger.warning("kernel warm-up: kernels_cuda.%s %s; its ops fall back to the reference", name, why)
            continue
        logger.info("kernel warm-up [%d/%d]: kernels_cuda.%s, %d configs in %.1f s", i, len(configs), name,
                    len(cfgs), time.perf_counter() - t1)
        for cfg in pending.get(name, ()):
            mark_compiled(name, cfg, scale)
    if failed:  # the selection learns which modules are off now
        kernels.select(kernels.config)
    done = {n: c for n, c in configs.items() if n not in failed}
    try:
        loaded = _load_executables([kernels.modules.get(n) for n in done])
        logger.info("kernel warm-up: %d kernels linked and loaded", loaded)
    except Exception as e:  # noqa: BLE001 - the first call links them instead
        logger.warning("kernel warm-up: loading the compiled kernels failed (%s: %s); the first calls will",
                       type(e).__name__, e)
    summary = f"{sum(len(c) for c in done.values())} configs in {time.perf_counter() - t0:.1f} s ({_counts(done)})"
    if failed:
        summary += "; failed: " + ", ".join(f"{n} ({why})" for n, why in failed.items())
    if skipped:
        summary += "; skipped: " + ", ".join(f"{n} ({why})" for n, why in skipped.items())
    if later:
        summary += f"; {sum(len(c) for c in later.values())} fallback-only configs ({_counts(later)}) " + \
            _start_background(kernels, later_pending, later_workers, scale)
    logger.info("kernel warm-up: %s", summary)
    return summary


def _listed(kernels: Any, plan: KernelWarmupPlan) -> dict[str, list[tuple]]:
    """:func:`reachable_configs` for ``kernels``' selection (its SM count read from the device once)."""
    if kernels.num_sms is None:
        kernels.num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return reachable_configs(kernels, plan, kernels.num_sms)


def _drop_unimportable(kernels: Any, configs: dict[str, list[tuple]]) -> dict[str, str]:
    """Remove the modules that do not import (as the op would import them) from ``configs`` -> {module: why}."""
    skipped = {}
    for name in list(configs):
        if kernels.modules.get(name) is None:
            skipped[name] = kernels.modules.error(name)
            del configs[name]
    return skipped


def _early_key(scale: float) -> tuple:
    return ("early", float(scale))


def start_early(kernels: Any, plan: KernelWarmupPlan) -> str:
    """Start building ``plan``'s configurations into TileLang's disk cache now, in worker processes on a thread,
    while the caller goes on (the engine loads the weights and sizes the KV cache): -> what was started, one line.
    ``plan`` is the engine's expected plan (built from the model before its weights are loaded); :func:`warm_up`
    waits for these builds, then compiles what they did not cover (a configuration the real plan adds) and loads
    everything as before. So a cold start costs max(load, build) instead of their sum. The workers run at the
    lowest CPU priority (the load comes first; idle cores build), each in its own process group (stopped with its
    nvcc when the process exits). The listing runs on a separate kernel set: the live one's selection is made by
    :func:`warm_up`. Never raises."""
    if not tilelang_importable():
        return "not started: tilelang is not installed"
    try:
        from . import kernels as cuda_kernels  # its module attribute: the device check a test may stand in for
        from .ops import OpConfig

        probe = type(kernels)()
        probe.SKIP, probe.num_sms = kernels.SKIP, kernels.num_sms
        probe.select(OpConfig.from_plan(plan, cuda_kernels.current_device_is_sm90(), probe.SKIP))
        configs = _listed(probe, plan)
        _drop_unimportable(probe, configs)
        warmup_background.split_deferred(probe, plan, configs)  # the fallback-only ones: built after ready
        scale = float(plan.softmax_scale)
        pending = _not_compiled(configs, scale)
        count = sum(len(c) for c in pending.values())
        workers = compile_workers(count)
        if not workers:
            return f"not started: {count} configurations to build, no worker processes"
        started = warmup_background.start(pending, workers, functools.partial(fill_disk_cache, softmax_scale=scale),
                                          functools.partial(mark_compiled, softmax_scale=scale), low_priority=True,
                                          key=_early_key(scale))
    except Exception as e:  # noqa: BLE001 - the warm-up builds everything itself then
        logger.warning("kernel warm-up: the early build could not start (%s: %s)", type(e).__name__, e)
        return f"not started: {type(e).__name__}: {e}"
    logger.info("kernel warm-up: building %d configurations in %d processes while the model loads", started, workers)
    return f"{started} configurations building in {workers} processes"


def _not_compiled(configs: dict[str, list[tuple]], softmax_scale: float) -> dict[str, list[tuple]]:
    """The configurations no earlier process marked compiled (:func:`compiled_marker`)."""
    pending = {n: [c for c in cfgs if not compiled_marker(n, c, softmax_scale).exists()]
               for n, cfgs in configs.items()}
    return {n: cfgs for n, cfgs in pending.items() if cfgs}


def _start_background(kernels: Any, pending: dict[str, list[tuple]], workers: int, scale: float) -> str:
    """Start the fallback-only configurations' background build -> what the summary says of it. A configuration
    that fails to build turns ``mla_prefill`` off (``MLAAttention.off``): the steps that would have run it take
    the reference arithmetic on host lengths instead of compiling it in the step."""
    def failed(failures: list[str]) -> None:
        kernels.impl("mla_attention").off.setdefault("mla_prefill", "background build failed: " + failures[0][:200])

    try:
        started = warmup_background.start(pending, workers, functools.partial(fill_disk_cache, softmax_scale=scale),
                                          functools.partial(mark_compiled, softmax_scale=scale), key=scale,
                                          on_failed=failed)
    except Exception as e:  # noqa: BLE001 - never fail start-up: a step that needs one compiles it where it runs
        logger.warning("kernel warm-up: the background build could not start (%s: %s)", type(e).__name__, e)
        return f"not built (the background build could not start: {type(e).__name__})"
    if started:
        return f"building in the background ({started} in {workers} processes)"
    return "building in the background (an earlier engine's build)" if pending else "already built"
