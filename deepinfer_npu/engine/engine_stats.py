"""Engine counters (steps, tokens, timings, speculative acceptance) and the ``get_stats()`` report built on them.

``LLMEngine.stats`` is the plain counter dict (benchmarks reset it between phases); ``stats_report`` adds the
derived values and the state of the scheduler, KV cache, graphs and drafter.
"""

from __future__ import annotations

import numpy as np

from deepinfer_npu.worker.step_io import StepResult


def new_counters() -> dict:
    return {
        "num_steps": 0, "prefill_steps": 0, "decode_steps": 0, "prompt_tokens": 0,
        "generation_tokens": 0, "preempted_requests": 0, "ignored_requests": 0, "aborted_requests": 0,
        "forward_ms": 0.0, "sample_ms": 0.0, "model_ms": 0.0, "step_ms": 0.0, "host_wait_ms": 0.0,
        "spec_verify_steps": 0, "spec_verify_rows": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
        "spec_emitted_tokens": 0, "varlen_resplit_rows": 0,
    }


class SpecCounters:
    """Drafts verified and accepted per draft position, over the rows of live requests."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.drafted = np.zeros(max(num_speculative_tokens, 1), dtype=np.int64)
        self.accepted = np.zeros(max(num_speculative_tokens, 1), dtype=np.int64)

    def record(self, stats: dict, res: StepResult, live: np.ndarray) -> None:
        d, a = res.num_drafts[live], res.num_accepted[live]
        stats["spec_verify_steps"] += 1
        stats["spec_verify_rows"] += int(live.sum())
        stats["spec_draft_tokens"] += int(d.sum())
        stats["spec_accepted_tokens"] += int(a.sum())
        stats["spec_emitted_tokens"] += int((a + 1).sum())
        if res.planned_drafts is not None:  # rows whose split the device changed (ZOS + varlen, N-1 rule)
            stats["varlen_resplit_rows"] += int((res.planned_drafts[live] != d).sum())
        for pos in range(len(self.drafted)):
            self.drafted[pos] += int((d > pos).sum())
            self.accepted[pos] += int((a > pos).sum())

    def per_position_acceptance(self) -> list[float | None]:
        return [float(acc / dr) if dr else None for acc, dr in zip(self.accepted, self.drafted)]


def stats_report(engine) -> dict:
    s = dict(engine.stats)
    s["preemptions"] = int(engine.scheduler.num_preemptions)  # finished or recomputed
    s["kv_usage"] = float(engine.scheduler.kv_usage())
    s["state_slot_usage"] = float(engine.scheduler.state_manager.usage())
    s["num_waiting"] = int(engine.scheduler.num_waiting)
    s["num_running"] = int(engine.scheduler.num_running)
    s["num_kv_blocks"] = engine.runner.num_kv_blocks
    s["backend"] = engine.backend.name
    graphs = engine.worker.graphs
    s["graph_steps"] = engine.worker.graph_steps  # decode steps replayed from captured graphs
    if graphs is not None:
        s["graphs_captured"] = sorted(graphs.graphs.static_out)
        s["graphs_disabled"] = graphs.disabled
        s["graph_capture_s"] = round(graphs.capture_s, 3)  # host time capturing, at start-up or at first use
        s["graph_substituted_steps"] = graphs.substituted  # steps replayed in a larger graph than their size
    if engine.config.nextn:
        rows = max(s["spec_verify_rows"], 1)
        s["speculative_method"] = engine.config.speculative_method
        s["num_speculative_tokens"] = engine.config.nextn
        s["mean_accepted_length"] = s["spec_emitted_tokens"] / rows
        s["mean_verify_length"] = s["spec_draft_tokens"] / rows
        s["draft_acceptance_rate"] = s["spec_accepted_tokens"] / max(s["spec_draft_tokens"], 1)
        s["per_position_acceptance"] = engine.spec_counters.per_position_acceptance()
        s["varlen_verification"] = engine.varlen is not None
    return s
