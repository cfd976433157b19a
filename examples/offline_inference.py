"""Offline inference with the vLLM-style API: batch generation, sampling, speculative decoding, step-level engine.

    python -m examples.offline_inference                 # the shipped reference model on the CPU backend
    python -m examples.offline_inference --model DIR --backend cuda --speculative mtp
"""

from __future__ import annotations

import argparse

from deepinfer_npu import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--backend", default="auto")
    p.add_argument("--speculative", choices=["mtp", "dflash"], default=None)
    args = p.parse_args()

    llm = LLM(args.model, backend=args.backend, speculative_method=args.speculative)
    prompts = ["def quicksort(items):\n", "class LRUCache:\n    def __init__(self, capacity):\n"]

    # Greedy and seeded sampling in one batch.
    params = [SamplingParams(max_tokens=48, temperature=0.0),
              SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=7, logprobs=2)]
    for out in llm.generate(prompts, params):
        c = out.outputs[0]
        print(f"--- {out.request_id}: {len(c.token_ids)} tokens, finish={c.finish_reason}")
        print(out.prompt + c.text)
    if args.speculative:
        s = llm.get_stats()
        print(f"mean accepted length {s['mean_accepted_length']:.2f}, per position {s['per_position_acceptance']}")

    # Step-level engine: stream tokens of one request, abort another mid-flight.
    engine = llm.llm_engine
    engine.add_request("stream", "import json\n\n\ndef load(path):\n", SamplingParams(max_tokens=32, temperature=0))
    engine.add_request("aborted", "while True:\n", SamplingParams(max_tokens=64, temperature=0))
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "stream" and not out.finished:
                print(f"[step {steps}] {len(out.outputs[0].token_ids)} tokens so far")
            if out.finished:
                print(f"{out.request_id} finished: {out.outputs[0].finish_reason}")
        steps += 1
        if steps == 3:
            engine.abort_request("aborted")


if __name__ == "__main__":
    main()
