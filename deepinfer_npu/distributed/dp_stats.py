"""One ``get_stats()`` report for a data-parallel deployment: the ranks' counters summed, ratios recomputed."""

from __future__ import annotations

from deepinfer_npu.engine.engine_stats import new_counters
from deepinfer_npu.eplb.metrics import merge_ep_stats


def merge_rank_stats(per_rank: list[dict]) -> dict:
    merged = {key: sum(r.get(key, 0) for r in per_rank) for key in new_counters()}
    merged["preemptions"] = sum(r.get("preemptions", 0) for r in per_rank)
    merged["kv_usage"] = max(r.get("kv_usage", 0.0) for r in per_rank)  # the fullest rank limits admission
    merged["state_slot_usage"] = max(r.get("state_slot_usage", 0.0) for r in per_rank)
    merged["num_waiting"] = sum(r.get("num_waiting", 0) for r in per_rank)
    merged["num_running"] = sum(r.get("num_running", 0) for r in per_rank)
    merged["num_kv_blocks"] = sum(r.get("num_kv_blocks", 0) for r in per_rank)
    merged["backend"] = per_rank[0].get("backend")
    merged["data_parallel_size"] = len(per_rank)
    merged["per_rank"] = per_rank
    if "expert_parallel" in per_rank[0]:  # moe_lb per MoE layer, the load balancer's re-plans and pauses
        merged.update(merge_ep_stats(per_rank))
    if "speculative_method" in per_rank[0]:
        rows = max(merged["spec_verify_rows"], 1)
        merged["speculative_method"] = per_rank[0]["speculative_method"]
        merged["num_speculative_tokens"] = per_rank[0]["num_speculative_tokens"]
        merged["mean_accepted_length"] = merged["spec_emitted_tokens"] / rows
        merged["mean_verify_length"] = merged["spec_draft_tokens"] / rows
        merged["draft_acceptance_rate"] = merged["spec_accepted_tokens"] / max(merged["spec_draft_tokens"], 1)
        merged["varlen_verification"] = per_rank[0]["varlen_verification"]
        positions = [r["per_position_acceptance"] for r in per_rank]
        merged["per_position_acceptance"] = [  # rank-weighted by the rows verified there
            None if all(p[i] is None for p in positions) else
            sum((p[i] or 0.0) * r["spec_verify_rows"] for p, r in zip(positions, per_rank)) / rows
            for i in range(len(positions[0]))
        ]
    return merged
