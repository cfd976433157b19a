"""Zero-overhead scheduling on vs off: decode step time and the device's idle gap between decode steps.

The worker records two timing events per step when ``Worker.step_events`` is a list: one on the stream before the
step's first device op, one with its sample-end event. For consecutive decode steps N, N+1:

- device span of N      = end(N) - start(N)   (the device's time from N's first op to its last)
- idle gap after N      = start(N+1) - end(N) (the device waiting for the host to launch N+1; ~0 when the host
                                              launched N+1 before N finished, which is what ZOS is for)
- wall step time        = wall clock of the timed window / decode steps launched (not engine.step() calls: with
                          ZOS the last call only flushes the deferred step)

Model: DeepSeek-V2-Lite shape with random bf16 weights (``load_format="dummy"``), prompt ``--prompt-len``, greedy,
``--gen`` decode steps timed. One JSON line per (batch, zos, graphs)::

    {"bench": "zos", "batch": B, "zos": true, "graphs": true, "step_ms": ..., "device_span_ms": ...,
     "idle_gap_ms_mean": ..., "idle_gap_ms_p50": ..., "idle_frac": ..., "tok_s": ..., "date": ..., "commit": ...,
     "hardware": ..., "command": ...}

GPU:  python -m benchmarks.bench_zos --backend cuda --batch 1 64 --graphs --out benchmarks/results/h200_zos.jsonl
CPU rehearsal (tiny shapes; host events, so "idle" is host time between steps):
      python -m benchmarks.bench_zos --backend cpu --tiny --batch 1 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.decode_workload import (
    TINY,
    V2_LITE,
    append_jsonl,
    prompts_for,
    release_device_memory,
    stamped_logger,
    sync,
    warmup_summary,
    write_model_dir,
)
from deepinfer_npu.benchmark_meta import row_meta


def run_config(args, model_dir: str, cfg: dict, batch: int, zos: bool, log) -> dict:
    from deepinfer_npu import LLM, SamplingParams

    max_model_len = 64 * -(-(args.prompt_len + args.gen + 8) // 64)
    llm = LLM(model_dir, load_format="dummy", backend=args.backend, dtype=args.dtype, max_model_len=max_model_len,
              max_num_seqs=batch, num_kv_blocks=batch * (max_model_len // 64) + 2,
              max_num_batched_tokens=max(4096, batch * args.prompt_len), enable_graphs=args.graphs,
              zero_overhead_scheduling=zos)
    engine = llm.llm_engine
    dev = engine.backend.device_type
    log(f"precompile: {warmup_summary(engine)}")
    worker = engine.worker
    results = {}
    for rnd in ("warm", "timed"):
        gen = 4 if rnd == "warm" else args.gen
        params = SamplingParams(max_tokens=gen + 1, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts_for(batch, args.prompt_len, cfg["vocab_size"], salt=int(rnd == "warm"))):
            engine.add_request(f"{rnd}-{i}", {"prompt_token_ids": p}, params)
        started: set[str] = set()
        while len(started) < batch:  # the whole batch's prefill
            for o in engine.step():
                if o.outputs and o.outputs[0].token_ids:
                    started.add(o.request_id)
        sync(dev)
        worker.step_events = []
        engine.stats["generation_tokens"] = 0
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        sync(dev)
        elapsed = time.perf_counter() - t0
        events, worker.step_events = worker.step_events, None
        if rnd == "warm":
            continue
        decode = [(s, e) for is_prefill, s, e in events if not is_prefill]
        spans = [s.elapsed_time(e) for s, e in decode]
        gaps = [e0.elapsed_time(s1) for (_s0, e0), (s1, _e1) in zip(decode, decode[1:], strict=False)]
        tokens = engine.stats["generation_tokens"]
        total_dev = decode[0][0].elapsed_time(decode[-1][1]) if decode else float("nan")
        results = {
            # per decode step: under ZOS the last engine.step() only post-processes (flushes) the deferred step,
            # so engine steps = decode steps + 1 there; count decode steps launched, not calls
            "step_ms": 1e3 * elapsed / max(len(decode), 1), "tok_s": tokens / elapsed, "decode_steps": len(decode),
            "engine_steps": steps,
            "device_span_ms": statistics.mean(spans) if spans else None,
            "idle_gap_ms_mean": statistics.mean(gaps) if gaps else None,
            "idle_gap_ms_p50": statistics.median(gaps) if gaps else None,
            "idle_gap_ms_max": max(gaps) if gaps else None,
            "idle_frac": (sum(max(g, 0.0) for g in gaps) / total_dev) if gaps and total_dev > 0 else None,
            "graph_steps": engine.get_stats().get("graph_steps"),
        }
    del llm, engine, worker
    release_device_memory(dev)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen", type=int, default=48, help="decode steps timed per configuration")
    p.add_argument("--graphs", action="store_true", help="decode replayed from captured graphs")
    p.add_argument("--tiny", action="store_true", help="tiny shapes with the same structure (CPU rehearsal)")
    p.add_argument("--out", default=None, help="append the JSON lines here")
    args = p.parse_args(argv)
    import torch

    cfg = TINY if args.tiny else V2_LITE
    log = stamped_logger()

    meta = row_meta("cuda" if args.backend == "cuda" else "cpu")
    tmp = write_model_dir(cfg, "bench_zos_")
    lines = []
    for batch in args.batch:
        for zos in (False, True):
            r = run_config(args, tmp, cfg, batch, zos, log)
            row = {"bench": "zos", **meta, "batch": batch, "zos": zos, "graphs": args.graphs,
                   **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()},
                   "model": "deepseek-v2-lite-shape-dummy" if not args.tiny else "tiny-v2-dummy",
                   "dtype": args.dtype, "prompt_len": args.prompt_len, "backend": args.backend,
                   "torch": torch.__version__,
                   "timing": "device timing events per step (start before the first op, end at sample end)"}
            log(f"batch={batch} zos={zos}: step {r['step_ms']:.3f} ms, device span {r['device_span_ms']:.3f} ms, "
                f"idle gap mean {r['idle_gap_ms_mean']:.3f} ms (p50 {r['idle_gap_ms_p50']:.3f})")
            print(json.dumps(row), flush=True)
            lines.append(row)
    append_jsonl(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
