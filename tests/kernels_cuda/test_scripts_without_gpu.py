"""A kernel file run alone for a GPU-only job on a machine without a CUDA device says so, naming the flags, and
exits non-zero before any compile (it used to fail deep inside with a CUDA generator error)."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("name", ["rms_norm", "mla_decode", "skinny_gemm", "mla_decode_ws", "mla_decode_seesaw"])
def test_gpu_flags_without_a_device(name):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "kernels_cuda", f"{name}.py"), "--check", "--bench"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--check --bench: no CUDA device here" in out.stderr, out.stderr[-2000:]
    assert "compiled" not in out.stdout  # stopped before compiling anything
