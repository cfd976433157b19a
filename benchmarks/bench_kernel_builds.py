"""Where a cold start's kernel warm-up goes: each TileLang configuration an engine compiles at start-up, built and
timed on its own, and what that means for the warm-up's parallel build. No GPU is needed (nvcc and TileLang are).

The configurations are the ones ``CudaKernelSet.warmup`` reaches for the engine's ``KernelWarmupPlan``: the plan is
built by the worker's own ``build_kernel_warmup_plan`` from the model's modules (the model is built on the meta
device at two layers: the plan needs its shapes, not its depth), with the decode graphs the engine captures. Each
configuration is built as a warm-up worker builds it (``backends/cuda/warmup._fill_one``) into an empty TileLang
cache, one after another in one child process. From those seconds the benchmark replays the warm-up's schedule
(``fill_disk_cache``: the jobs in its order, each claimed by the next worker to free up) for a few worker counts, in
the queue's order and in its earlier one (the MLA kernels first, the rest in compile order).
One JSON line per configuration and one per worker count::

    {"bench": "kernel_build", "module": "mla_decode", "config": "...", "build_s": x, ...}
    {"bench": "kernel_build_schedule", "order": "longest_expected_first", "workers": 15, "makespan_s": y, ...}

``makespan_s`` leaves out each worker's start (importing torch and TileLang: ``worker_start_s``, measured here) and
the serial pass that loads the built kernels; it is this machine's CPU, not the GPU host's.

python -m benchmarks.bench_kernel_builds --max-num-seqs 256 --out benchmarks/results/cpu_kernel_builds.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

from benchmarks.decode_workload import SHAPES, append_jsonl
from deepinfer_npu.benchmark_meta import row_meta

RESULT_MARK = "KERNEL_BUILD "
#: what the child runs: each (module, config) built into the (empty) TileLang cache it was given, timed
CHILD = r"""
import ast, json, sys, time
t0 = time.perf_counter()
from deepinfer_npu.backends.cuda.warmup import _fill_one
import tilelang  # a worker's start: the first build must not pay for it
print("KERNEL_BUILD " + json.dumps({"start_s": time.perf_counter() - t0}), flush=True)
softmax_scale, jobs = ast.literal_eval(sys.argv[1])
for name, cfg in jobs:
    t = time.perf_counter()
    try:
        _fill_one(name, cfg, softmax_scale)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).strip()[:200]}"
    print("KERNEL_BUILD " + json.dumps({"module": name, "config": repr(cfg), "build_s": time.perf_counter() - t,
                                        "error": error}), flush=True)
"""


def warmup_plan(shape: str, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int | None,
                block_size: int, graphs: bool):
    """The engine's ``KernelWarmupPlan`` for ``shape`` and these settings (no speculation), as the worker builds it."""
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.hal.registry import backend_class
    from deepinfer_npu.hal.graph_sizes import graph_sizes
    from deepinfer_npu.model_executor import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from deepinfer_npu.model_executor.model_config import DeepseekModelConfig
    from deepinfer_npu.worker.decode_graphs import graph_table_width
    from deepinfer_npu.worker.kernel_warmup import build_kernel_warmup_plan

    raw, _name = SHAPES[shape]
    mc = DeepseekModelConfig.from_dict(dict(raw, num_hidden_layers=min(2, raw["num_hidden_layers"])), source=shape)
    cls = DeepseekV3ForCausalLM if raw["model_type"] == "deepseek_v3" else DeepseekV2ForCausalLM
    model = cls(mc, SimpleNamespace(device=torch.device("meta"), kernels=CudaKernelSet()), dtype=torch.bfloat16)
    mnbt = max_num_batched_tokens or backend_class("cuda").default_max_num_batched_tokens
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_prompts=0, max_num_batched_tokens=mnbt,
                             speculative_method=None, quantization=None, kv_cache_dtype="auto")
    runner = SimpleNamespace(config=config, model_config=mc, model=model, dtype=torch.bfloat16,
                             block_size=block_size, max_model_len=max_model_len)
    decode_graphs = None
    if graphs:  # worker._build_graphs: total_q up to min(step tokens, max_num_seqs) at k = 0
        sizes = graph_sizes(min(mnbt, max_num_seqs))
        decode_graphs = SimpleNamespace(sizes=sizes, width=graph_table_width(max_model_len, block_size))
    return build_kernel_warmup_plan(runner, k=0, varlen=False, graphs=decode_graphs)


