"""``DEEPINFER_PDL_OFF``: kernels built without programmatic dependent launch (kernels_cuda/_pdl.py)."""

from __future__ import annotations

import pytest

from deepinfer_npu.kernels_cuda import _pdl


@pytest.mark.parametrize("raw,prefixes", [("", ()), ("fp8", ("fp8",)), ("none", ()), ("all", ("",)), ("ALL", ("",)),
                                          (" fp8, mla_decode ,", ("fp8", "mla_decode"))])
def test_off_prefixes_parse(monkeypatch, raw, prefixes):
    monkeypatch.setenv("DEEPINFER_PDL_OFF", raw)  # empty: the default, none
    assert _pdl.off_prefixes() == prefixes
    assert _pdl.pdl_enabled() == (prefixes != ("",))


def test_built_without_matches_name_prefixes(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PDL_OFF", "fp8_gemm,mla")
    assert _pdl.built_without("fp8_gemm_swap") and _pdl.built_without("mla_decode")
    assert not _pdl.built_without("fp8_grouped_gemm") and not _pdl.built_without("rms_norm")
    monkeypatch.setenv("DEEPINFER_PDL_OFF", "all")
    assert _pdl.built_without("rms_norm")
    monkeypatch.delenv("DEEPINFER_PDL_OFF")  # the default: no kernel without PDL
    assert not _pdl.built_without("rms_norm") and not _pdl.built_without("mla_decode")
    assert not _pdl.built_without("fp8_quant") and not _pdl.built_without("fp8_grouped_gemm")


def _pdl_calls(func) -> int:
    return sum(line.strip() in ("T.pdl_sync()", "T.pdl_trigger()") for line in str(func.script()).splitlines())


@pytest.mark.tilelang
def test_setting_strips_wait_and_trigger_from_the_named_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))  # the stored PrimFunc keeps both calls
    from deepinfer_npu.kernels_cuda import fp8_quant, rms_norm

    monkeypatch.setenv("DEEPINFER_PDL_OFF", "none")
    assert _pdl_calls(fp8_quant.build_fp8_quant(2048, 8)) == 2
    monkeypatch.setenv("DEEPINFER_PDL_OFF", "fp8")
    assert _pdl_calls(fp8_quant.build_fp8_quant(2048, 8)) == 0  # served from the disk cache, then stripped
    assert _pdl_calls(rms_norm.build_rms_norm(*rms_norm.CI_CONFIGS[0])) == 2
    monkeypatch.setenv("DEEPINFER_PDL_OFF", "add_rms")  # PrimFunc names: add_rms_norm
    assert _pdl_calls(fp8_quant.build_fp8_quant(2048, 8)) == 2
    assert _pdl_calls(rms_norm.build_rms_norm(*rms_norm.CI_CONFIGS[0])) == 0


@pytest.mark.tilelang
@pytest.mark.nvcc
def test_stripped_kernel_compiles_without_grid_dependency(monkeypatch, tmp_path):
    """No ``griddepcontrol`` in the code (TileLang's tvm_ffi backend sets the PDL launch attribute only for a kernel
    with the wait: lower_pdl.cc)."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DEEPINFER_PDL_OFF", "fp8_quant")
    from deepinfer_npu.kernels_cuda import fp8_quant

    kernel = fp8_quant.ci_compile([("quant", (2048, 8, False))])[0]
    src = kernel.get_kernel_source()
    assert "cudaGridDependencySynchronize" not in src and "cudaTriggerProgrammaticLaunchCompletion" not in src
    assert "__global__" in src


@pytest.mark.tilelang
def test_warmup_marker_is_per_setting(monkeypatch, tmp_path):
    """A configuration built under one setting is not "already built" under another (another PrimFunc)."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    from deepinfer_npu.backends.cuda.warmup import compiled_marker

    markers = {}
    for raw in ("none", "fp8", "all"):
        monkeypatch.setenv("DEEPINFER_PDL_OFF", raw)
        markers[raw] = compiled_marker("fp8_quant", (2048, 8, False))
    assert len(set(markers.values())) == 3


def test_a_non_primfunc_is_returned_unchanged(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PDL_OFF", "all")
    module = object()  # no with_body: not a PrimFunc
    assert _pdl.apply_setting(module) is module
