"""CUDA kernel set (kernels_cuda/): every kernel compiles for sm_90a with nvcc (no GPU needed), and on a
machine with a CUDA device each kernel matches its fp32 reference.

Every module in kernels_cuda/ (not starting with '_') must expose `ci_compile()`: compile its representative
configurations for sm_90a, bypassing TileLang's kernel cache, and return the compiled kernels. A new kernel
file without it fails here, so no kernel escapes the compile check.
"""

import importlib
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
    print(f"{name}: {len(kernels)} configurations compiled for sm_90a in {time.time() - t:.1f}s")


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
]


@gpu
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-S{c[4]}")
@pytest.mark.parametrize("seed", [0, 1])
def test_mla_decode_matches_reference_gpu(case, seed):
    from kernels_cuda import mla_decode as mla

    b, h, sk, sq, s = case
    ok, stats = mla.check_case(b, h, sk, sq, s, seed=1000 + seed, verbose=False)
    assert ok, stats


@gpu
def test_mla_decode_default_splits_gpu():
    """The launch wrapper's own split heuristic (no num_splits given) on a small batch: several splits."""
    from kernels_cuda import mla_decode as mla

    ok, stats = mla.check_case(2, 16, 4096, 1, None, seed=7, verbose=False)
    assert ok, stats
