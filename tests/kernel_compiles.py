"""The nvcc compiles of tests/kernels_cuda/test_compile.py, in two worker processes.

The compiles are minutes of CPU (TileLang lowering, nvcc) and most modules have few configurations: one module at a
time leaves a core idle through each module's last nvcc. Two workers each compile one module at a time (a module's
``ci_compile`` builds its kernels on the calling thread, then compiles them in parallel threads), the slowest
modules first, and the compile tests wait for their module's result. Processes, not threads: building a kernel
parses Python source, which must stay on one thread per process (CPython < 3.13, kernels_cuda/_ast_guard.py).
Under pytest-xdist (scripts/test.sh) the compile module is one ``xdist_group``, so one worker hosts the pool and
the compiles overlap the other worker's tests; xdist hands out groups before single tests, the largest first.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import importlib
import inspect
import multiprocessing
import os
import re
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

SM100_TARGET = {"kind": "cuda", "arch": "sm_100a"}

#: module -> the exact reason it cannot target sm_100a (see test_compile.py's docstring).
SM100_SKIP: dict[str, str] = {
    "mla_decode_ws": "Hopper-only by design: T.wgmma_gemm (wgmma issued by hand, A from registers) and setmaxnreg "
    "warpgroup roles have no sm_100a lowering; the engine takes it only on compute capability 9.x and keeps "
    "mla_decode's pipelined kernel elsewhere",
}

#: the modules whose compiles take longest (about 40-100 s each on two cores): started first, so the short ones fill
#: the gaps at the end; only the start order depends on this.
SLOW_FIRST = ("fp8_grouped_gemm", "fp8_gemm", "mla_decode_ws", "moe_routing", "skinny_gemm", "mla_decode",
              "spec_verify")

#: module -> why the suite leaves it to ``--all-kernel-configs`` (and to the GPU job, which builds what it runs)
FULL_ONLY: dict[str, str] = {
    "mla_decode_ws": "its lowering takes about two minutes of one core (TileLang's layout inference and simplify "
    "passes over five expansions of its pair macro per warpgroup); compiled with --all-kernel-configs and by the "
    "GPU tests",
}

COMPILE_TIMEOUT_S = 1800  # one module's compile, queueing behind the others included

#: the compile tests and the architecture each compiles for
TESTS = {"test_compiles_for_sm90a": "sm_90a", "test_compiles_for_sm100a": "sm_100a"}
TEST_FILE = "test_compile.py"


def sm100_configs(configs) -> list:
    """The first configuration of each kernel kind: ``(kind, cfg)`` entries keep one per kind, plain configuration
    tuples (one kernel kind per module) keep the first."""
    configs = list(configs)
    if all(isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) for c in configs):
        first: dict[str, tuple] = {}
        for kind, cfg in configs:
            first.setdefault(kind, (kind, cfg))
        return list(first.values())
    return configs[:1]


@functools.cache
def nvcc_knows(arch: str) -> bool:
    import subprocess

    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except Exception:  # noqa: BLE001
        return False
    return f"compute_{arch.removeprefix('sm_').rstrip('a')}" in out


def sm100_skip_reason(name: str) -> str | None:
    if not nvcc_knows("sm_100a"):
        return "this nvcc has no sm_100 target (needs CUDA >= 12.8)"
    return SM100_SKIP.get(name)


@dataclass
class Compiled:
    """What one module's ``ci_compile`` produced for one architecture (or the error it raised)."""

    sources: list[str]
    targets: list[str]
    seconds: float
    error: str | None = None


def compile_module(name: str, arch: str, every_config: bool = False) -> Compiled:
    """``ci_compile`` of kernels_cuda/``name`` for ``arch``: the first configuration of each kernel kind
    (``every_config``: every ``CI_CONFIGS`` entry for sm_90a)."""
    t = time.time()
    try:
        mod = importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}")
        assert hasattr(mod, "ci_compile"), f"kernels_cuda/{name}.py must define ci_compile()"
        if arch == "sm_90a":
            kernels = mod.ci_compile() if every_config else mod.ci_compile(configs=sm100_configs(mod.CI_CONFIGS))
        else:
            params = inspect.signature(mod.ci_compile).parameters
            assert {"configs", "target"} <= set(params) and isinstance(getattr(mod, "CI_CONFIGS", None), list), (
                f"kernels_cuda/{name}.py: ci_compile(configs=None, target=None) and a CI_CONFIGS list "
                "(sm_100a compiles a subset of it)")
            kernels = mod.ci_compile(configs=sm100_configs(mod.CI_CONFIGS), target=dict(SM100_TARGET))
        return Compiled([k.get_kernel_source() for k in kernels], [str(k.target) for k in kernels], time.time() - t)
    except Exception:  # noqa: BLE001 - reported by the module's own test
        return Compiled([], [], time.time() - t, traceback.format_exc())


def _worker_init(cache_dir: str, background: bool) -> None:
    os.environ["TILELANG_DISABLE_CACHE"] = "1"  # really compile: a cached artifact must not hide a break
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    os.environ["DEEPINFER_PDL_OFF"] = "none"  # the kernels as written, PDL wait included (test_compile.py checks it)
    if background:
        os.nice(19)  # nvcc inherits it: other work on a shared machine keeps its CPU


