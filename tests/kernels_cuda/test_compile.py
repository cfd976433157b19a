"""CUDA kernel set (kernels_cuda/): every kernel compiles for sm_90a (Hopper) and sm_100a (Blackwell) with nvcc
(no GPU needed), and on a machine with a CUDA device each kernel matches its fp32 reference.

Every module in kernels_cuda/ (not starting with '_') must expose `ci_compile()`: compile its representative
configurations for sm_90a, bypassing TileLang's kernel cache, and return the compiled kernels. A new kernel
file without it fails here, so no kernel escapes the compile check. For sm_100a the test passes
``target=`` when ``ci_compile`` accepts it, else it points the module's ``SM90_TARGET`` (which every module's
``ci_compile`` reads at call time) at sm_100a for the duration of the call.

sm_100a (TileLang 0.1.15, nvcc 13.0), what compiles: every module but mla_decode_ws and mla_decode_seesaw
(Hopper-only by design,
``SM100_SKIP``). mla_decode's ``T.gemm`` lowers to
``mma.sync`` (ldmatrix operands, TMA loads kept) instead of Hopper's wgmma, so it compiles but is not the
tuned path there (TileLang would need tcgen05 / TMEM code for Blackwell's tensor cores); it is not run there.
Compile time of this file on the 2-core CI machine: see the summary line each test prints (pytest -s).
"""

import functools
import importlib
import inspect
import os
import pkgutil
import shutil
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(
        0, ROOT
    )  # kernels_cuda/ is a top-level folder of the repository (installed as deepinfer_npu.*)

tilelang = pytest.importorskip("tilelang", reason="tilelang is not installed (pip install tilelang==0.1.15)")

import kernels_cuda  # noqa: E402

MODULES = sorted(m.name for m in pkgutil.iter_modules(kernels_cuda.__path__) if not m.name.startswith("_"))


def _has_nvcc():
    if shutil.which("nvcc"):
        return True
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.path.exists(os.path.join(home, "bin", "nvcc"))


def _has_cuda_device():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def test_kernel_modules_found():
    assert "mla_decode" in MODULES


@pytest.mark.skipif(not _has_nvcc(), reason="nvcc (CUDA toolkit) not found: cannot compile for sm_90a")
@pytest.mark.parametrize("name", MODULES)
def test_compiles_for_sm90a(name, monkeypatch, tmp_path):
    monkeypatch.setenv(
        "TILELANG_DISABLE_CACHE", "1"
    )  # really compile: a cached artifact must not hide a break
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    mod = importlib.import_module(f"kernels_cuda.{name}")
    assert hasattr(mod, "ci_compile"), f"kernels_cuda/{name}.py must define ci_compile()"
    t = time.time()
    kernels = mod.ci_compile()
    assert kernels, f"{name}.ci_compile() compiled nothing"
    for k in kernels:
        src = k.get_kernel_source()
        assert "__global__" in src
        if name in PDL_MODULES:  # kernels_cuda/_pdl.py: the waits are there exactly when it is on
            from kernels_cuda._pdl import pdl_enabled

            pdl = pdl_enabled()
            assert ("cudaGridDependencySynchronize" in src) == pdl, f"{name}: PDL={pdl} but the kernel disagrees"
    print(f"{name}: {len(kernels)} configurations compiled for sm_90a in {time.time() - t:.1f}s")


#: the engine kernels built with programmatic dependent launch (kernels_cuda/_pdl.py)
PDL_MODULES = {"rms_norm", "mla_rope_cache", "mla_decode", "skinny_gemm", "moe_routing", "moe_gemm", "silu_mul",
               "moe_gemm_swap", "mla_absorb", "mla_decode_ws", "mla_decode_seesaw"}


@pytest.mark.skipif(not _has_nvcc(), reason="nvcc (CUDA toolkit) not found: cannot compile for sm_90a")
@pytest.mark.parametrize("name", ["silu_mul", "skinny_gemm"])
def test_pdl_off_variant_compiles_for_sm90a(name, monkeypatch, tmp_path):
    """DEEPINFER_PDL=0 (PDL is on by default): the kernels do not wait for their predecessor
    (no cudaGridDependencySynchronize), and skinny_gemm's dense kernel's early weight loads (its PDL-only code
    path) are not there either: the off switch still builds."""
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    mod = importlib.import_module(f"kernels_cuda.{name}")
    for k in mod.ci_compile():
        assert "cudaGridDependencySynchronize" not in k.get_kernel_source(), name


SM100_TARGET = {"kind": "cuda", "arch": "sm_100a"}

