"""A deferred ZOS step's ``StepResult.draft_probs`` survives the next propose-graph replay on a backend whose
"device" tensors are CPU tensors (the CPU backend with a graph runner injected; the CPU emulation of Ascend graphs).

``Worker._to_host`` returns CPU tensors as they are and ``ProposeGraphs.run`` returns views into the graph's static
outputs. Under ZOS, step N-1 is post-processed in phase 2 of step N but consumed by ``LLMEngine._apply_results``
(``VarlenController.observe`` -> calibrator -> ``scheduler.set_draft_probs``) after phase 3 of step N, whose propose
replays the same graph: without a host copy varlen would plan with step N's confidences filed under step N-1 (on
CUDA the pinned copy keeps N-1's values)."""

from __future__ import annotations

import numpy as np

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.spec.varlen import VarlenController
from deepinfer_npu.worker.worker import Worker
from tests.reference_assets import CODE_PROMPTS, needs_dflash

pytestmark = needs_dflash


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
    llm.generate(CODE_PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    pg = llm.llm_engine.worker.drafter.propose_graphs
    assert pg is not None and pg.replays > 0  # propose really replayed graphs
    assert observed
    changed = [sid for sid, probs in observed if not np.array_equal(probs, at_post_process[sid])]
    assert not changed, f"{len(changed)}/{len(observed)} steps' draft_probs changed between post-processing " \
        f"and varlen.observe (overwritten by the next propose replay): steps {changed[:8]}"
