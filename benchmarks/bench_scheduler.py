"""Scheduler step cost: schedule() + update() per decode step in steady state (CPU only, no model).

Prints one JSON line per configuration:
    {"bench": "scheduler", "running": N, "nextn": k, "varlen": bool, "us_per_step": x, "us_schedule": y, ...,
     "date": ..., "commit": ..., "hardware": ..., "command": ...}

Run: python -m benchmarks.bench_scheduler [--steps-scale 1.0]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from deepinfer_npu import _core as C
from deepinfer_npu.benchmark_meta import row_meta


def run(n: int, nextn: int, varlen: bool, steps: int, warmup: int, prompt_len: int = 512) -> dict:
    block_size = 64
    max_len = prompt_len + (steps + warmup + 2) * (nextn + 1)  # every sequence keeps running to the end
    max_model_len = (max_len // block_size + 2) * block_size
    per_seq = max_model_len // block_size + 1
    cfg = C.SchedulerConfig(
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n * (nextn + 1)),
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=n * per_seq + 1,
        nextn=nextn,
        prefill_attempt_interval=10**9,
        prefill_any_attempt_interval=10**9,
    )
    s = C.Scheduler(cfg)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32000, prompt_len).astype(np.int32)
    for i in range(n):
        s.add_seq(i, prompt, 10**6)
    while s.num_waiting:  # prefill everything
        out = s.schedule(True)
        s.update(
            out.seq_ids, out.is_last_chunk.astype(np.int32), np.ones(int(out.is_last_chunk.sum()), np.int32)
        )
    if varlen:
        from deepinfer_npu.hal.graph_sizes import graph_sizes

        sizes = graph_sizes(cfg.max_num_batched_tokens)
        s.configure_varlen(sizes, [10.0 + 0.002 * g for g in sizes])
        s.set_runtime_estimates(0.0005, 0.5)
    ids_all = np.arange(n, dtype=np.int64)
    probs = rng.uniform(0.3, 1.0, size=(n, max(nextn, 1))).astype(np.float32)
    accept = rng.integers(0, nextn + 1, size=4096 + n).astype(np.int32)
    tokens = np.ones((nextn + 1) * n, dtype=np.int32)
    t_sched = 0.0
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            t0 = time.perf_counter()
            t_sched = 0.0
        if varlen:
            s.set_draft_probs(ids_all, probs)
        a = time.perf_counter()
        out = s.schedule(False)
        t_sched += time.perf_counter() - a
        if nextn:
            drafts = out.num_drafts
            off = step % 4096
            counts = np.minimum(drafts, accept[off : off + len(drafts)]) + 1
        else:
            counts = np.ones(out.num_seqs, dtype=np.int32)
        s.update(out.seq_ids, counts, tokens[: int(counts.sum())])
    total = time.perf_counter() - t0
    assert out.num_seqs == n, (out.num_seqs, n)
    s.check_invariants()
    return {
        "bench": "scheduler",
        "running": n,
        "nextn": nextn,
        "varlen": varlen,
        "us_per_step": round(total / steps * 1e6, 2),
        "us_schedule": round(t_sched / steps * 1e6, 2),
        "tokens_per_step": int(out.num_tokens),
        "steps": steps,
        **row_meta(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply the number of measured steps")
    args = ap.parse_args()
    for n in (64, 256, 1024):
        steps = max(50, int(args.steps_scale * 2_000_000 / n))
        print(json.dumps(run(n, 0, False, steps, warmup=50)), flush=True)
    for n in (64, 256, 1024):
        steps = max(50, int(args.steps_scale * 1_000_000 / n))
        print(json.dumps(run(n, 5, True, steps, warmup=50)), flush=True)


if __name__ == "__main__":
    main()
