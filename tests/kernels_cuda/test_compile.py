"""Every kernel module of kernels_cuda compiles for sm_90a (Hopper) and sm_100a (Blackwell) with nvcc, no GPU needed.

Every public module in kernels_cuda/ (not starting with '_', not ``bench``) must expose
``ci_compile(configs=None, target=None)``: compile ``configs`` (default: its representative ``CI_CONFIGS``) for
``target`` (default sm_90a), bypassing TileLang's kernel cache, and return the compiled kernels. A new kernel file
without it fails here, so no kernel escapes the compile check. The engine's decode-chain kernels are built with
programmatic dependent launch: their sources must wait for the previous kernel.

sm_90a compiles every configuration of ``CI_CONFIGS``. sm_100a (TileLang 0.1.15, nvcc 13.0): every module but
mla_decode_ws (Hopper-only by design, ``SM100_SKIP``) lowers and compiles; the tuned configurations are Hopper's, so
sm_100a compiles the first configuration of each kernel kind (``sm100_configs``). mla_decode's ``T.gemm`` lowers to
``mma.sync`` (ldmatrix operands, TMA loads kept) instead of Hopper's wgmma, so it compiles but is not the tuned
path there (TileLang would need tcgen05 / TMEM code for Blackwell's tensor cores); it is not run there.

The compiles are CPU-bound (TileLang lowering, nvcc) and most modules have few configurations: the module fixture
``compiles`` runs the selected tests' compiles in two worker processes, a module at a time each, the slow ones
first, so both cores stay busy instead of idling through each module's last nvcc; each test waits for its own
module's result. Compile time: the summary line each test prints (pytest -s; modules overlap, so the times add up
to more than the wall time).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import importlib
import inspect
import multiprocessing
import os
import pkgutil
import shutil
import time
import traceback
from dataclasses import dataclass

import pytest

from deepinfer_npu import kernels_cuda

MODULES = sorted(m.name for m in pkgutil.iter_modules(kernels_cuda.__path__)
                 if not m.name.startswith("_") and m.name != "bench")

#: the engine kernels built with programmatic dependent launch (kernels_cuda/_pdl.py)
PDL_MODULES = {"rms_norm", "mla_rope_cache", "mla_decode", "skinny_gemm", "moe_routing", "moe_gemm", "silu_mul",
               "moe_gemm_swap", "mla_absorb", "mla_decode_ws"}

SM100_TARGET = {"kind": "cuda", "arch": "sm_100a"}

#: module -> the exact reason it cannot target sm_100a (see the module docstring).
SM100_SKIP: dict[str, str] = {
    "mla_decode_ws": "Hopper-only by design: T.wgmma_gemm (wgmma issued by hand, A from registers) and setmaxnreg "
    "warpgroup roles have no sm_100a lowering; the engine takes it only on compute capability 9.x and keeps "
    "mla_decode's pipelined kernel elsewhere",
}

#: the modules whose compiles take longest (about 40-100 s each on two cores): started first, so the short ones fill
#: the gaps at the end; only the start order depends on this.
SLOW_FIRST = ("mla_decode_ws", "moe_routing", "skinny_gemm", "mla_decode", "spec_verify")

COMPILE_TIMEOUT_S = 1800  # one module's compile, queueing behind the others included


def test_kernel_modules_found():
    assert "mla_decode" in MODULES and "bench" not in MODULES and PDL_MODULES <= set(MODULES)


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


def test_sm100_configs_keep_one_per_kernel_kind():
    from deepinfer_npu.kernels_cuda import moe_routing, skinny_gemm, spec_verify

    assert [k for k, _c in sm100_configs(moe_routing.CI_CONFIGS)] == ["gating", "permute", "unpermute", "route"]
    assert sm100_configs(moe_routing.CI_CONFIGS)[0] == moe_routing.CI_CONFIGS[0]
    assert sm100_configs(skinny_gemm.CI_CONFIGS) == skinny_gemm.CI_CONFIGS[:1]
    assert [k for k, _c in sm100_configs(spec_verify.CI_CONFIGS)] == ["argmax", "accept"]
    assert sm100_configs([(128, 2, 1), (16, 4, 3)]) == [(128, 2, 1)]


@functools.cache
def _nvcc_knows(arch: str) -> bool:
    import subprocess

    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except Exception:  # noqa: BLE001
        return False
    return f"compute_{arch.removeprefix('sm_').rstrip('a')}" in out


def _sm100_skip_reason(name: str) -> str | None:
    if not _nvcc_knows("sm_100a"):
        return "this nvcc has no sm_100 target (needs CUDA >= 12.8)"
    return SM100_SKIP.get(name)


@dataclass
class Compiled:
    """What one module's ``ci_compile`` produced for one architecture (or the error it raised)."""

    sources: list[str]
    targets: list[str]
    seconds: float
    error: str | None = None


