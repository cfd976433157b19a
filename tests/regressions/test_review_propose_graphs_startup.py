"""Review finding: ``graph_capture="startup"`` ("all" graphs captured at start-up, config.py) is not honoured by
the DFlash propose graphs added this session (spec/propose_graphs.py): ``Worker._build_graphs`` captures every
decode size at start-up but ``ProposeGraphs`` always captures lazily, at the first propose of each padded row
count, i.e. inside the launch path of a serving step (on CUDA a capture synchronises the device and runs a
warm-up), which is what "startup" exists to avoid (benchmarks/bench_spec.py --graphs relies on it)."""

from __future__ import annotations

import pytest

from deepinfer_npu import LLM
from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.hal.graph_runner import EagerReplayRunner
from deepinfer_npu.hal.registry import get_backend

pytestmark = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "dflash" / "dflash_config.json").exists(),
                                reason="the reference model / DFlash drafter is not installed")


def test_startup_capture_covers_the_propose_graphs(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(type(get_backend("cpu")), "graph_runner", lambda self: EagerReplayRunner())
    llm = LLM(speculative_method="dflash", num_speculative_tokens=4, enable_graphs=True, graph_capture="startup",
              max_num_seqs=4, varlen_verification=False, block_size=16, num_kv_blocks=64)
    worker = llm.llm_engine.worker
    assert sorted(worker.graphs.graphs.static_out) == worker.graphs.sizes  # decode graphs: all at start-up
    pg = worker.drafter.propose_graphs
    assert pg is not None
    assert sorted(pg.graphs.static_out) == pg.sizes, (
        f"propose graphs captured at start-up: {sorted(pg.graphs.static_out)}, sizes {pg.sizes}")
