"""kernels_cuda.bench, the one benchmark harness: a benchmark for every kernel module, rows with the benchmark
metadata, and a clear refusal without a CUDA device."""

import json
import pkgutil

import pytest

from deepinfer_npu import kernels_cuda
from deepinfer_npu.kernels_cuda import bench


def test_every_kernel_module_has_a_benchmark():
    modules = {m.name for m in pkgutil.iter_modules(kernels_cuda.__path__) if not m.name.startswith("_")}
    assert modules - {"bench"} <= set(bench.BENCHES)


def test_rates_and_speedups():
    row = bench.against(bench.rate({"op": "x"}, nbytes=2_000_000, us=1.0, copy=4000.0), 1.0, "torch", 3.0)
    assert row["GBps"] == 2000.0 and row["frac_of_copy"] == 0.5
    assert row["torch_us"] == 3.0 and row["speedup_vs_torch"] == 3.0


def test_rows_carry_the_metadata(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "copy_gbps", lambda: 4000.0)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    out = tmp_path / "rows.jsonl"
    assert bench.main(["copy", "--out", str(out)]) == 0
    row = json.loads(capsys.readouterr().out.strip())
    assert row["bench"] == "copy" and row["GBps"] == 4000.0
    assert {"date", "commit", "command"} <= set(row) and row["hardware"] == "NVIDIA H200"
    assert json.loads(out.read_text()) == row


@pytest.mark.skipif(bench.torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_device_it_says_so(capsys):
    assert bench.main(["rms_norm"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
