"""The command-line flags of the engine, shared by ``python -m deepinfer_npu.run`` and ``python -m
deepinfer_npu.serve``: ``build_parser`` (engine flags carry ``EngineConfig`` field names as ``dest``) and
``engine_kwargs`` (the parsed flags as ``LLM`` / ``EngineConfig`` keyword arguments)."""

from __future__ import annotations

import argparse
import dataclasses

RUN_DESCRIPTION = "generate completions from the command line"


def build_parser(prog: str = "python -m deepinfer_npu.run", description: str | None = None,
                 engine_only: bool = False) -> argparse.ArgumentParser:
    """Engine flags carry ``EngineConfig`` field names as ``dest`` so they pass to ``LLM`` unchanged.
    ``engine_only``: just the model and engine flags (``--seed`` included), for other entry points (serve)."""
    p = argparse.ArgumentParser(prog=prog, description=description or RUN_DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--model", default=None, help="model directory (HF layout); None: the shipped reference model")
    add("--backend", default="auto", help="auto | cpu | cuda | ascend")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="model dtype")
    add("--load-format", dest="load_format", default="auto", choices=["auto", "dummy", "dummy_portable"],
        help="auto: safetensors; dummy: random weights from config.json")
    add("--quantization", default=None, choices=["fp8", "w8a8"],
        help="fp8: FP8 block-scaled weights (kept from an FP8 checkpoint or quantised at load); w8a8: INT8 "
        "per-channel weights quantised at load; None: the checkpoint's precision (FP8 dequantised)")
    add("--kv-cache-dtype", dest="kv_cache_dtype", default="auto", choices=["auto", "fp8"],
        help="latent KV cache: auto (the model dtype) or fp8 (e4m3 latents with per-128 scales, RoPE part in bf16: "
        "656 bytes a token for DeepSeek-V3 instead of 1152; cpu and cuda backends)")
    if engine_only:
        add("--seed", type=int, default=0, help="engine seed (requests without a seed draw theirs from it)")
    else:
        add("--prompt", action="append", default=None, help="prompt text (repeatable); None: built-in prompts")
        add("--prompt-token-ids", action="append", default=None,
            help="comma-separated token ids (repeatable), for models without a tokenizer")

        s = p.add_argument_group("sampling (None: the model's generation_config.json, else greedy)")
        s.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt")
        s.add_argument("--temperature", type=float, default=None, help="0: greedy")
        s.add_argument("--top-k", type=int, default=None, help="0: off")
        s.add_argument("--top-p", type=float, default=None, help="1: off")
        s.add_argument("--seed", type=int, default=0, help="engine seed and every request's sampling seed")

    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None, help="None: the model's max_position_embeddings")
    e.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in a step")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in a step; default: the backend's (16384 on CUDA, else 4096)")
    e.add_argument("--max-num-prompts", type=int, default=0, help="most prompts in a prefill step; 0: max-num-seqs")
    e.add_argument("--prefill-max-sum-seqlen-k", type=int, default=0,
                   help="most attended tokens in a prefill step; 0: unlimited")
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split prompts longer than --max-num-batched-tokens over several steps")
    e.add_argument("--prefill-attempt-interval", type=int, default=70,
                   help="decode steps between prefill attempts that every rank must want")
    e.add_argument("--prefill-any-attempt-interval", type=int, default=100,
                   help="decode steps between prefill attempts that any rank may trigger")
    pre = e.add_mutually_exclusive_group()
    pre.add_argument("--stop-preempted", dest="stop_preempted_request", action="store_true", default=True,
                     help="a request preempted for lack of KV blocks finishes (finish_reason 'preempted')")
    pre.add_argument("--recompute-preempted", dest="stop_preempted_request", action="store_false",
                     help="a preempted request waits and is recomputed from its prompt and outputs")
    e.add_argument("--zos", dest="zero_overhead_scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="zero-overhead scheduling: schedule step N+1 while step N runs")

    m = p.add_argument_group("memory")
    m.add_argument("--block-size", type=int, default=64, help="tokens per KV cache block")
    m.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks; None: sized from --kv-cache-memory-bytes (cpu) or "
                   "--gpu-memory-utilization (devices)")
    m.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30, help="KV cache size on the cpu backend")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="fraction of free device memory the KV cache may take")
    m.add_argument("--state-slot-ratio", type=float, default=1.2, help="state slots per --max-num-seqs")

    d = p.add_argument_group("speculative decoding and graphs")
    d.add_argument("--speculative", dest="speculative_method", choices=["mtp", "dflash"], default=None,
                   help="draft with the model's MTP layer or the DFlash drafter")
    d.add_argument("--num-speculative-tokens", type=int, default=5,
                   help="drafts per request and step (needs --speculative)")
    d.add_argument("--speculative-model", default=None,
                   help="DFlash drafter directory (needs --speculative dflash); None: <model>/dflash")
    d.add_argument("--varlen", dest="varlen_verification", action=argparse.BooleanOptionalAction, default=True,
                   help="verify a confidence-chosen number of drafts per request (--no-varlen: all of them)")
    d.add_argument("--graphs", dest="enable_graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps from captured graphs; None: the backend's choice (on for cuda)")
    d.add_argument("--graph-capture", choices=["auto", "lazy", "startup"], default="auto",
                   help="capture each graph size at its first step (lazy), all at start-up (startup), or all at "
                        "start-up when there are at most 48 sizes (auto: up to 360 decode tokens a step)")
    d.add_argument("--kernel-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every kernel variant the engine can reach at start-up (cuda: TileLang)")

    dp = p.add_argument_group("multi-device")
    dp.add_argument("--data-parallel-size", type=int, default=1,
                    help="data-parallel ranks in all (every node runs data-parallel-size / nnodes): one process "
                    "and one device each")
    dp.add_argument("--expert-parallel", dest="enable_expert_parallel", action=argparse.BooleanOptionalAction,
                    default=True, help="shard the routed experts over the data-parallel ranks")
    dp.add_argument("--enable-eplb", action=argparse.BooleanOptionalAction, default=False,
                    help="expert-parallel load balancing: replicas of hot experts, re-placed while serving "
                    "(docs/eplb.md)")
    dp.add_argument("--eplb-preset", choices=["decode", "prefill"], default="decode",
                    help="EPLB settings: decode = 1 redundant expert per rank, window 1000, re-plan every 10000 "
                    "steps; prefill = 4, 100, 1000")
    dp.add_argument("--eplb-redundant-experts-per-rank", type=int, default=None, help="override the preset's")
    dp.add_argument("--eplb-window-size", type=int, default=None, help="override the preset's (model steps)")
    dp.add_argument("--eplb-rebalance-interval", type=int, default=None, help="override the preset's (model steps)")
    dp.add_argument("--moe-routing-skew", type=float, default=0.0,
                    help="test hook, expert parallelism only: lower expert e's router logit by skew * ln(1 + e) "
                    "(Zipf-like load; changes the outputs)")
    dp.add_argument("--distributed-timeout", dest="distributed_timeout_s", type=float, default=300.0,
                    help="seconds any wait across rank processes may take before the run stops naming the rank")
    dp.add_argument("--nnodes", type=int, default=1, help="nodes of the deployment (torchrun's --nnodes)")
    dp.add_argument("--node-rank", type=int, default=0,
                    help="this node's rank; 0 runs the front-end, the others serve their ranks headless until node "
                    "0 shuts down")
    dp.add_argument("--master-addr", default=None,
                    help="address of node 0, which hosts the rendezvous (needed when --nnodes > 1); None: 127.0.0.1")
    dp.add_argument("--master-port", type=int, default=None,
                    help="rendezvous port on node 0; None: 29500 with --nnodes > 1, a free port on one node")

    if engine_only:
        return p
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object per completion, then a summary")
    o.add_argument("--list-ops", action="store_true", help="print the backend's op report (native / fallback)")
    o.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields among parsed flags (all but ``model``)."""
    from deepinfer_npu.config import EngineConfig

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name != "model" and hasattr(args, f.name)}
    kwargs["eplb_config"] = _eplb_config(args)
    return kwargs


def _eplb_config(args: argparse.Namespace):
    """The EPLB flags as an ``EPLBConfig`` (None: no EPLB flag given); EngineConfig refuses one without
    --enable-eplb."""
    from deepinfer_npu.config import EPLBConfig

    overrides = {name: getattr(args, "eplb_" + name, None)
                 for name in ("redundant_experts_per_rank", "window_size", "rebalance_interval")}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not getattr(args, "enable_eplb", False) and not overrides:
        return None
    preset = EPLBConfig.prefill() if getattr(args, "eplb_preset", "decode") == "prefill" else EPLBConfig.decode()
    return dataclasses.replace(preset, **overrides)
