"""Every kernel module of kernels_cuda compiles for sm_90a (Hopper) and sm_100a (Blackwell) with nvcc, no GPU needed.

Every public module in kernels_cuda/ (not starting with '_', not ``bench``) must expose ``ci_compile()``: compile its
representative configurations for sm_90a, bypassing TileLang's kernel cache, and return the compiled kernels. A
new kernel file without it fails here, so no kernel escapes the compile check. For sm_100a the test passes
``target=`` when ``ci_compile`` accepts it, else it points the module's ``SM90_TARGET`` (which the module's
``ci_compile`` reads at call time) at sm_100a for the duration of the call. The engine's decode-chain kernels are
built with programmatic dependent launch: their sources must wait for the previous kernel.

sm_100a (TileLang 0.1.15, nvcc 13.0), what compiles: every module but mla_decode_ws (Hopper-only by design,
``SM100_SKIP``). mla_decode's ``T.gemm`` lowers to ``mma.sync`` (ldmatrix operands, TMA loads kept) instead of
Hopper's wgmma, so it compiles but is not the tuned path there (TileLang would need tcgen05 / TMEM code for
Blackwell's tensor cores); it is not run there. Compile time: the summary line each test prints (pytest -s).
"""

import functools
import importlib
import inspect
import os
import pkgutil
import shutil
import time

import pytest

from deepinfer_npu import kernels_cuda

MODULES = sorted(m.name for m in pkgutil.iter_modules(kernels_cuda.__path__)
                 if not m.name.startswith("_") and m.name != "bench")

#: the engine kernels built with programmatic dependent launch (kernels_cuda/_pdl.py)
PDL_MODULES = {"rms_norm", "mla_rope_cache", "mla_decode", "skinny_gemm", "moe_routing", "moe_gemm", "silu_mul",
               "moe_gemm_swap", "mla_absorb", "mla_decode_ws"}


def test_kernel_modules_found():
    assert "mla_decode" in MODULES and "bench" not in MODULES and PDL_MODULES <= set(MODULES)


@pytest.mark.nvcc
@pytest.mark.tilelang
@pytest.mark.parametrize("name", MODULES)
def test_compiles_for_sm90a(name, monkeypatch, tmp_path):
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")  # really compile: a cached artifact must not hide a break
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    mod = importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}")
    assert hasattr(mod, "ci_compile"), f"kernels_cuda/{name}.py must define ci_compile()"
    t = time.time()
    kernels = mod.ci_compile()
    assert kernels, f"{name}.ci_compile() compiled nothing"
    for k in kernels:
        src = k.get_kernel_source()
        assert "__global__" in src
        if name in PDL_MODULES:
            assert "cudaGridDependencySynchronize" in src, f"{name}: a kernel without the PDL wait"
    print(f"{name}: {len(kernels)} configurations compiled for sm_90a in {time.time() - t:.1f}s")


SM100_TARGET = {"kind": "cuda", "arch": "sm_100a"}

#: module -> the exact reason it cannot target sm_100a (see the module docstring).
SM100_SKIP: dict[str, str] = {
    "mla_decode_ws": "Hopper-only by design: T.wgmma_gemm (wgmma issued by hand, A from registers) and setmaxnreg "
    "warpgroup roles have no sm_100a lowering; the engine takes it only on compute capability 9.x and keeps "
    "mla_decode's pipelined kernel elsewhere",
}


@functools.cache
def _nvcc_knows(arch: str) -> bool:
    import subprocess

    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except Exception:  # noqa: BLE001
        return False
    return f"compute_{arch.removeprefix('sm_').rstrip('a')}" in out


@pytest.mark.nvcc
@pytest.mark.tilelang
@pytest.mark.parametrize("name", MODULES)
def test_compiles_for_sm100a(name, monkeypatch, tmp_path):
    if not _nvcc_knows("sm_100a"):
        pytest.skip("this nvcc has no sm_100 target (needs CUDA >= 12.8)")
    if name in SM100_SKIP:
        pytest.skip(SM100_SKIP[name])
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    mod = importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}")
    assert hasattr(mod, "ci_compile"), f"kernels_cuda/{name}.py must define ci_compile()"
    t = time.time()
    if "target" in inspect.signature(mod.ci_compile).parameters:
        kernels = mod.ci_compile(target=dict(SM100_TARGET))
    else:
        assert isinstance(getattr(mod, "SM90_TARGET", None), dict), (
            f"kernels_cuda/{name}.py: ci_compile() takes no target= and has no SM90_TARGET dict to redirect"
        )
        monkeypatch.setattr(mod, "SM90_TARGET", dict(SM100_TARGET))
        kernels = mod.ci_compile()
    assert kernels, f"{name}.ci_compile() compiled nothing"
    for k in kernels:
        assert "__global__" in k.get_kernel_source()
        assert "sm_100" in str(k.target), k.target
    print(f"{name}: {len(kernels)} configurations compiled for sm_100a in {time.time() - t:.1f}s")
