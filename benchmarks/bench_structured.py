"""Structured output cost through ``LLM.generate``: output tokens/s of a batch where half the requests (the one
request at concurrency 1) are constrained by a JSON schema, against the same batch unconstrained; plus grammar compile
time (cold, and a cache hit). One JSON line per concurrency, and one for compilation.

    python -m benchmarks.bench_structured --concurrency 1 32
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="None: the shipped reference model")
    p.add_argument("--backend", default="auto")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point (the best is reported)")
    args = p.parse_args(argv)

    from deepinfer_npu import LLM, SamplingParams
    from deepinfer_npu.benchmark_meta import row_meta
    from deepinfer_npu.structured_output import StructuredOutputsParams
    from deepinfer_npu.structured_output.grammar import GrammarCompilerPool

    meta = row_meta(None)
    llm = LLM(args.model, backend=args.backend, max_num_seqs=max(args.concurrency))
    engine = llm.llm_engine
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
    print(json.dumps({"bench": "structured_compile", "tokenizer_info_ms": round(info_ms, 3),
                      "compile_cold_ms": round(cold_ms, 3), "compile_cached_ms": round(hit_ms, 3), **meta}))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # A constrained row stops when its object is complete, so the comparison is per token (tokens/s).
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                 structured_outputs=constraint)
    llm.generate(["warm up"], constrained, use_tqdm=False)
    for conc in args.concurrency:
        prompts = [f"record {i}: " for i in range(conc)]
        rates = {}
        mixed = [constrained if i % 2 or conc == 1 else free for i in range(conc)]  # half (all at concurrency 1)
        for label, params in (("unconstrained", [free] * conc), ("constrained", mixed)):
            best = 0.0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                best = max(best, tokens / dt)
            rates[label] = (best,)
        ratio = rates["constrained"][0] / rates["unconstrained"][0]
        print(json.dumps({"bench": "structured", "concurrency": conc, "max_tokens": args.max_tokens,
                          "constrained_fraction": 1.0 if conc == 1 else 0.5,
                          "unconstrained_tok_s": round(rates["unconstrained"][0], 2),
                          "constrained_tok_s": round(rates["constrained"][0], 2),
                          "throughput_ratio": round(ratio, 4), "backend": engine.backend.name, **meta}))


if __name__ == "__main__":
    main()
