"""``python -m deepinfer_npu.run``: generate completions from the command line.

With no ``--model`` it runs the reference model shipped in the package on a few built-in Python prompts.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

from deepinfer_npu.engine_args import build_parser, engine_kwargs

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
]


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 1 every prompt was ignored; 2 bad arguments or model; 130 interrupted (Ctrl-C)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\ninterrupted before any completion finished", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(levelname)s: %(message)s", level=logging.WARNING)
    from deepinfer_npu import LLM
    from deepinfer_npu.config import REFERENCE_MODEL_DIR, EngineConfig

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
        from deepinfer_npu import vendor
        from deepinfer_npu.distributed.ep_report import ep_dispatch_report

        report, ep, libraries = backend.op_report(), ep_dispatch_report(backend), vendor.report()
        if args.json:
            print(json.dumps({"backend": backend.name, "ops": report, "expert_parallel": ep, "vendor": libraries}))
        else:
            print(f"backend: {backend.name}")
            for op, status in report.items():
                print(f"  {op:<18} {status}")
            print("expert parallel (--data-parallel-size > 1):")
            for op, status in ep.items():
                print(f"  {op:<18} {status}")
            print("optional libraries (vendor/):")
            for name, status in libraries.items():
                print(f"  {name:<18} {status}")
        return 0

    if args.model is None and not (REFERENCE_MODEL_DIR / "config.json").exists():
        return _error(f"no --model given and the reference model is not installed at {REFERENCE_MODEL_DIR}; "
                      "pass --model PATH to a DeepSeek-V2/V3 checkpoint directory")
    prompts: list = list(args.prompt or [])
    for n, ids in enumerate(args.prompt_token_ids or []):
        tokens = [t.strip() for t in ids.split(",") if t.strip()]
        bad = [t for t in tokens if not t.lstrip("-").isdigit()]
        if bad:
            return _error(f"--prompt-token-ids #{n} {ids!r}: {bad[0]!r} is not an integer "
                          "(comma-separated integer token ids)")
        prompts.append({"prompt_token_ids": [int(t) for t in tokens]})
    if not prompts:
        prompts = list(DEFAULT_PROMPTS)
    if args.speculative_method is None and args.num_speculative_tokens != 5:
        return _error("--num-speculative-tokens needs --speculative mtp|dflash")
    engine_args = engine_kwargs(args)
    try:
        config = EngineConfig(model=args.model, **engine_args)  # every option checked before the model loads
        status = run_headless_node(config)  # no prompts there: node 0's (rank 0's) front-end sends the requests
        if status is not None:
            return status
        params = _sampling_params(args, config.model_dir)
    except (ValueError, FileNotFoundError) as e:
        return _error(e)

    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, **engine_args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return _error(e)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        outputs, interrupted = _generate(llm, prompts, params, use_tqdm=not args.no_progress)
    except (ValueError, TypeError) as e:
        return _error(e)
    gen_s = time.perf_counter() - t1
    shown = [(i, o) for i, o in enumerate(outputs) if not (interrupted and o.outputs[0].finish_reason == "abort")]
    _print_completions(args, shown, outputs, llm, load_s, gen_s)
    if interrupted:
        print(f"interrupted: {len(shown)} of {len(outputs)} completions had finished (printed); "
              "the rest were aborted", file=sys.stderr)
        return 130
    if all(o.outputs[0].finish_reason == "ignored" for o in outputs):
        print(f"error: every prompt ({len(outputs)}) was ignored; nothing was generated (see the messages above)",
              file=sys.stderr)
        return 1
    return 0


def run_headless_node(config) -> int | None:
    """When this process runs no front-end (a node other than node 0, or a torchrun process other than rank 0):
    serve its ranks until the front-end shuts down and return the exit status (0 then). None: this process runs
    the front-end. Raises ``ValueError`` for torchrun variables that disagree with ``config``."""
    import os

    from deepinfer_npu.distributed.node_server import serve_node, serve_rank
    from deepinfer_npu.distributed.parallel_state import DEFAULT_MASTER_PORT
    from deepinfer_npu.distributed.rank_launch import node_ranks
    from deepinfer_npu.distributed.remote_ranks import describe_ranks
    from deepinfer_npu.distributed.torchrun import launched_by_torchrun, torchrun_config

    torchrun_rank = torchrun_config(config).rank if launched_by_torchrun() else None
    if not (config.node_rank > 0 or torchrun_rank):
        return None

    if torchrun_rank:
        where = f"DP rank {torchrun_rank} of {config.data_parallel_size} (torchrun)"
        ranks, master = f"DP rank {torchrun_rank}", f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        leader = "rank 0"
    else:
        where = f"node {config.node_rank} of {config.nnodes}"
        ranks = describe_ranks(node_ranks(config, config.node_rank))
        master, leader = f"{config.master_addr}:{config.master_port or DEFAULT_MASTER_PORT}", "node 0"
    print(f"{where}: serving {ranks} for master {master} (headless: {leader} runs the front-end)", file=sys.stderr,
          flush=True)
    try:
        code = serve_rank(config) if torchrun_rank else serve_node(config)
    except (ValueError, RuntimeError) as e:
        print(f"error: {where}: {e}", file=sys.stderr)
        return 1
    print(f"{where}: the front-end shut down; {ranks} stopped", file=sys.stderr, flush=True)
    return code


def _error(message) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _sampling_params(args, model_dir):
    """Flags the user set win; unset ones come from the model's generation_config.json (said on stderr), else
    greedy decoding."""
    from deepinfer_npu import SamplingParams
    from deepinfer_npu.engine.generation_config import GENERATION_CONFIG, load_generation_defaults

    given = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p") if getattr(args, k) is not None}
    taken = {k: v for k, v in load_generation_defaults(model_dir).items() if k not in given}
    if taken:
        used = ", ".join(f"{k}={v}" for k, v in taken.items())
        print(f"note: sampling defaults from {model_dir / GENERATION_CONFIG}: {used} "
              "(set --temperature / --top-k / --top-p to override)", file=sys.stderr)
    values = {"temperature": 0.0, **taken, **given}
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, **values)


def _generate(llm, prompts, params, use_tqdm: bool):
    """``llm.generate`` on a worker thread, so Ctrl-C reaches this thread between steps: it aborts the
    unfinished requests and returns what finished. Returns ``(outputs, interrupted)``."""
    result: dict = {}
    done = threading.Event()  # waited on instead of Thread.join, which Ctrl-C can leave inconsistent

    def work() -> None:
        try:
            result["outputs"] = llm.generate(prompts, params, use_tqdm=use_tqdm)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=work, name="generate", daemon=True).start()
    interrupted = False
    try:
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        interrupted = True
        engine = llm.llm_engine
        engine.abort_request(engine.unfinished_request_ids())
        while not done.wait(0.1):
            pass
    if "error" in result:
        raise result["error"]
    return result["outputs"], interrupted


def _print_completions(args, shown, outputs, llm, load_s: float, gen_s: float) -> None:
    """Each shown ``(index, output)``, then the summary of the whole run."""
    engine = llm.llm_engine
    n_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = {
        "requests": len(outputs), "prompt_tokens": n_prompt, "output_tokens": n_out,
        "load_s": round(load_s, 3), "generate_s": round(gen_s, 3),
        "output_tok_s": round(n_out / gen_s, 2) if gen_s > 0 else None,
        "backend": engine.backend.name, "dtype": str(engine.runner.dtype).replace("torch.", ""),
        "model": str(engine.config.model_dir),
    }
    stats = llm.get_stats()
    if args.speculative_method:
        summary.update({
            "speculative": args.speculative_method,
            "mean_accepted_length": round(stats["mean_accepted_length"], 3),
            "mean_verify_length": round(stats["mean_verify_length"], 3),
            "per_position_acceptance": [None if x is None else round(x, 3)
                                        for x in stats["per_position_acceptance"]],
            "varlen": stats["varlen_verification"],
        })
    if "moe_lb" in stats:  # expert parallelism: how evenly the routed tokens fell on the ranks
        summary["moe_lb"] = None if stats["moe_lb"] is None else round(stats["moe_lb"], 4)
        summary["moe_lb_per_layer"] = [None if x is None else round(x, 4) for x in stats["moe_lb_per_layer"]]
    if "eplb" in stats:
        e = stats["eplb"]
        summary["eplb"] = {"replans": e["replans"], "steps": e["steps"], "moved_experts": e["moved_experts"],
                           "physical_experts": e["physical_experts"],
                           **{k: None if e[k] is None else round(e[k], 3)
                              for k in ("pause_ms_mean", "pause_ms_max", "pause_ms_last")}}
    for i, out in shown:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"index": i, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                              "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                              "finish_message": c.finish_message}), flush=True)
            continue
        prompt = out.prompt if out.prompt is not None else str(out.prompt_token_ids)
        print(f"=== completion {i} ({len(c.token_ids)} tokens, finish: {c.finish_reason}) ===")
        print(prompt + c.text if out.prompt is not None else f"{prompt} -> {c.token_ids}")
        message = c.finish_message or ""
        if c.finish_reason in ("ignored", "preempted") or message.startswith("max_model_len"):
            print(f"[{message if message.startswith(c.finish_reason) else c.finish_reason + ': ' + message}]")
    if args.json:
        print(json.dumps({"summary": summary}), flush=True)
        return
    print(
        f"--- {summary['requests']} requests, {n_prompt} prompt + {n_out} output tokens in "
        f"{gen_s:.2f} s ({summary['output_tok_s']} tok/s output), load {load_s:.2f} s, "
        f"backend {summary['backend']} ({summary['dtype']}), model {summary['model']}", flush=True
    )
    kv_report = getattr(getattr(llm.llm_engine, "runner", None), "kv_cache_report", lambda: None)()
    if kv_report:
        print(f"--- {kv_report}", flush=True)
    if "moe_lb" in summary:
        line = f"--- expert parallel: moe_lb {summary['moe_lb']} (slowest rank's routed tokens / mean; per layer " \
               f"{summary['moe_lb_per_layer']})"
        if "eplb" in summary:
            e = summary["eplb"]
            line += (f"; EPLB {e['physical_experts']} expert slots, {e['replans']} re-plans in {e['steps']} steps, "
                     f"pause mean {e['pause_ms_mean']} ms / max {e['pause_ms_max']} ms, {e['moved_experts']} "
                     "experts moved")
        print(line, flush=True)
    if args.speculative_method:
        print(
            f"--- speculative {args.speculative_method}: {summary['mean_accepted_length']} tokens per verify step "
            f"(bonus included), {summary['mean_verify_length']} drafts verified per request-step, "
            f"per-position acceptance {summary['per_position_acceptance']}, varlen {summary['varlen']}", flush=True
        )


if __name__ == "__main__":
    sys.exit(main())
