"""Structured output cost through ``LLM.generate``: output tokens/s of a batch where half the requests (the one
request at concurrency 1) are constrained by a JSON schema, against the same batch unconstrained with each row
generating as many tokens as it does constrained; plus grammar compile time (cold, and a cache hit). One JSON line
per concurrency, one for compilation and one per batch size for the host's cost of a mask fill. A concurrency's
line also carries each run's steps and the host's time per step (the engine's step, its sampling launch, which
builds the masks, and its wait on the device): when steps are host-bound, the difference is what the constrained
rows cost the host.

    python -m benchmarks.bench_structured --concurrency 1 32
    python -m benchmarks.bench_structured --speculative-method mtp --num-speculative-tokens 3
"""

from __future__ import annotations

import argparse
import json
import os
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def _v2_lite_dir() -> str:
    """A model directory with DeepSeek-V2-Lite's config and the reference model's tokenizer (grammars need one)."""
    import shutil

    from benchmarks.decode_workload import V2_LITE, write_model_dir
    from deepinfer_npu.config import REFERENCE_MODEL_DIR

    path = write_model_dir(V2_LITE, "structured-v2-lite-")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REFERENCE_MODEL_DIR / name, path)
    return path


def _per_step(before: dict, after: dict) -> dict:
    """The engine steps between two snapshots of ``engine.stats`` and the host's milliseconds per step: the whole
    step, the sampling launch (masks included) and the wait on the device. With speculation a constrained run may
    take more steps (the grammar rejects drafts), which the throughput shows and the time per step does not."""
    steps = max(after["num_steps"] - before["num_steps"], 1)
    keys = {"step_ms": "step_ms", "sample_launch_ms": "sample_ms", "host_wait_ms": "host_wait_ms"}
    return {"steps": steps, **{name: round((after[key] - before[key]) / steps, 4) for name, key in keys.items()}}


def _fill_cost(pool, constraint, rows: int, calls: int = 200) -> dict:
    """Host µs (median) of filling ``rows`` rows' masks at once: xgrammar's batch call with ``max_threads="auto"``
    (it starts a pool of half the host's hardware threads on every call) against the engine's ``fill_rows``."""
    import statistics

    import xgrammar as xgr

    from deepinfer_npu.structured_output.matcher import RequestGrammar, fill_rows, new_bitmask

    compiled = pool.compile(constraint).result()
    grammars = [RequestGrammar(compiled, pool.vocab_size) for _ in range(rows)]
    bitmask, indices = new_bitmask(rows, pool.vocab_size), list(range(rows))
    auto = xgr.BatchGrammarMatcher(max_threads="auto")
    ways = {"xgrammar_auto_us": lambda: auto.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask,
                                                                             indices),
            "fill_rows_us": lambda: fill_rows(grammars, bitmask, indices)}
    out = {}
    for name, fill in ways.items():
        fill()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fill()
            times.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(times) * 1e6, 2)
    return out


def _profile(llm, prompts, runs: dict) -> None:
    """Where the host's time goes in each run (cumulative, the engine's own functions first)."""
    import cProfile
    import io
    import pstats

    for label, params in runs.items():
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(f"== host profile, {label}, {len(prompts)} requests\n{text.getvalue()}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="None: the shipped reference model")
    p.add_argument("--shape", choices=["reference", "v2-lite"], default="reference",
                   help="v2-lite: DeepSeek-V2-Lite dims with random bf16 weights and the reference tokenizer")
    p.add_argument("--backend", default="auto")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point (the best is reported)")
    p.add_argument("--speculative-method", choices=["mtp", "dflash"], default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, print the host's cProfile of one constrained and one unconstrained run")
    args = p.parse_args(argv)

    from deepinfer_npu import LLM, SamplingParams
    from deepinfer_npu.benchmark_meta import row_meta
    from deepinfer_npu.structured_output import StructuredOutputsParams
    from deepinfer_npu.structured_output.grammar import GrammarCompilerPool

    extra = {}
    if args.shape == "v2-lite":
        args.model, extra = _v2_lite_dir(), {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096}
    if args.speculative_method:
        extra.update(speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens)
    llm = LLM(args.model, backend=args.backend, max_num_seqs=max(args.concurrency), **extra)
    engine = llm.llm_engine
    meta = row_meta("cuda" if engine.backend.name == "cuda" else None)

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    t0 = time.perf_counter()
    pool = GrammarCompilerPool(engine.tokenizer, engine.vocab_size, engine._eos_ids)
    info_ms = (time.perf_counter() - t0) * 1e3
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    t0 = time.perf_counter()
    pool.compile(constraint).result()
    cold_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    pool.compile(constraint).result()
    hit_ms = (time.perf_counter() - t0) * 1e3
    emit({"bench": "structured_compile", "tokenizer_info_ms": round(info_ms, 3),
          "compile_cold_ms": round(cold_ms, 3), "compile_cached_ms": round(hit_ms, 3), **meta})
    for rows in (1, 16):
        emit({"bench": "structured_fill", "rows": rows, **_fill_cost(pool, constraint, rows),
              "host_cpus": os.cpu_count(), **meta})
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_outputs=constraint)
    llm.generate(["warm up"], constrained, use_tqdm=False)
    for conc in args.concurrency:
        prompts = [f"record {i}: " for i in range(conc)]
        mixed = [constrained if i % 2 or conc == 1 else free for i in range(conc)]  # half (all at concurrency 1)
        # A constrained row stops when its object is complete: the unconstrained run generates exactly as many
        # tokens in each row (ignore_eos), so both runs do the same work and only the constraint differs.
        lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, mixed, use_tqdm=False)]
        same_work = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        best = {"unconstrained": 0.0, "constrained": 0.0}
        per_step: dict[str, dict] = {}
        for _ in range(args.repeats):
            for label, params in (("unconstrained", same_work), ("constrained", mixed)):
                before = dict(engine.stats)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / dt
                if tok_s > best[label]:
                    best[label], per_step[label] = tok_s, _per_step(before, engine.stats)
        constrained_rows = [n for n, p in zip(lengths, mixed) if p is constrained]
        u, c = per_step["unconstrained"], per_step["constrained"]
        emit({"bench": "structured", "concurrency": conc, "max_tokens": args.max_tokens,
              "constrained_fraction": len(constrained_rows) / conc,
              "mean_constrained_tokens": round(sum(constrained_rows) / len(constrained_rows), 1),
              "unconstrained_tok_s": round(best["unconstrained"], 2),
              "constrained_tok_s": round(best["constrained"], 2),
              "throughput_ratio": round(best["constrained"] / best["unconstrained"], 4),
              **{f"unconstrained_{k}": v for k, v in u.items()}, **{f"constrained_{k}": v for k, v in c.items()},
              "extra_step_us": round((c["step_ms"] - u["step_ms"]) * 1e3, 1),
              "extra_step_us_per_row": round((c["step_ms"] - u["step_ms"]) * 1e3 / len(constrained_rows), 1),
              "backend": engine.backend.name, "shape": args.shape, "speculative_method": args.speculative_method,
              **meta})
        if args.profile:
            _profile(llm, prompts, {"unconstrained": same_work, "constrained": mixed})


if __name__ == "__main__":
    main()