class CompileJobs:
    """``(module, arch)`` compiles in two worker processes, the slow modules first."""

    def __init__(self, jobs: list[tuple[str, str]], cache_dir: Path, every_config: bool = False) -> None:
        # Under pytest-xdist the worker waiting for these compiles is one of the suite's own processes: they take
        # its share of the CPU at its priority, or on a loaded machine they would starve and finish last.
        background = "PYTEST_XDIST_WORKER" not in os.environ
        self.pool = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"),
                                           initializer=_worker_init, initargs=(str(cache_dir), background))
        rank = {name: i for i, name in enumerate(SLOW_FIRST)}
        order = sorted(dict.fromkeys(jobs), key=lambda job: rank.get(job[0], len(rank)))  # stable otherwise
        self.every_config = every_config
        self.futures = {job: self.pool.submit(compile_module, *job, every_config) for job in order}

    def result(self, name: str, arch: str) -> Compiled:
        fut = self.futures.get((name, arch))
        if fut is None:  # not foreseen at the start (a test selected some other way): compile it now
            fut = self.futures[(name, arch)] = self.pool.submit(compile_module, name, arch, self.every_config)
        return fut.result(timeout=COMPILE_TIMEOUT_S)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def full_only_reason(name: str, every_config: bool) -> str | None:
    return None if every_config else FULL_ONLY.get(name)


def selected_jobs(items, every_config: bool = False) -> list[tuple[str, str]]:
    """The compiles the session's selected, not skipped compile tests will ask for."""
    jobs = []
    for item in items:
        arch = TESTS.get(getattr(item, "originalname", ""))
        if arch is None or item.path.name != TEST_FILE or item.get_closest_marker("skip") is not None:
            continue
        name = item.callspec.params["name"]
        if (arch == "sm_100a" and sm100_skip_reason(name)) or full_only_reason(name, every_config):
            continue
        jobs.append((name, arch))
    return jobs


_SESSION: list[CompileJobs] = []


def start(items, cache_dir: Path, every_config: bool = False) -> CompileJobs | None:
    """Start the selected compile tests' compiles (once, until :func:`stop`); None when none is selected."""
    if not _SESSION:
        jobs = selected_jobs(items, every_config)
        if not jobs:
            return None
        _SESSION.append(CompileJobs(jobs, cache_dir, every_config))
    return _SESSION[0]


def stop() -> None:
    while _SESSION:
        _SESSION.pop().close()


_CP_ASYNC_DEST = re.compile(r"cp_async_gs(?:_conditional)?<\d+>\(\(&\(\(\(\w+\*\)(\w+)\)\[")
_DESCRIPTOR_OF = re.compile(r"initialize_wgmma_descriptor<[^>]*>\(\w+, \(&\(\(\(\w+\*\)(\w+)\)\[")


def cp_async_rows_freed_early(src: str) -> list[str]:
    """Shared buffers a warp-specialised pipeline fills with ``cp.async`` whose stage a consumer loop frees (its first
    ``mbarrier[..].arrive()``) before a later wgmma reads them. TileLang 0.1.15 frees such a buffer with the first
    GEMM that reads it, so the producer may refill it while a second GEMM still reads it (moe_gemm_swap's gated form
    had two GEMMs on one row tile; test_compile.py checks every compiled sm_90a kernel)."""
    filled = set(_CP_ASYNC_DEST.findall(src))
    if not filled:
        return []
    found = []
    for loop in re.finditer(r"for \(int \w+ = 0; [^)]*\) \{", src):
        depth, i = 0, loop.end() - 1
        for i in range(loop.end() - 1, len(src)):
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            if depth == 0:
                break
        body = src[loop.end():i]
        if ".wait(" not in body or "wgmma" not in body:
            continue
        free = body.find("].arrive();")
        if free < 0:
            continue
        late = [m.group(1) for m in _DESCRIPTOR_OF.finditer(body, free) if m.group(1) in filled]
        found += [f"{name} read by a wgmma after its stage was freed" for name in late]
    return found


def unmoved_producer_waits(src: str) -> list[str]:
    """The waits (any parity) every producer thread still runs right before an elected block that arms a barrier and
    issues TMA copies (the producer's), in a kernel without ``cp.async`` (kernels_cuda/_producer_wait.py moves them;
    test_compile.py checks every compiled sm_90a kernel). Written apart from the rewrite's own pattern, so that a
    wait the rewrite misses shows here."""
    if "cp_async" in src:
        return []
    lines = src.splitlines()
    found = []
    for i, line in enumerate(lines[:-1]):
        if ".wait(" in line and re.match(r"\s*if \(tl::tl_shuffle_elect<\d+>\(\)\) \{", lines[i + 1]):
            depth, j = 0, i + 1
            block = []
            while j < len(lines):
                block.append(lines[j])
                depth += lines[j].count("{") - lines[j].count("}")
                if depth <= 0:
                    break
                j += 1
            text = "\n".join(block)
            if "tma_load" in text and ("arrive_and_expect_tx(" in text or "expect_transaction(" in text):
                found.append(line.strip())
    return found
