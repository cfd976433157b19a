"""Every kernel module of kernels_cuda compiles for sm_90a (Hopper) and sm_100a (Blackwell) with nvcc, no GPU needed.

Every public module in kernels_cuda/ (not starting with '_', not ``bench``) must expose
``ci_compile(configs=None, target=None)``: compile ``configs`` (default: its representative ``CI_CONFIGS``) for
``target`` (default sm_90a), bypassing TileLang's kernel cache, and return the compiled kernels. A new kernel file
without it fails here, so no kernel escapes the compile check. The engine's decode-chain kernels are built with
programmatic dependent launch: their sources must wait for the previous kernel (compiled as written,
``DEEPINFER_PDL_OFF=none``; the setting's effect: test_pdl_setting.py). Every sm_90a kernel comes out of the
producer-wait hook (kernels_cuda/_producer_wait.py; the rewrite itself: test_producer_wait.py).

Both architectures compile the first configuration of each kernel kind of ``CI_CONFIGS`` (``sm100_configs``); with
``--all-kernel-configs`` sm_90a compiles every configuration (the other configurations change tile sizes, not code;
lowering them doubles the compile time of the suite, and a GPU job builds every configuration it launches).
sm_100a (TileLang 0.1.15, nvcc 13.0): every module but mla_decode_ws (Hopper-only by design, ``SM100_SKIP``) lowers
and compiles; the tuned configurations are Hopper's. ``FULL_ONLY`` modules (mla_decode_ws: minutes of lowering)
compile only with ``--all-kernel-configs``. mla_decode's ``T.gemm`` lowers to
``mma.sync`` (ldmatrix operands, TMA loads kept) instead of Hopper's wgmma, so it compiles but is not the tuned
path there (TileLang would need tcgen05 / TMEM code for Blackwell's tensor cores); it is not run there.

The compiles run in two worker processes started with this module's first compile test, the slow modules first
(tests/kernel_compiles.py), so both cores stay busy; each test waits for its module's result. Compile time: the
summary line each test prints (pytest -s; modules overlap, so the times add up to more than the wall time).
"""

from __future__ import annotations

import pkgutil
import re

import pytest

from deepinfer_npu import kernels_cuda
from tests import kernel_compiles
from tests.kernel_compiles import (
    Compiled,
    cp_async_rows_freed_early,
    full_only_reason,
    sm100_configs,
    sm100_skip_reason,
    unmoved_producer_waits,
)

#: one pytest-xdist worker runs the whole module: its compile pool serves every compile test of the session
pytestmark = pytest.mark.xdist_group("kernel_compiles")

MODULES = sorted(m.name for m in pkgutil.iter_modules(kernels_cuda.__path__)
                 if not m.name.startswith("_") and m.name != "bench")

#: the engine kernels written with programmatic dependent launch (kernels_cuda/_pdl.py; DEEPINFER_PDL_OFF may strip it)
PDL_MODULES = {"rms_norm", "mla_rope_cache", "mla_decode", "skinny_gemm", "fp8_skinny_gemm", "moe_routing", "moe_gemm",
               "silu_mul", "moe_gemm_swap", "mla_absorb", "mla_decode_ws", "fp8_quant", "fp8_gemm", "fp8_grouped_gemm"}


#: the FP8 GEMM modules: on sm_90a their GEMM kernels issue fp8 wgmma
FP8_WGMMA_MODULES = {"fp8_gemm", "fp8_grouped_gemm"}

#: modules with a pure TMA warp-specialised pipeline: their producer's free-stage wait is the elected thread's
#: (kernels_cuda/_producer_wait.py)
ELECTED_WAIT_MODULES = {"fp8_gemm", "fp8_grouped_gemm", "mla_decode"}
ELECTED_WAIT = re.compile(r"if \(tl::tl_shuffle_elect<\d+>\(\)\) \{\n\s*mbarrier\[[^\n]*\]\.wait\(")

def test_kernel_modules_found():
    assert "mla_decode" in MODULES and "bench" not in MODULES and PDL_MODULES <= set(MODULES)


def test_sm100_configs_keep_one_per_kernel_kind():
    from deepinfer_npu.kernels_cuda import moe_gemm, moe_routing, skinny_gemm, spec_verify

    assert [k for k, _c in sm100_configs(moe_routing.CI_CONFIGS)] == ["gating", "permute", "unpermute", "route"]
    assert sm100_configs(moe_routing.CI_CONFIGS)[0] == moe_routing.CI_CONFIGS[0]
    assert sm100_configs(skinny_gemm.CI_CONFIGS) == skinny_gemm.CI_CONFIGS[:1]
    assert [k for k, _c in sm100_configs(moe_gemm.CI_CONFIGS)] == ["gated", "gemm"]  # two code paths, both built
    assert [k for k, _c in sm100_configs(spec_verify.CI_CONFIGS)] == ["argmax", "accept"]
    assert sm100_configs([(128, 2, 1), (16, 4, 3)]) == [(128, 2, 1)]


@pytest.fixture(scope="module")
def compiles(request, tmp_path_factory):
    """The selected compile tests' compile jobs, all started at once; their worker processes end with this
    module."""
    jobs = kernel_compiles.start(request.session.items, tmp_path_factory.mktemp("tilelang_cache"),
                                 every_config=request.config.getoption("--all-kernel-configs"))
    assert jobs is not None, "a compile test runs but none was selected"
    yield jobs
    kernel_compiles.stop()


def _check(name: str, arch: str, got: Compiled) -> None:
    assert got.error is None, f"{name} for {arch}:\n{got.error}"
    assert got.sources, f"{name}.ci_compile() compiled nothing for {arch}"
    for src, target in zip(got.sources, got.targets):
        assert "__global__" in src
        assert arch.removesuffix("a") in target, target
        if arch == "sm_90a" and name in PDL_MODULES:
            assert "cudaGridDependencySynchronize" in src, f"{name}: a kernel without the PDL wait"
        if arch == "sm_90a":  # the producer-wait hook ran: no wait left for every producer thread
            assert not unmoved_producer_waits(src), f"{name}: producer waits the hook did not move"
            assert not (early := cp_async_rows_freed_early(src)), f"{name}: {early}"
    if arch == "sm_90a" and name in ELECTED_WAIT_MODULES:
        assert any(ELECTED_WAIT.search(src) for src in got.sources), f"{name}: no elected producer wait"
    if arch == "sm_90a" and name in FP8_WGMMA_MODULES:  # the GEMMs multiply e4m3 operands, not upcast copies
        assert any("kFloat8_e4m3" in src for src in got.sources), f"{name}: no kernel issues an fp8 wgmma"
    print(f"{name}: {len(got.sources)} configurations compiled for {arch} in {got.seconds:.1f}s")


@pytest.mark.nvcc
@pytest.mark.tilelang
@pytest.mark.parametrize("name", MODULES)
def test_compiles_for_sm90a(name, request):
    if why := full_only_reason(name, request.config.getoption("--all-kernel-configs")):
        pytest.skip(why)
    _check(name, "sm_90a", request.getfixturevalue("compiles").result(name, "sm_90a"))


@pytest.mark.nvcc
@pytest.mark.tilelang
@pytest.mark.parametrize("name", MODULES)
def test_compiles_for_sm100a(name, request):
    if why := sm100_skip_reason(name):
        pytest.skip(why)
    _check(name, "sm_100a", request.getfixturevalue("compiles").result(name, "sm_100a"))
