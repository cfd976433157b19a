"""Expert-parallel load balancing over time: moe_lb (the slowest rank's routed tokens / the mean) with and without
EPLB on a skewed workload, the pause of every re-plan, and whether the tokens changed.

Runs the engine twice on ``--world`` data-parallel ranks with expert parallelism (gloo on the CPU), the routing
skewed towards the low-numbered experts (``moe_routing_skew``: router logit of expert e lowered by skew * ln(1 + e),
the same in both runs): once without EPLB (contiguous placement), once with it. The workload is ``--phases``
batches of ``--requests`` greedy requests. Prints JSON lines:

- ``phase``: after each batch, moe_lb since the last re-plan (since the start without EPLB), re-plans so far;
- ``replan``: each re-plan of the EPLB run: the model step, moe_lb measured over its window (under the placement
  then in force), the policy's predicted moe_lb for the new placement, experts moved, the pause (slowest rank);
- ``summary``: moe_lb without EPLB, measured moe_lb with EPLB after the first re-plan (mean over the later
  windows), pauses, and whether every token of every request is the same in both runs (fp32 greedy).

    python -m benchmarks.bench_eplb --world 4 --skew 1.0 --redundant-per-rank 1 --window 40 --interval 40
"""

from __future__ import annotations

import argparse
import json
import time

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.benchmark_meta import row_meta
from deepinfer_npu.config import EPLBConfig


def _prompts(phase: int, n: int) -> list[str]:
    return [f"# task {phase}.{i}\ndef solve_{i}(values):\n" for i in range(n)]


def _run(args, eplb: bool, meta: dict) -> tuple[list[list[int]], dict, list[dict]]:
    options = dict(data_parallel_size=args.world, distributed_timeout_s=300, max_num_seqs=args.requests,
                   moe_routing_skew=args.skew, dtype="float32", model=args.model)
    if eplb:
        options.update(enable_eplb=True, eplb_config=EPLBConfig(
            redundant_experts_per_rank=args.redundant_per_rank, window_size=args.window,
            rebalance_interval=args.interval))
    start = time.perf_counter()
    llm = LLM(**options)
    load_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tokens, rows = [], []
    try:
        for phase in range(args.phases):
            start = time.perf_counter()
            outs = llm.generate(_prompts(phase, args.requests), params, use_tqdm=False)
            gen_s = time.perf_counter() - start
            tokens += [o.outputs[0].token_ids for o in outs]
            stats = llm.get_stats()
            ep = stats.get("eplb", {})
            rows.append({"kind": "phase", "eplb": eplb, "phase": phase, "steps": stats["num_steps"],
                         "moe_lb": _round(stats["moe_lb"]), "moe_lb_per_layer": [_round(x) for x in
                                                                               stats["moe_lb_per_layer"]],
                         "replans": ep.get("replans", 0), "generate_s": round(gen_s, 3), "load_s": round(load_s, 3),
                         **meta})
    finally:
        llm.llm_engine.shutdown()
    return tokens, stats, rows


def _round(x):
    return None if x is None else round(x, 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory; None: the reference model")
    p.add_argument("--world", type=int, default=4, help="data-parallel = expert-parallel ranks")
    p.add_argument("--skew", type=float, default=1.0, help="moe_routing_skew of both runs")
    p.add_argument("--redundant-per-rank", type=int, default=1)
    p.add_argument("--window", type=int, default=40, help="EPLB window, model steps")
    p.add_argument("--interval", type=int, default=40, help="EPLB re-plan interval, model steps")
    p.add_argument("--requests", type=int, default=32, help="requests per batch")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--phases", type=int, default=4, help="batches, one after the other")
    args = p.parse_args(argv)
    meta = row_meta("cpu")
    base_tokens, base_stats, rows = _run(args, False, meta)
    eplb_tokens, stats, eplb_rows = _run(args, True, meta)
    for row in rows + eplb_rows:
        print(json.dumps(row), flush=True)
    history = stats["eplb"]["history"]
    for h in history:
        print(json.dumps({"kind": "replan", **{k: _round(v) if isinstance(v, float) else v for k, v in h.items()},
                          **meta}), flush=True)
    later = [h["window_moe_lb"] for h in history[1:] if h["window_moe_lb"] is not None]
    print(json.dumps({
        "kind": "summary", "world": args.world, "skew": args.skew, "redundant_per_rank": args.redundant_per_rank,
        "physical_experts": stats["eplb"]["physical_experts"], "window": args.window, "interval": args.interval,
        "steps": stats["eplb"]["steps"], "replans": stats["eplb"]["replans"],
        "moe_lb_without_eplb": _round(base_stats["moe_lb"]),
        "moe_lb_with_eplb": _round(sum(later) / len(later)) if later else None,
        "moe_lb_with_eplb_last_window": _round(later[-1]) if later else None,
        "moe_lb_since_last_replan": _round(stats["moe_lb"]),
        "pause_ms_mean": _round(stats["eplb"]["pause_ms_mean"]), "pause_ms_max": _round(stats["eplb"]["pause_ms_max"]),
        "moved_experts": stats["eplb"]["moved_experts"], "tokens_identical": eplb_tokens == base_tokens,
        "requests": len(base_tokens), **meta}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