def _compile_module(name: str, arch: str) -> Compiled:
    t = time.time()
    try:
        mod = importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}")
        assert hasattr(mod, "ci_compile"), f"kernels_cuda/{name}.py must define ci_compile()"
        if arch == "sm_90a":
            kernels = mod.ci_compile()
        else:
            params = inspect.signature(mod.ci_compile).parameters
            assert {"configs", "target"} <= set(params) and isinstance(getattr(mod, "CI_CONFIGS", None), list), (
                f"kernels_cuda/{name}.py: ci_compile(configs=None, target=None) and a CI_CONFIGS list "
                "(sm_100a compiles a subset of it)")
            kernels = mod.ci_compile(configs=sm100_configs(mod.CI_CONFIGS), target=dict(SM100_TARGET))
        return Compiled([k.get_kernel_source() for k in kernels], [str(k.target) for k in kernels], time.time() - t)
    except Exception:  # noqa: BLE001 - reported by the module's own test
        return Compiled([], [], time.time() - t, traceback.format_exc())


class CompileJobs:
    """The compiles of the selected tests in two worker processes, one module at a time each (a module's
    ``ci_compile`` builds its kernels on the calling thread, then compiles them in parallel threads). Processes,
    not threads: building a kernel parses Python source, which must stay on one thread per process (CPython <
    3.13, kernels_cuda/_ast_guard.py)."""

    def __init__(self, jobs: list[tuple[str, str]]) -> None:
        self.pool = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
        rank = {name: i for i, name in enumerate(SLOW_FIRST)}
        order = sorted(jobs, key=lambda job: rank.get(job[0], len(rank)))  # stable: the tests' order otherwise
        self.futures = {job: self.pool.submit(_compile_module, *job) for job in order}

    def result(self, name: str, arch: str) -> Compiled:
        fut = self.futures.get((name, arch))
        if fut is None:  # not foreseen at the start (a test selected some other way): compile it now
            fut = self.futures[(name, arch)] = self.pool.submit(_compile_module, name, arch)
        return fut.result(timeout=COMPILE_TIMEOUT_S)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


_ARCH_OF_TEST = {"test_compiles_for_sm90a": "sm_90a", "test_compiles_for_sm100a": "sm_100a"}


@pytest.fixture(scope="module")
def compiles(request, tmp_path_factory):
    """Start every compile the session's selected (not skipped) compile tests will ask for."""
    jobs = []
    for item in request.session.items:
        arch = _ARCH_OF_TEST.get(getattr(item, "originalname", ""))
        if arch is None or item.module is not request.module or item.get_closest_marker("skip") is not None:
            continue
        name = item.callspec.params["name"]
        if arch == "sm_100a" and _sm100_skip_reason(name):
            continue
        jobs.append((name, arch))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILELANG_DISABLE_CACHE", "1")  # really compile: a cached artifact must not hide a break
        mp.setenv("TILELANG_CACHE_DIR", str(tmp_path_factory.mktemp("tilelang_cache")))
        pool = CompileJobs(list(dict.fromkeys(jobs)))
        try:
            yield pool
        finally:
            pool.close()


def _check(name: str, arch: str, got: Compiled) -> None:
    assert got.error is None, f"{name} for {arch}:\n{got.error}"
    assert got.sources, f"{name}.ci_compile() compiled nothing for {arch}"
    for src, target in zip(got.sources, got.targets):
        assert "__global__" in src
        assert arch.removesuffix("a") in target, target
        if arch == "sm_90a" and name in PDL_MODULES:
            assert "cudaGridDependencySynchronize" in src, f"{name}: a kernel without the PDL wait"
    print(f"{name}: {len(got.sources)} configurations compiled for {arch} in {got.seconds:.1f}s")


@pytest.mark.nvcc
@pytest.mark.tilelang
@pytest.mark.parametrize("name", MODULES)
def test_compiles_for_sm90a(name, compiles):
    _check(name, "sm_90a", compiles.result(name, "sm_90a"))


@pytest.mark.nvcc
@pytest.mark.tilelang
@pytest.mark.parametrize("name", MODULES)
def test_compiles_for_sm100a(name, compiles):
    if why := _sm100_skip_reason(name):
        pytest.skip(why)
    _check(name, "sm_100a", compiles.result(name, "sm_100a"))
