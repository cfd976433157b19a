"""benchmarks/bench_zos.py's ``step_ms`` is the timed window per decode step. Under ZOS the last ``engine.step()``
only flushes the deferred step (it launches nothing); counting it would make ``step_ms`` wall / (decode steps + 1),
~2 % low at --gen 48, and bias the ZOS on/off step-time comparison in ZOS's favour."""

from __future__ import annotations

import json
import types

import pytest

from benchmarks import bench_zos
from benchmarks.decode_workload import TINY


def test_step_ms_is_wall_time_per_decode_step_with_zos(tmp_path):
    zos = True  # (ZOS off passes: no flush-only step)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    batch, gen = 2, 8
    args = types.SimpleNamespace(backend="cpu", dtype="float32", prompt_len=32, gen=gen, graphs=False)
    r = bench_zos.run_config(args, str(tmp_path), TINY, batch, zos, lambda msg: None)
    assert r["decode_steps"] == gen
    elapsed_ms = 1e3 * (batch * gen) / r["tok_s"]  # tok_s = generation tokens / the same timed window
    per_decode_step = elapsed_ms / r["decode_steps"]
    assert r["step_ms"] == pytest.approx(per_decode_step, rel=0.01), (r["step_ms"], per_decode_step)
