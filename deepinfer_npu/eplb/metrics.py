"""moe_lb: how unevenly the routed tokens fall on the expert-parallel ranks (the slowest rank's tokens / the mean).

Each rank reports, per MoE layer, the tokens its expert slots received since the placement was installed; the
front-end merges the ranks' reports (``merge_ep_stats``) into ``get_stats()``.
"""

from __future__ import annotations


def moe_lb(rank_tokens: list[float]) -> float | None:
    """max / mean of the ranks' token counts; None before any token."""
    total = sum(rank_tokens)
    return None if total <= 0 else max(rank_tokens) * len(rank_tokens) / total


def mean_lb(per_layer: list[float | None]) -> float | None:
    known = [x for x in per_layer if x is not None]
    return sum(known) / len(known) if known else None


def merge_ep_stats(per_rank: list[dict]) -> dict:
    """The ranks' ``expert_parallel`` reports -> ``moe_lb`` per layer and its mean, the balancer's counters."""
    reports = [r["expert_parallel"] for r in per_rank]
    layers = len(reports[0]["rank_tokens"])
    per_layer = [moe_lb([rep["rank_tokens"][layer] for rep in reports]) for layer in range(layers)]
    merged = {"moe_lb": mean_lb(per_layer), "moe_lb_per_layer": per_layer,
              "moe_tokens_per_rank": [sum(rep["rank_tokens"]) for rep in reports]}
    if "eplb" in reports[0]:
        eplb = [rep["eplb"] for rep in reports]
        pauses = [max(p) for p in zip(*(e["pause_ms"] for e in eplb))]  # a re-plan lasts as long as its slowest rank
        history = [dict(h, pause_ms=p) for h, p in zip(eplb[0]["history"], pauses[-len(eplb[0]["history"]):])] \
            if eplb[0]["history"] else []
        merged["eplb"] = {
            "replans": eplb[0]["replans"], "steps": eplb[0]["steps"],
            "redundant_experts": eplb[0]["redundant_experts"], "physical_experts": eplb[0]["physical_experts"],
            "moved_experts": eplb[0]["moved_experts"],
            "pause_ms_last": pauses[-1] if pauses else None, "pause_ms_max": max(pauses) if pauses else None,
            "pause_ms_mean": sum(pauses) / len(pauses) if pauses else None,
            "history": history,
        }
    return merged
