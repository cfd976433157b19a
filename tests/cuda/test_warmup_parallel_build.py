"""The warm-up's parallel build (backends/cuda/warmup.py ``fill_disk_cache``): worker subprocesses lower and compile
configurations into TileLang's disk cache, from which the serial pass then loads them without compiling again; a
configuration a worker cannot build comes back named. Compiles for sm_90a with nvcc; no GPU needed."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nvcc, pytest.mark.tilelang]

JOBS = {"rms_norm": [(1536, True, 1e-6)], "silu_mul": [(1536, False)]}  # sizes no other test here compiles


def _entries(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_dir()}


def test_workers_fill_the_disk_cache_and_the_serial_pass_loads_from_it(tmp_path, monkeypatch):
    from deepinfer_npu.backends.cuda import warmup
    from deepinfer_npu.kernels_cuda import rms_norm, silu_mul

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    assert warmup.fill_disk_cache(JOBS, 0.1, workers=2) == []
    built = _entries(tmp_path)
    assert len(built) >= 2, built  # both kernels, built by the workers
    rms_norm.precompile(JOBS["rms_norm"])
    silu_mul.precompile(JOBS["silu_mul"])
    assert _entries(tmp_path) == built  # loaded, not compiled again


def test_a_configuration_a_worker_cannot_build_is_named(tmp_path, monkeypatch):
    from deepinfer_npu.backends.cuda import warmup

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    failures = warmup.fill_disk_cache({"rms_norm": [(1000, True, 1e-6)], "silu_mul": [(1536, False)]}, 0.1,
                                      workers=2)
    assert len(failures) == 1 and failures[0].startswith("rms_norm (1000, True, 1e-06):"), failures


def test_no_workers_without_the_disk_cache_or_spare_cores(monkeypatch):
    from deepinfer_npu.backends.cuda import warmup

    monkeypatch.delenv("DEEPINFER_COMPILE_WORKERS", raising=False)
    monkeypatch.setattr(warmup, "usable_cores", lambda: 16)
    assert warmup.compile_workers(40) == 16 and warmup.compile_workers(3) == 3  # the caller only waits on them
    monkeypatch.setenv("DEEPINFER_COMPILE_WORKERS", "4")  # several engines starting on one host
    assert warmup.compile_workers(40) == 4
    monkeypatch.setenv("DEEPINFER_COMPILE_WORKERS", "1")
    assert warmup.compile_workers(40) == 0
    monkeypatch.setenv("DEEPINFER_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="DEEPINFER_COMPILE_WORKERS='many': expected auto or a count"):
        warmup.compile_workers(40)
    monkeypatch.delenv("DEEPINFER_COMPILE_WORKERS")
    monkeypatch.setattr(warmup, "usable_cores", lambda: 2)
    assert warmup.compile_workers(40) == 2
    monkeypatch.setattr(warmup, "usable_cores", lambda: 1)
    assert warmup.compile_workers(40) == 0
    monkeypatch.setattr(warmup, "usable_cores", lambda: 16)
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")
    assert warmup.compile_workers(40) == 0


def test_each_job_is_claimed_by_one_worker(tmp_path):
    """The workers share one job list: a job goes to the first process that claims it, whatever it drew before."""
    from deepinfer_npu.backends.cuda import warmup

    assert warmup.claim(str(tmp_path), 0) and not warmup.claim(str(tmp_path), 0)
    assert warmup.claim(str(tmp_path), 1)
    assert 1 <= warmup.usable_cores() <= (__import__("os").cpu_count() or 1)


def test_compiled_configurations_take_no_worker(tmp_path, monkeypatch):
    """A configuration the serial pass compiled is marked (per TileLang cache directory and kernel sources): the
    next start-up gives workers only the others."""
    from deepinfer_npu.backends.cuda import warmup

    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "engine"))
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tl"))
    done, todo = ("rms_norm", (1536, True, 1e-6)), ("silu_mul", (1536, False))
    assert not warmup.compiled_marker(*done).exists()
    warmup.mark_compiled(*done)
    assert warmup.compiled_marker(*done).exists() and not warmup.compiled_marker(*todo).exists()
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "another"))  # another kernel cache: not compiled there
    assert not warmup.compiled_marker(*done).exists()
    # mla_decode is built per softmax scale (a compile-time constant): another scale is another kernel
    mla = ("mla_decode", (16, 8, 1, True))
    warmup.mark_compiled(*mla, softmax_scale=0.1)
    assert warmup.compiled_marker(*mla, softmax_scale=0.1).exists()
    assert not warmup.compiled_marker(*mla, softmax_scale=0.2).exists()
    warmup.mark_compiled(*done, softmax_scale=0.1)  # the other modules take no scale: one marker
    assert warmup.compiled_marker(*done, softmax_scale=0.2).exists()


def test_the_queue_starts_with_the_longest_builds():
    """A long build claimed last would end last: the warm-up's queue is ordered by expected build seconds."""
    from deepinfer_npu.backends.cuda import warmup

    configs = {"rms_norm": [(2048, False, 1e-6)], "mla_decode": [(16, 1, 2, False, 16), (16, 8, 1, True),
                                                                   (16, 256, 1, True), (128, 2, 1, False, 64, True)],
               "moe_routing": [("unpermute", (2048, 6, "bfloat16", "torch_strided")), ("route", (2048, 6, 64))],
               "moe_gemm": [("expert_scan", (64,))]}
    order = warmup.warmup_job_order(configs)
    assert order[0] == ("mla_decode", (128, 2, 1, False, 64, True))  # the warp-specialized kernel: minutes
    assert order[1] == ("mla_decode", (16, 8, 1, True))  # the causal variant at short query tiles
    assert order.index(("moe_routing", ("route", (2048, 6, 64)))) < order.index(("rms_norm", (2048, False, 1e-6)))
    assert order[-1] == ("moe_gemm", ("expert_scan", (64,)))
    assert len(order) == 8 and warmup.expected_build_s("no_such_module", (1,)) == warmup.DEFAULT_BUILD_S


def test_a_background_build_fills_the_cache_marks_it_and_is_not_started_twice(tmp_path, monkeypatch):
    """The fallback-only configurations' build after start-up (backends/cuda/warmup_background.py): low-priority
    workers fill the disk cache, the configurations are marked compiled for the next start, and a second engine
    of the same process does not build them again."""
    from deepinfer_npu.backends.cuda import warmup, warmup_background

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "engine"))
    jobs = {"silu_mul": [(1664, True)]}  # a size no other test here compiles
    assert not warmup.compiled_marker("silu_mul", (1664, True)).exists()
    monkeypatch.setattr(warmup_background, "_building", set())  # this test's claims only
    fill = functools.partial(warmup.fill_disk_cache, softmax_scale=0.1)
    # at normal priority here: a busy test machine would starve the lowest
    assert warmup_background.start(jobs, 1, fill, warmup.mark_compiled, low_priority=False, key=0.1) == 1
    assert warmup_background.start(jobs, 1, fill, warmup.mark_compiled, key=0.1) == 0  # claimed by the build above
    done = warmup_background.wait(timeout=600)
    assert done is not None and done[0] > 0
    assert _entries(tmp_path / "tilelang") and warmup.compiled_marker("silu_mul", (1664, True)).exists()
    assert warmup_background._procs == []  # its workers ended and were let go
