"""benchmarks/bench_startup.py: the warm-up summary's seconds, and a run that fails names why (its own process's
last lines) instead of printing a row."""

import pytest

from benchmarks import bench_startup as bench


def test_warmup_seconds_from_the_summary():
    assert bench.warmup_seconds("74 configs in 193.6 s (rms_norm: 2, mla_decode: 41 (6 prefill))") == 193.6
    assert bench.warmup_seconds("nothing to warm up") is None and bench.warmup_seconds(None) is None


def test_a_failing_start_up_names_its_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"start-up run failed \(exit 1\):(.|\n)*no_such_backend"):
        bench.run_once({"backend": "no_such_backend", "load_format": "dummy"}, str(tmp_path), timeout_s=300)
