"""Review finding: on a backend whose "device" tensors are CPU tensors (the CPU backend with a graph runner
injected, as tests/worker/test_graph_replay.py does; the CPU emulation of the Ascend graphs), a deferred ZOS step's
``StepResult.draft_probs`` is a numpy view of DFlash's propose-graph static output, not a copy.

``Worker._to_host`` returns CPU tensors as they are (no copy), and ``ProposeGraphs.run`` returns views into the
graph's static outputs. Under ZOS, step N-1 is post-processed in phase 2 of call N, but its result is consumed by
``LLMEngine._apply_results`` (``VarlenController.observe`` -> calibrator -> ``scheduler.set_draft_probs``) only
after phase 3 of call N, whose propose replays the same graph and overwrites the buffer. Varlen then plans with
step N's confidences filed under step N-1 (on CUDA the pinned copy keeps N-1's values: the CPU run no longer
mirrors the device's behaviour, contrary to spec/propose_graphs.py's "the worker copies ... out (the host copy)").
"""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.hal.graph_runner import EagerReplayRunner
from deepinfer_npu.hal.registry import get_backend
from deepinfer_npu.spec.varlen import VarlenController
from deepinfer_npu.worker.worker import Worker

pytestmark = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "dflash" / "dflash_config.json").exists(),
                                reason="the reference model / DFlash drafter is not installed")

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "# Copyright 2001 Python Software Foundation\n\"\"\"Utilities for",
]


@pytest.fixture
def graph_runners(monkeypatch):
    made: list[EagerReplayRunner] = []

    def factory(self):
        made.append(EagerReplayRunner())
        return made[-1]

    monkeypatch.setattr(type(get_backend("cpu")), "graph_runner", factory)
    return made


def test_deferred_step_draft_probs_are_not_overwritten_by_the_next_propose(graph_runners, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    at_post_process: dict[int, np.ndarray] = {}
    observed: list[tuple[int, np.ndarray]] = []
    orig_post, orig_observe = Worker._post_process, VarlenController.observe

    def post_process(self, step):
        res = orig_post(self, step)
        if res.draft_probs is not None:
            at_post_process[res.step_id] = res.draft_probs.copy()  # the step's own confidences
        return res

    def observe(self, res):
        if res.draft_probs is not None:
            observed.append((res.step_id, res.draft_probs.copy()))  # what varlen actually consumes
        return orig_observe(self, res)

    monkeypatch.setattr(Worker, "_post_process", post_process)
    monkeypatch.setattr(VarlenController, "observe", observe)
    llm = LLM(speculative_method="dflash", num_speculative_tokens=4, zero_overhead_scheduling=True,
              varlen_verification=True, enable_graphs=True, block_size=16, num_kv_blocks=64)
    llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    pg = llm.llm_engine.worker.drafter.propose_graphs
    assert pg is not None and pg.replays > 0  # propose really replayed graphs
    assert observed
    changed = [sid for sid, probs in observed if not np.array_equal(probs, at_post_process[sid])]
    assert not changed, f"{len(changed)}/{len(observed)} steps' draft_probs changed between post-processing " \
        f"and varlen.observe (overwritten by the next propose replay): steps {changed[:8]}"
