"""Where a decode step's time goes: device kernels by name (torch.profiler), kernels per step, kernel time vs wall.

DeepSeek-V2-Lite shape, random bf16 weights, prompt ``--prompt-len``, greedy; ``--steps`` decode steps profiled
after a warm-up, at each ``--batch``, eager or from captured graphs (``--graphs``). One JSON line per batch::

    {"bench": "profile_decode", "batch": B, "graphs": g, "wall_ms_per_step": w, "kernel_ms_per_step": k,
     "kernels_per_step": n, "top": [[name, ms_per_step, calls_per_step], ...], "date": ..., "commit": ...,
     "hardware": ..., "command": ...}

``--host-steps N`` adds, per batch, N more steps timed without any profiler (``clean_wall_ms_per_step``) and N
under cProfile: the engine's Python functions by own time and by inclusive time, microseconds a step
(``host_functions_self`` / ``host_functions_cum``), i.e. where the host's side of a host-bound step goes.

GPU:  python -m benchmarks.profile_decode --backend cuda --batch 1 64 --graphs
CPU rehearsal:  python -m benchmarks.profile_decode --backend cpu --tiny --batch 2
"""

from __future__ import annotations

import argparse
import cProfile
import json
import time

from benchmarks.decode_workload import (TINY, V2_LITE, pdl_enabled, pdl_off, prompts_for, sync, warmup_summary,
                                       write_model_dir)
from benchmarks.profiling import host_ops, kernel_events, python_functions, totals_by_name
from deepinfer_npu.benchmark_meta import row_meta


def host_functions(engine, steps: int, top: int) -> dict:
    """``steps`` engine steps without a profiler, then ``steps`` under cProfile -> clean wall ms a step and the
    top functions by own and inclusive time (us a step)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    clean = time.perf_counter() - t0
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    return {"host_steps": steps, "clean_wall_ms_per_step": round(1e3 * clean / steps, 3),
            **python_functions(prof, steps, top)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--graphs", action="store_true")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--zos", type=int, default=1)
    p.add_argument("--sequence", type=int, default=0, help="also list the first N kernels in time order")
    p.add_argument("--quantization", default=None, help="e.g. fp8: the weights quantized at load")
    p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8: the packed FP8 latent cache")
    p.add_argument("--host-steps", type=int, default=0,
                   help="also N steps unprofiled and N under cProfile: the host's Python functions (0: off)")
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from deepinfer_npu import LLM, SamplingParams

    cfg = TINY if args.tiny else V2_LITE
    tmp = write_model_dir(cfg, "profile_decode_")
    decode_steps = 3 * args.steps + 2 * args.host_steps  # warm-up, profiled, host windows
    max_model_len = 64 * -(-(args.prompt_len + decode_steps + 16) // 64)
    llm = LLM(tmp, load_format="dummy", backend=args.backend, dtype=args.dtype, max_model_len=max_model_len,
              max_num_seqs=max(args.batch), num_kv_blocks=max(args.batch) * (max_model_len // 64) + 2,
              max_num_batched_tokens=max(4096, max(args.batch) * args.prompt_len), enable_graphs=args.graphs,
              zero_overhead_scheduling=bool(args.zos), quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    dev = engine.backend.device_type
    print("precompile:", warmup_summary(engine), flush=True)
    meta = row_meta(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    for batch in args.batch:
        params = SamplingParams(max_tokens=decode_steps + 8, temperature=0.0, ignore_eos=True)
        for i, pr in enumerate(prompts_for(batch, args.prompt_len, cfg["vocab_size"], salt=batch)):
            engine.add_request(f"p{batch}-{i}", {"prompt_token_ids": pr}, params)
        started: set[str] = set()
        while len(started) < batch:
            for o in engine.step():
                if o.outputs and o.outputs[0].token_ids:
                    started.add(o.request_id)
        for _ in range(args.steps):  # warm-up decode (graph capture, kernel compiles)
            engine.step()
        sync(dev)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            sync(dev)
            wall = time.perf_counter() - t0
        host = host_functions(engine, args.host_steps, args.top) if args.host_steps else {}
        while engine.has_unfinished_requests():
            engine.step()
        kernels = kernel_events(prof, dev)
        total, count = sum(us for _t, _n, us in kernels), len(kernels)
        top = totals_by_name(kernels)[: args.top]
        cpu_top = host_ops(prof, 15)
        row = {"bench": "profile_decode", **meta, "batch": batch, "graphs": args.graphs,
               "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
               "zos": bool(args.zos), "steps": args.steps, "wall_ms_per_step": round(1e3 * wall / args.steps, 3),
               "kernel_ms_per_step": round(total / 1e3 / args.steps, 3),
               "kernels_per_step": round(count / args.steps, 1),
               # kernels_cuda/_pdl.py: with PDL a kernel is placed early and waits, so its span includes the wait
               "pdl": pdl_enabled(), "pdl_off": pdl_off(),
               "sequence": [[n[:70], round(us, 2)] for _t, n, us in kernels[: args.sequence]],
               "top": [[n[:90], round(us / 1e3 / args.steps, 4), round(calls / args.steps, 1)]
                       for n, us, calls in top],
               "cpu_self_top": [[k[:60], round(t / 1e3 / args.steps, 3), round(c / args.steps, 1)]
                                for k, t, c in cpu_top], **host}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
