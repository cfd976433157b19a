"""Offline CPU benchmark: prefill and decode tokens/s, and the share of step time spent outside the model forward.

Runs the engine on a small DeepSeek-V3 config with random weights (``load_format="dummy"``), or on ``--model``.
Prints JSON lines::

    {"bench": "offline", "phase": "prefill"|"decode", "tok_s": ..., "step_ms": ..., "model_ms": ...,
     "outside_model_frac": ..., "date": ..., "commit": ..., "hardware": ..., "command": ..., ...}

``outside_model_frac`` = 1 - (time in the model forward + logits) / (whole engine step time): scheduling, input
preparation, sampling / verification and post-processing.

Run:  python -m benchmarks.bench_offline [--backend cpu] [--batch 1 8 32]
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.decode_workload import write_model_dir
from deepinfer_npu.benchmark_meta import row_meta

SMALL_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 4096,
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 96, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "torch_dtype": "float32",
    "bos_token_id": 0, "eos_token_id": 1,
}


def run(args) -> None:
    from deepinfer_npu import LLM, SamplingParams

    model, load_format = args.model, "auto"
    if model is None:
        model, load_format = write_model_dir(SMALL_V3, "bench_offline_"), "dummy"
    llm = LLM(model, load_format=load_format, backend=args.backend, max_model_len=args.prompt_len + args.gen + 8,
              max_num_seqs=max(args.batch), max_num_batched_tokens=max(args.batch) * args.prompt_len)
    engine = llm.llm_engine
    vocab = engine.vocab_size
    meta = row_meta(engine.backend.device_type)
    for batch in args.batch:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * b) % (vocab - 3) + 3 for i in range(args.prompt_len)]}
                   for b in range(batch)]
        params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
        for phase in ("prefill", "decode"):
            for k in ("forward_ms", "sample_ms", "model_ms", "step_ms", "num_steps", "prompt_tokens",
                      "generation_tokens"):
                engine.stats[k] = 0 if isinstance(engine.stats[k], int) else 0.0
            t0 = time.perf_counter()
            if phase == "prefill":
                for i, p in enumerate(prompts):
                    engine.add_request(f"b{batch}-{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
                while engine.has_unfinished_requests():
                    engine.step()
                tokens = engine.stats["prompt_tokens"]
            else:
                for i, p in enumerate(prompts):
                    engine.add_request(f"d{batch}-{i}", p, params)
                # Let the prefill happen first, then time pure decode steps.
                while engine.stats["generation_tokens"] < batch:
                    engine.step()
                for k in ("forward_ms", "sample_ms", "model_ms", "step_ms", "num_steps", "generation_tokens"):
                    engine.stats[k] = 0 if isinstance(engine.stats[k], int) else 0.0
                t0 = time.perf_counter()
                while engine.has_unfinished_requests():
                    engine.step()
                tokens = engine.stats["generation_tokens"]
            elapsed = time.perf_counter() - t0
            steps = engine.stats["num_steps"] or 1
            model_ms = engine.stats.get("model_ms", 0.0)
            step_ms = engine.stats["step_ms"]
            print(json.dumps({
                "bench": "offline", "phase": phase, "batch": batch, "prompt_len": args.prompt_len,
                "tokens": tokens, "tok_s": round(tokens / elapsed, 1), "steps": steps,
                "step_ms": round(step_ms / steps, 3), "model_ms": round(model_ms / steps, 3),
                "outside_model_frac": round(1.0 - model_ms / step_ms, 4) if step_ms else None,
                "backend": engine.backend.name, **meta,
                "model": "small-v3-dummy" if args.model is None else args.model,
            }), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=32)
    run(p.parse_args())


if __name__ == "__main__":
    main()
