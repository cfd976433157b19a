"""``python -m deepinfer_npu.run``: generate completions from the command line.

With no ``--model`` it runs the reference model shipped in the package on a few built-in Python prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deepinfer_npu.run", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (HF layout); default: the shipped reference model")
    p.add_argument("--backend", default="auto", help="auto | cpu | cuda | ascend (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--prompt-token-ids", action="append", default=None,
                   help="comma-separated token ids (repeatable), for models without a tokenizer")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--no-zos", action="store_true", help="disable zero-overhead scheduling")
    p.add_argument("--speculative", choices=["mtp", "dflash"], default=None,
                   help="speculative decoding with the model's MTP layer or the DFlash drafter")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps from captured graphs (default: the backend's choice, on for cuda); "
                   "--no-graphs forces eager decode")
    p.add_argument("--kernel-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every kernel variant the engine can reach at start-up (default; cuda: TileLang); "
                   "--no-kernel-warmup compiles each at its first use")
    p.add_argument("--no-varlen", action="store_true", help="verify a fixed number of drafts per request")
    p.add_argument("--speculative-model", default=None, help="DFlash drafter directory (default <model>/dflash)")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion, then a summary")
    p.add_argument("--list-ops", action="store_true", help="print the backend's op report (native / fallback)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from deepinfer_npu import LLM, SamplingParams
    from deepinfer_npu.config import REFERENCE_MODEL_DIR

    if args.list_ops:
        from deepinfer_npu.hal.registry import get_backend

        try:
            backend = get_backend(args.backend)
            model_dir = args.model or (REFERENCE_MODEL_DIR if (REFERENCE_MODEL_DIR / "config.json").exists() else None)
            if model_dir is not None:  # decide the model-dependent ops for this model, as its first forward would
                import torch

                from deepinfer_npu.model_executor.model_config import DeepseekModelConfig

                cfg = DeepseekModelConfig.from_pretrained(model_dir)
                dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
                    args.dtype, torch.float32 if backend.device_type == "cpu" else torch.bfloat16)
                backend.kernels.plan_for_model(cfg, dtype, 64)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        report = backend.op_report()
        if args.json:
            print(json.dumps({"backend": backend.name, "ops": report}))
        else:
            print(f"backend: {backend.name}")
            for op, status in report.items():
                print(f"  {op:<18} {status}")
        return 0

    if args.model is None and not (REFERENCE_MODEL_DIR / "config.json").exists():
        print(
            f"error: no --model given and the reference model is not installed at {REFERENCE_MODEL_DIR}; "
            "pass --model PATH to a DeepSeek-V2/V3 checkpoint directory",
            file=sys.stderr,
        )
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts: list = []
    for text in args.prompt or []:
        prompts.append(text)
    for ids in args.prompt_token_ids or []:
        try:
            prompts.append({"prompt_token_ids": [int(t) for t in ids.split(",") if t.strip()]})
        except ValueError:
            print(f"error: --prompt-token-ids takes comma-separated integers, got {ids!r}", file=sys.stderr)
            return 2
    if args.speculative is None and args.num_speculative_tokens != 5:
        print("note: --num-speculative-tokens has no effect without --speculative", file=sys.stderr)
    if not prompts:
        prompts = list(DEFAULT_PROMPTS)

    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, backend=args.backend, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, seed=args.seed,
                  zero_overhead_scheduling=not args.no_zos, speculative_method=args.speculative,
                  num_speculative_tokens=args.num_speculative_tokens, varlen_verification=not args.no_varlen,
                  speculative_model=args.speculative_model, enable_graphs=args.graphs,
                  kernel_warmup=args.kernel_warmup)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gen_s = time.perf_counter() - t1

    n_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = {
        "requests": len(outputs), "prompt_tokens": n_prompt, "output_tokens": n_out,
        "load_s": round(load_s, 3), "generate_s": round(gen_s, 3),
        "output_tok_s": round(n_out / gen_s, 2) if gen_s > 0 else None,
        "backend": llm.llm_engine.backend.name, "dtype": str(llm.llm_engine.runner.dtype).replace("torch.", ""),
        "model": str(llm.llm_engine.config.model_dir),
    }
    stats = llm.get_stats()
    if args.speculative:
        summary.update({
            "speculative": args.speculative,
            "mean_accepted_length": round(stats["mean_accepted_length"], 3),
            "mean_verify_length": round(stats["mean_verify_length"], 3),
            "per_position_acceptance": [None if x is None else round(x, 3)
                                        for x in stats["per_position_acceptance"]],
            "varlen": stats["varlen_verification"],
        })
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"index": i, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                              "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                              "finish_message": getattr(c, "finish_message", None)}))
        else:
            prompt = out.prompt if out.prompt is not None else str(out.prompt_token_ids)
            print(f"=== completion {i} ({len(c.token_ids)} tokens, finish: {c.finish_reason}) ===")
            print(prompt + c.text if out.prompt is not None else f"{prompt} -> {c.token_ids}")
            if c.finish_reason in ("ignored", "preempted") and getattr(c, "finish_message", None):
                message = c.finish_message
                print(f"[{message if message.startswith(c.finish_reason) else c.finish_reason + ': ' + message}]")
    if args.json:
        print(json.dumps({"summary": summary}))
    else:
        print(
            f"--- {summary['requests']} requests, {n_prompt} prompt + {n_out} output tokens in "
            f"{gen_s:.2f} s ({summary['output_tok_s']} tok/s output), load {load_s:.2f} s, "
            f"backend {summary['backend']} ({summary['dtype']}), model {summary['model']}"
        )
        if args.speculative:
            print(
                f"--- speculative {args.speculative}: {summary['mean_accepted_length']} tokens per verify step "
                f"(bonus included), {summary['mean_verify_length']} drafts verified per request-step, "
                f"per-position acceptance {summary['per_position_acceptance']}, varlen {summary['varlen']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