def reachable(plan, num_sms: int, sm90: bool) -> dict[str, list[tuple]]:
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.backends.cuda.ops import OpConfig
    from deepinfer_npu.backends.cuda.warmup import reachable_configs

    ks = CudaKernelSet()
    ks.num_sms = num_sms
    ks.select(OpConfig.from_plan(plan, sm90, frozenset()))
    return reachable_configs(ks, plan, num_sms)


def build_all(jobs: list[tuple[str, tuple]], softmax_scale: float, timeout_s: float) -> tuple[float, list[dict]]:
    """Build ``jobs`` one after another in a child process with empty TileLang / engine caches -> (the child's
    import seconds, a row per job)."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-kernel-builds-") as tmp:
        env = dict(os.environ, TILELANG_CACHE_DIR=os.path.join(tmp, "tilelang"),
                   DEEPINFER_CACHE_DIR=os.path.join(tmp, "engine"))
        proc = subprocess.run([sys.executable, "-c", CHILD, repr((softmax_scale, jobs))], env=env, text=True,
                              capture_output=True, timeout=timeout_s)
    rows = [json.loads(ln[len(RESULT_MARK):]) for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode or not rows:
        raise RuntimeError(f"the build child exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return rows[0]["start_s"], rows[1:]


def schedule(durations: list[float], workers: int) -> tuple[float, int]:
    """The warm-up's claim queue replayed: jobs in list order, each to the worker that frees up first ->
    (makespan, index of the job that ends last)."""
    free = [(0.0, w) for w in range(workers)]
    end, last = 0.0, -1
    for i, d in enumerate(durations):
        t, w = heapq.heappop(free)
        heapq.heappush(free, (t + d, w))
        if t + d >= end:
            end, last = t + d, i
    return end, last


def mla_first_order(configs: dict[str, list[tuple]]) -> list[tuple[str, tuple]]:
    """The queue's earlier order, for comparison: the MLA kernels first, the rest in compile order (``configs`` is
    ``reachable``'s, in compile order)."""
    jobs = [(name, cfg) for name, cfgs in configs.items() for cfg in cfgs]
    return sorted(jobs, key=lambda job: job[0] != "mla_decode")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v2-lite")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the CUDA backend's")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--num-sms", type=int, default=132, help="the GPU's SM count (132: H100 / H200)")
    ap.add_argument("--no-sm90", action="store_true", help="the selection of a GPU before Hopper")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 15])
    ap.add_argument("--limit", type=int, default=0, help="build only the first N configurations (0: all)")
    ap.add_argument("--timeout", type=float, default=7200.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from deepinfer_npu.backends.cuda.ops.base import tilelang_importable
    from deepinfer_npu.backends.cuda.warmup import warmup_job_order

    if not tilelang_importable():
        raise SystemExit("bench_kernel_builds needs tilelang (pip install tilelang) and nvcc")
    plan = warmup_plan(args.shape, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                       graphs=not args.no_graphs)
    configs = reachable(plan, args.num_sms, not args.no_sm90)
    jobs = warmup_job_order(configs)
    if args.limit:
        jobs = jobs[:args.limit]
    print(f"building {len(jobs)} configurations one at a time ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    start_s, built = build_all(jobs, float(plan.softmax_scale), args.timeout)
    meta = dict(row_meta("cpu"), shape=args.shape, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=plan.max_num_batched_tokens, num_sms=args.num_sms, sm90=not args.no_sm90,
                graphs=not args.no_graphs)
    rows = [dict(bench="kernel_build", **r, **meta) for r in built]
    seconds = {(r["module"], r["config"]): r["build_s"] for r in built}
    durations = list(seconds.values())
    orders = {"longest_expected_first": jobs, "mla_first": [job for job in mla_first_order(configs) if job in jobs]}
    for order, queue in orders.items():
        for w in args.workers:
            queue_s = [seconds[(name, repr(cfg))] for name, cfg in queue]
            makespan, last = schedule(queue_s, w)
            rows.append(dict(bench="kernel_build_schedule", order=order, workers=w, configs=len(jobs),
                             makespan_s=round(makespan, 2), critical_job=f"{queue[last][0]} {queue[last][1]!r}",
                             sum_s=round(sum(durations), 2), longest_s=round(max(durations), 2),
                             worker_start_s=round(start_s, 2), errors=sum(r["error"] is not None for r in built),
                             **meta))
    for r in rows:
        print(json.dumps(r), flush=True)
    print(f"built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
