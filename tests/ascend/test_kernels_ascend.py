"""kernels_ascend/: every kernel lowers to AscendC (tilelang.lower, target "ascend" — no CANN needed), and each
kernel's algorithm matches its torch reference when the same TileLang program is compiled for the host C target.

Every module in kernels_ascend/ (not starting with '_') must define ``ci_lower()`` and ``check()``; a new kernel
without them fails here, so none escapes the lowering check. Nothing here runs on an NPU.
"""

import importlib
import pkgutil

import pytest

tilelang = pytest.importorskip("tilelang", reason="tilelang is not installed (pip install tilelang==0.1.15)")

from deepinfer_npu import kernels_ascend  # noqa: E402

MODULES = sorted(m.name for m in pkgutil.iter_modules(kernels_ascend.__path__) if not m.name.startswith("_"))


def test_kernel_modules_found():
    assert {
        "zos_seqlens_k",
        "zos_seqlens_q",
        "spec_verify_greedy",
        "rejection_accept",
        "sample_pieces",
        "gating_topk",
    } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_lowers_to_ascendc(name, monkeypatch, tmp_path):
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    mod = importlib.import_module(f"deepinfer_npu.kernels_ascend.{name}")
    assert hasattr(mod, "ci_lower"), f"kernels_ascend/{name}.py must define ci_lower()"
    sources = mod.ci_lower()
    assert sources
    for kernel, src in sources.items():
        assert "__global__" in src and "__gm__" in src, f"{kernel}: not AscendC source"
        assert f"{kernel}_kernel" in src


@pytest.mark.parametrize("name", MODULES)
def test_algorithm_matches_reference_on_host_c_target(name, monkeypatch, tmp_path):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    mod = importlib.import_module(f"deepinfer_npu.kernels_ascend.{name}")
    assert hasattr(mod, "check"), f"kernels_ascend/{name}.py must define check()"
    assert mod.check(seed=1)
