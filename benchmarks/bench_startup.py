"""Start-up as users see it: seconds from ``LLM(...)`` until it accepts requests, on a fresh machine and again with
warm caches, and the first request's latency after that.

Each run is a new Python process (nothing in memory carries over). ``cold``: empty TileLang and engine cache
directories (a fresh machine's state for the kernels; Python packages stay installed). ``warm``: the same
directories again, now filled by the cold run. A run times ``import deepinfer_npu``, ``LLM(...)`` (weights, kernel
warm-up, graph capture, everything the constructor does) and one short greedy request; the engine's own warm-up
summary (configurations and their seconds) comes along. One JSON line per run::

    {"bench": "startup", "run": "cold", "ready_s": x, "import_s": y, "first_request_s": z, "kernel_warmup": "...",
     "kernel_warmup_s": w, "background_build_s": b, "background_done_after_ready_s": d, "token_ids": [...],
     "date": ..., "commit": ..., "hardware": ..., "command": ...}

``first_request_builds``: ``[kernel, seconds]`` of every TileLang build in the run's own process during its first
request (a configuration the start-up warm-up did not build, which that request waits for; empty when the warm-up
covered it; None without TileLang).
``background_build_s``: the wall time of the fallback-only kernels' build, which starts when the warm-up ends and
which the engine does not wait for (``backends/cuda/warmup_background.py``); ``background_done_after_ready_s``:
when it ended, counted from ready (the run waits for it after its request, so the warm run finds it cached).
None where nothing was built in the background.

A run after the first also says whether its greedy tokens equal the first run's (``same_tokens_as_first_run``:
kernels loaded from the caches compute what the freshly built ones did). Each run logs at INFO; the row counts the
lines (``log_lines``) and names any line written more than once (``repeated_log_lines``).

GPU:  python -m benchmarks.bench_startup --backend cuda --out benchmarks/results/h200_startup.jsonl
CPU rehearsal (tiny shapes):  python -m benchmarks.bench_startup --backend cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.decode_workload import TINY, V2_LITE, append_jsonl, write_model_dir
from deepinfer_npu.benchmark_meta import row_meta

#: what one run executes in its own process; prints one JSON line (RESULT_MARK + dict)
RESULT_MARK = "STARTUP_RESULT "
CHILD = r"""
import json, logging, sys, time
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO, stream=sys.stderr)
t0 = time.perf_counter()
import deepinfer_npu
from deepinfer_npu import LLM, SamplingParams
t_import = time.perf_counter()
kw = json.loads(sys.argv[1])
llm = LLM(**kw)
t_ready = time.perf_counter()
late = []  # kernels TileLang builds in this process after ready: the first request waits for them
try:
    import tilelang
    _build = tilelang.compile
    def _name(func):
        try:
            return str(func.attrs.get("global_symbol", "?"))
        except Exception:  # the record must never break a build
            return type(func).__name__
    def _timed_build(func, *a, **k):
        t = time.perf_counter()
        kernel = _build(func, *a, **k)
        late.append([_name(func), round(time.perf_counter() - t, 2)])
        return kernel
    tilelang.compile = _timed_build
except ImportError:
    late = None
t_asked = time.perf_counter()  # tilelang's import (a CPU run's) is not the request's
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}],
                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
t_first = time.perf_counter()
from deepinfer_npu.backends.cuda import warmup_background
background = warmup_background.wait(1200)  # the fallback-only kernels, built after start-up
worker = llm.llm_engine.worker
print("STARTUP_RESULT " + json.dumps({
    "import_s": t_import - t0, "ready_s": t_ready - t_import, "first_request_s": t_first - t_asked,
    "background_build_s": background[0] if background else None,
    "background_done_after_ready_s": background[1] - t_ready if background else None,
    "first_request_builds": late,
    "tokens": len(out[0].outputs[0].token_ids), "token_ids": list(out[0].outputs[0].token_ids),
    "kernel_warmup": getattr(worker, "kernel_warmup", None),
    "graphs": worker.graphs is not None}), flush=True)
"""


def warmup_seconds(summary: str | None) -> float | None:
    """The seconds of the kernel warm-up summary ("N configs in X s (...)"), or None."""
    m = re.search(r"configs in ([0-9.]+) s", summary or "")
    return float(m.group(1)) if m else None


def log_repeats(stderr: str) -> dict:
    """How many log lines a start-up wrote (INFO and up, with warnings and library messages) and which of them came
    more than once: ``{"log_lines": n, "repeated_log_lines": [[line, count], ...]}`` (every message should come
    once)."""
    counts: dict[str, int] = {}
    for line in stderr.splitlines():
        if line.strip():
            counts[line] = counts.get(line, 0) + 1
    repeated = sorted(([line[:200], n] for line, n in counts.items() if n > 1), key=lambda t: -t[1])
    return {"log_lines": sum(counts.values()), "repeated_log_lines": repeated}


def run_once(engine_kwargs: dict, cache_dir: str, timeout_s: float) -> dict:
    """One start-up in a new process with the TileLang and engine caches under ``cache_dir``."""
    env = dict(os.environ, TILELANG_CACHE_DIR=os.path.join(cache_dir, "tilelang"),
               DEEPINFER_CACHE_DIR=os.path.join(cache_dir, "deepinfer"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(engine_kwargs)], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"start-up run failed (exit {proc.returncode}):\n" + "\n".join(tail))
    result = json.loads(lines[-1][len(RESULT_MARK):])
    result["process_s"] = wall
    result.update(log_repeats(proc.stderr))
    result["kernel_warmup_s"] = warmup_seconds(result.get("kernel_warmup"))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes with the same structure (CPU rehearsal)")
    p.add_argument("--max-model-len", type=int, default=None, help="default 4096 (512 with --tiny)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"],
                   help="cold: empty cache directories; warm: the directories the earlier runs filled")
    p.add_argument("--cache-dir", default=None, help="where the runs keep their caches (default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--out", default=None, help="append the JSON lines here")
    args = p.parse_args(argv)

    cfg = TINY if args.tiny else V2_LITE
    model_dir = write_model_dir(cfg, "bench_startup_")
    engine_kwargs = dict(model=model_dir, load_format="dummy", backend=args.backend, dtype=args.dtype,
                         max_model_len=args.max_model_len or (512 if args.tiny else 4096),
                         max_num_seqs=args.max_num_seqs)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="bench_startup_cache_")
    meta = row_meta("cuda" if args.backend == "cuda" else "cpu")
    rows = []
    for run in args.runs:
        if run == "cold" and os.listdir(cache_dir):
            cache_dir = tempfile.mkdtemp(prefix="bench_startup_cache_")  # a cold run starts from empty caches
        result = run_once(engine_kwargs, cache_dir, args.timeout)
        if rows:  # kernels loaded from the caches give the greedy tokens of the ones built for the first run
            result["same_tokens_as_first_run"] = result["token_ids"] == rows[0]["token_ids"]
        row = {"bench": "startup", "run": run, **{k: round(v, 3) if isinstance(v, float) else v
                                                  for k, v in result.items()},
               "model": "deepseek-v2-lite-shape-dummy" if not args.tiny else "tiny-v2-dummy",
               "engine": {k: v for k, v in engine_kwargs.items() if k != "model"}, **meta}
        rows.append(row)
        print(json.dumps(row), flush=True)
    append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
