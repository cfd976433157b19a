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


def test_repeated_log_lines_are_named():
    got = bench.log_repeats("INFO a: once\nWARNING b: twice\n\nWARNING b: twice\nINFO c: three\n" * 1
                            + "INFO c: three\nINFO c: three\n")
    assert got == {"log_lines": 6, "repeated_log_lines": [["INFO c: three", 3], ["WARNING b: twice", 2]]}


def test_cpu_start_up_row_counts_its_log(tmp_path):
    """A real start-up (tiny shape, CPU) in its own process: the row carries the log counts, nothing repeated."""
    from benchmarks.decode_workload import TINY, write_model_dir

    result = bench.run_once({"model": write_model_dir(TINY, "startup_log_"), "load_format": "dummy",
                             "backend": "cpu", "max_model_len": 256, "max_num_seqs": 4}, str(tmp_path), 300)
    assert result["tokens"] == 4 and isinstance(result["log_lines"], int), result
    assert result["first_request_builds"] in ([], None)  # the CPU backend builds no TileLang kernel
    assert result["repeated_log_lines"] == [], result["repeated_log_lines"]
