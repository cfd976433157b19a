"""``graph_capture="auto"`` (the default): every decode graph at start-up when there are at most
``STARTUP_CAPTURE_MAX_GRAPHS`` sizes, else each at its first use; "lazy" and "startup" as asked."""

from __future__ import annotations

import pytest

from benchmarks.decode_workload import TINY, write_model_dir
from deepinfer_npu import LLM
from deepinfer_npu.worker import worker as worker_mod


def _captured_at_start(capture: str, max_num_seqs: int) -> int:
    llm = LLM(write_model_dir(TINY, "capture_auto_"), load_format="dummy", backend="cpu", dtype="float32",
              max_model_len=128, max_num_seqs=max_num_seqs, enable_graphs=True, graph_capture=capture, seed=0,
              num_kv_blocks=64)
    graphs = llm.llm_engine.worker.graphs
    return sum(graphs.graphs.has(s) for s in graphs.sizes), len(graphs.sizes)


@pytest.mark.parametrize("capture,max_num_seqs,expect_all", [
    ("auto", 16, True),  # sizes 1, 2, 4, 8, 16: five graphs
    ("auto", 64, False),  # 11 sizes, past the (lowered) limit of 8
    ("lazy", 16, False), ("startup", 64, True)])
def test_auto_captures_at_start_up_up_to_the_limit(graph_runners, monkeypatch, capture, max_num_seqs, expect_all):
    monkeypatch.setattr(worker_mod, "STARTUP_CAPTURE_MAX_GRAPHS", 8)
    captured, sizes = _captured_at_start(capture, max_num_seqs)
    assert captured == (sizes if expect_all else 0), (captured, sizes)