#: module -> the exact reason it cannot target sm_100a (see the module docstring).
SM100_SKIP: dict[str, str] = {
    "mla_decode_ws": "Hopper-only by design: T.wgmma_gemm (wgmma issued by hand) and setmaxnreg warpgroup roles have "
    "no sm_100a lowering; the engine takes it only on compute capability 9.x (kernels.is_sm90) and keeps "
    "mla_decode's pipelined kernel elsewhere",
    "mla_decode_seesaw": "Hopper-only by design: T.wgmma_gemm (wgmma issued by hand, A from registers); built through "
    "mla_decode_ws, which the engine takes only on compute capability 9.x",
}


@functools.cache
def _nvcc_knows(arch: str) -> bool:
    import subprocess

    nvcc = shutil.which("nvcc") or os.path.join(
        os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda", "bin", "nvcc"
    )
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except Exception:  # noqa: BLE001
        return False
    return f"compute_{arch.removeprefix('sm_').rstrip('a')}" in out


@pytest.mark.skipif(not _has_nvcc(), reason="nvcc (CUDA toolkit) not found: cannot compile for sm_100a")
@pytest.mark.parametrize("name", MODULES)
def test_compiles_for_sm100a(name, monkeypatch, tmp_path):
    if not _nvcc_knows("sm_100a"):
        pytest.skip("this nvcc has no sm_100 target (needs CUDA >= 12.8)")
    if name in SM100_SKIP:
        pytest.skip(SM100_SKIP[name])
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    mod = importlib.import_module(f"kernels_cuda.{name}")
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


# ----------------------------------------------------------------------------------------------------
# GPU numerics (skipped without a CUDA device)
# ----------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(
    not _has_cuda_device(), reason="no CUDA device: GPU numerics tests run on the H200 only"
)

MLA_CASES = [
    # batch, heads, seqlens_k, seqlens_q, num_splits
    (4, 16, 1000, 1, 1),
    (3, 128, 64, 1, 3),  # one page, two empty splits
    (5, 128, 777, 4, 3),  # partial last page, verification
    (6, 16, 2049, 16, 3),
    (4, 128, [100, 3000, 65, 1500], [16, 3, 1, 9], 1),  # varlen batch
    (4, 16, [100, 3000, 65, 1500], [16, 3, 1, 9], 3),
    (4, 16, 1000, 2, 1),  # 32 rows of a 64-row tile (V2-Lite, one MTP draft)
]


@gpu
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-S{c[4]}")
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ws", [None, "seesaw", "ws"], ids=["pipelined", "ws-seesaw", "ws-first"])
def test_mla_decode_matches_reference_gpu(case, seed, ws):
    """Both decode kernels (``warp_specialized``: mla_decode_ws's where the tile has 64 rows, with each of its
    schedules; the 16-row cases keep the small pipelined tile either way)."""
    from kernels_cuda import mla_decode as mla

    b, h, sk, sq, s = case
    if ws:
        bucket = mla.bucket_q(max(sq) if isinstance(sq, list) else sq)
        if mla.decode_block_m(h, bucket) != mla.BLOCK_M:
            pytest.skip("a 16-row tile: the pipelined kernel whatever the flag (the 'pipelined' id runs it)")
        assert mla.takes_warp_specialized(h, bucket, True), mla._ws_module().disabled_reason
    ok, stats = mla.check_case(b, h, sk, sq, s, seed=1000 + seed, verbose=False, warp_specialized=ws is not None,
                               ws_variant={"schedule": ws} if ws else None)
    assert ok, stats


def test_mla_decode_ws_applies_to_the_64_row_tiles():
    from kernels_cuda import mla_decode as mla
    from kernels_cuda import mla_decode_ws as ws

    assert not ws.applies(16, 1) and ws.applies(16, 2) and ws.applies(16, 16) and ws.applies(128, 1)
    cases = ws.check_cases()
    theirs = [c for c in mla.check_cases() if ws.applies(c[1], ws._q_bucket(c[3]))]
    assert theirs and all(c in cases for c in theirs)  # every 64-row case of mla_decode's, plus its own
    assert any(c[1] == 16 and ws._q_bucket(c[3]) == 2 for c in cases)  # 32 valid rows of 64 (one MTP draft)
    assert {c[1] for c in cases} == {16, 128}  # 16 heads only from 2 query tokens up
    assert all(c[1] == 128 or (max(c[3]) if isinstance(c[3], list) else c[3]) > 1 for c in cases)


@gpu
def test_mla_decode_default_splits_gpu():
    """The launch wrapper's own split heuristic (no num_splits given) on a small batch: several splits."""
    from kernels_cuda import mla_decode as mla

    ok, stats = mla.check_case(2, 16, 4096, 1, None, seed=7, verbose=False)
    assert ok, stats
