"""``graph_capture="startup"`` captures the DFlash propose graphs (spec/propose_graphs.py) at start-up, as it does
the decode graphs: a lazy capture at the first propose of each padded row count would run inside a serving step's
launch path (on CUDA a capture synchronises the device and runs a warm-up), which "startup" exists to avoid
(benchmarks/bench_spec.py --graphs relies on it)."""

from __future__ import annotations

from deepinfer_npu import LLM
from tests.reference_assets import needs_dflash

pytestmark = needs_dflash


def test_startup_capture_covers_the_propose_graphs(graph_runners, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    llm = LLM(speculative_method="dflash", num_speculative_tokens=4, enable_graphs=True, graph_capture="startup",
              max_num_seqs=4, varlen_verification=False, block_size=16, num_kv_blocks=64)
    worker = llm.llm_engine.worker
    assert sorted(worker.graphs.graphs.static_out) == worker.graphs.sizes  # decode graphs: all at start-up
    pg = worker.drafter.propose_graphs
    assert pg is not None
    assert sorted(pg.graphs.static_out) == pg.sizes, (
        f"propose graphs captured at start-up: {sorted(pg.graphs.static_out)}, sizes {pg.sizes}")
