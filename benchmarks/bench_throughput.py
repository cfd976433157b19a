"""Offline throughput through ``LLM.generate``: prefill, a mixed workload and vLLM's DeepSeek-V2-Lite workload.

DeepSeek-V2-Lite shape with random bf16 weights (``load_format="dummy"``), random prompt token ids (seeded),
``ignore_eos``, greedy. Workloads (``--workload``):

- ``prefill``: ``--num-prompts`` prompts of 128-2048 tokens, ``max_tokens=1`` (prompt tokens/s against the
  tensor-core roofline: the model's FLOPs over a bf16 GEMM's TFLOP/s measured in this run);
- ``mix``: the same prompt lengths, outputs of 64-512 tokens (req/s, total tokens/s);
- ``vllm``: vLLM's published DeepSeek-V2-Lite throughput workload: 200 prompts of 1000 tokens, 100 out.

The model FLOPs of a token: 2 x (the attention projections with kv_b decompressed, the dense MLP or the router,
the shared and top-k routed experts) + 2 x heads x (qk + v head dims) a layer for each position it attends to
(causal), and 2 x hidden x vocabulary for each token whose logits are computed (the last prompt token and every
output).
One JSON line per workload::

    {"bench": "throughput", "workload": ..., "req_s": ..., "prompt_tok_s": ..., "output_tok_s": ...,
     "total_tok_s": ..., "model_tflops": ..., "frac_of_tensor_core_roofline": ..., "gemm_tflops": ..., ...}

The peer: transformers' DeepseekV2ForCausalLM at the same shape prefills the first ``--peer-prompts`` prompts of
the prefill workload, one a forward, before the engine starts; the prefill row carries its rate and
``over_peer_flop_rate`` (model FLOP rates, as the peer ran fewer prompts).

``--profile``: the first ``--profile-prompts`` prompts of each workload once more under torch.profiler; a row
``throughput_profile`` names the kernels that took the device's time.

GPU:  python -m benchmarks.bench_throughput --backend cuda --workload prefill mix vllm
CPU rehearsal:  python -m benchmarks.bench_throughput --backend cpu --tiny --num-prompts 8
"""

from __future__ import annotations

import argparse
import cProfile
import json
import random
import time

from benchmarks.decode_workload import (
    TINY,
    V2_LITE,
    append_jsonl,
    mla_projection_params,
    release_device_memory,
    stamped_logger,
    sync,
    warmup_summary,
    write_model_dir,
)
from benchmarks.profiling import host_ops, kernel_events, python_functions, totals_by_name
from deepinfer_npu.benchmark_meta import row_meta


def workload(name: str, num_prompts: int, vocab: int, seed: int, tiny: bool) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per request."""
    rng = random.Random(seed)
    scale = 16 if tiny else 1  # tiny: the same shape of mix at 1/16 of the lengths
    if name == "vllm":
        lens = [(1000 // scale, 100 // scale)] * (num_prompts or 200)
    else:
        n = num_prompts or 512
        lens = [(rng.randint(128 // scale, 2048 // scale), 1 if name == "prefill" else rng.randint(64 // scale,
                                                                                                   512 // scale))
                for _ in range(n)]
    return [([rng.randrange(3, vocab) for _ in range(p)], o) for p, o in lens]


def token_flops(cfg: dict) -> tuple[float, float, float]:
    """(FLOPs of a token's linear layers, FLOPs per attended position of a token, FLOPs of one token's logits)."""
    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    layers, dense_layers = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    e, k, mi = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    attn = sum(mla_projection_params(cfg).values())
    moe = e * d + 3 * d * mi * (cfg["n_shared_experts"] + k)
    linear = layers * attn + dense_layers * 3 * d * cfg["intermediate_size"] + (layers - dense_layers) * moe
    per_position = layers * 2 * h * (nope + rope + v)  # q.k over N + R dims and p.v over V, 2 FLOPs a product
    return 2.0 * linear, float(per_position), 2.0 * d * cfg["vocab_size"]


def request_flops(cfg: dict, prompt: int, output: int) -> float:
    """Model FLOPs to prefill ``prompt`` tokens and decode ``output`` - 1 more (causal attention, lm_head rows)."""
    linear, per_pos, logits = token_flops(cfg)
    tokens = prompt + output - 1
    attended = tokens * (tokens + 1) / 2  # token i attends to positions 0..i
    return linear * tokens + per_pos * attended + logits * output


def gemm_tflops(device: str) -> float:
    """A bf16 8192^3 GEMM's TFLOP/s on this device (median of timed runs); the tensor-core roofline."""
    import torch

    n = 8192 if device == "cuda" else 512
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10 if device == "cuda" else 3):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        sync(device)
        times.append((time.perf_counter() - t0) / 5)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def peer_prefill(cfg: dict, dtype: str, device: str, reqs, log) -> dict | None:
    """transformers (DeepseekV2ForCausalLM, the same shape, random weights) prefilling ``reqs``' prompts one at a
    time (no padding, logits of the last position only): prompt tok/s and model TFLOP/s, or None without it."""
    try:
        import torch

        from benchmarks.bench_decode_e2e import build_hf_model

        model = build_hf_model(cfg, dtype, device)
    except Exception as e:  # noqa: BLE001 - the engine's rows still come
        log(f"transformers peer unavailable: {type(e).__name__}: {e}")
        return None
    ids = [torch.tensor([p], device=device) for p, _ in reqs]
    with torch.inference_mode():
        model(ids[0], logits_to_keep=1)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        for x in ids:
            model(x, logits_to_keep=1)
        sync(device)
        elapsed = time.perf_counter() - t0
    del model
    release_device_memory(device)
    tokens = sum(len(p) for p, _ in reqs)
    flops = sum(request_flops(cfg, len(p), 1) for p, _ in reqs)
    log(f"transformers: {len(reqs)} prompts, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s)")
    return {"peer": "transformers DeepseekV2ForCausalLM, one prompt a forward (logits_to_keep=1)",
            "peer_prompts": len(reqs), "peer_prompt_tok_s": round(tokens / elapsed, 1),
            "peer_model_tflops": float(f"{flops / elapsed / 1e12:.4g}")}


def profile_rows(llm, reqs, params_of, device: str, top: int) -> dict:
    """Device time by kernel name over one ``generate`` of ``reqs`` (CPU: operator self time), and the host's
    operators by self time; then the same ``generate`` again under cProfile: the host's Python functions by own and
    inclusive time (us a step of that run)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [params_of(o) for _, o in reqs], use_tqdm=False)
        sync(device)
        wall = time.perf_counter() - t0
    events = kernel_events(prof, device, cpu_ops=True)
    total = sum(us for _t, _n, us in events)
    stats, steps0 = llm.llm_engine.stats, llm.llm_engine.stats["num_steps"]
    py = cProfile.Profile()
    py.enable()
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [params_of(o) for _, o in reqs], use_tqdm=False)
    sync(device)
    py.disable()
    steps = max(stats["num_steps"] - steps0, 1)
    return {"wall_s": round(wall, 3), "kernel_s": round(total / 1e6, 3), "host_profile_steps": steps,
            **python_functions(py, steps, top),
            "top": [[n[:90], round(us / 1e6, 4), calls, round(us / max(total, 1e-9), 4)]
                    for n, us, calls in totals_by_name(events)[:top]],
            # the host's side: operators and runtime calls by self time (syncs show up here)
            "host_top": [[n[:70], round(us / 1e6, 4), calls] for n, us, calls in host_ops(prof, top)]}


def step_kinds(kinds: list[str], runs: int = 40) -> str:
    """Run-length code of step kinds: ["P", "P", "D"] -> "P2 D1"; past ``runs`` runs, the rest as "... (N more)"."""
    coded: list[str] = []
    for kind in kinds:
        if coded and coded[-1][0] == kind:
            coded[-1] = (kind, coded[-1][1] + 1)
        else:
            coded.append((kind, 1))
    text = " ".join(f"{k}{n}" for k, n in coded[:runs])
    return text + (f" ... ({len(coded) - runs} more runs)" if len(coded) > runs else "")


def run_engine(args, cfg: dict, mnbt: int | None, max_num_seqs: int, capture: str, peer: dict | None, meta: dict,
               peak: float, log, first: dict[str, float]) -> list[dict]:
    """One engine (``max_num_batched_tokens=mnbt``, None: the engine's default; ``max_num_seqs``; decode graphs
    captured ``capture`` = "lazy" | "startup") through every workload -> rows."""
    from deepinfer_npu import LLM, SamplingParams

    device = "cuda" if args.backend == "cuda" else "cpu"
    extra = {} if mnbt is None else {"max_num_batched_tokens": mnbt}
    t0 = time.perf_counter()
    llm = LLM(write_model_dir(cfg, "bench_throughput_"), load_format="dummy", backend=args.backend, dtype=args.dtype,
              max_model_len=args.max_model_len, max_num_seqs=max_num_seqs, enable_graphs=bool(args.graphs),
              seed=args.seed, graph_capture=capture, **extra)
    engine = llm.llm_engine
    ready_s = time.perf_counter() - t0
    kinds: list[str] = []  # each step's kind, "P" (a prefill step: chunks, maybe with decodes) or "D", in order
    run_plan = engine._run_plan

    def recording_run_plan(plan):
        kinds.append("P" if plan.is_prefill else "D")
        return run_plan(plan)

    engine._run_plan = recording_run_plan
    graphs = engine.worker.graphs
    at_start = (len(graphs.graphs.static_out), round(graphs.capture_s, 3)) if graphs is not None else (0, 0.0)
    log(f"engine ready in {ready_s:.1f}s (decode graphs captured at start-up: "
        f"{len(graphs.graphs.static_out) if graphs is not None else 0}, "
        f"{graphs.capture_s if graphs is not None else 0.0:.2f}s); " + warmup_summary(engine))
    cfg_engine = engine.config

    def params_of(out_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)

    # warm-up: every prefill and decode shape class once (kernel configurations compiled lazily, cuBLAS plans)
    # (twice the engine's requests, at most 512: every batch size class, without a long warm-up at 1024)
    warm = workload("mix", min(2 * max_num_seqs, 512) if not args.tiny else 8, cfg["vocab_size"], args.seed + 1,
                    args.tiny)
    llm.generate([{"prompt_token_ids": p} for p, _ in warm], [params_of(min(o, 16)) for _, o in warm], use_tqdm=False)
    rows = []
    for name in args.workload:
        reqs = workload(name, args.num_prompts, cfg["vocab_size"], args.seed, args.tiny)
        for k in ("num_steps", "prefill_steps", "decode_steps", "prompt_tokens", "generation_tokens"):
            engine.stats[k] = 0
        for k in ("forward_ms", "model_ms", "step_ms", "host_wait_ms"):
            engine.stats[k] = 0.0
        kinds.clear()
        graphs = engine.worker.graphs
        capture_s0 = graphs.capture_s if graphs is not None else 0.0
        captured0 = len(graphs.graphs.static_out) if graphs is not None else 0
        sync(device)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [params_of(o) for _, o in reqs],
                            use_tqdm=False)
        sync(device)
        elapsed = time.perf_counter() - t0
        prompt_toks = sum(len(p) for p, _ in reqs)
        out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
        expected = sum(o for _, o in reqs)
        flops = sum(request_flops(cfg, len(p), o) for p, o in reqs)
        s = engine.stats
        row = {"bench": "throughput", **meta, "workload": name, "requests": len(reqs),
               "prompt_tokens": prompt_toks, "output_tokens": out_toks, "all_outputs_complete": out_toks == expected,
               "elapsed_s": round(elapsed, 3), "req_s": round(len(reqs) / elapsed, 2),
               "prompt_tok_s": round(prompt_toks / elapsed, 1), "output_tok_s": round(out_toks / elapsed, 1),
               "total_tok_s": round((prompt_toks + out_toks) / elapsed, 1),
               "model_tflops": round(flops / elapsed / 1e12, 2), "gemm_tflops": round(peak, 1),
               "frac_of_tensor_core_roofline": round(flops / elapsed / 1e12 / peak, 4),
               "steps": s["num_steps"], "prefill_steps": s["prefill_steps"], "decode_steps": s["decode_steps"],
               # the order of the steps' kinds, run-length coded ("P13 D99": 13 prefill steps, then 99 decode steps)
               "step_kinds": step_kinds(kinds),
               "host_wait_frac": round(s["host_wait_ms"] / (1e3 * elapsed), 3),
               # wall ms a step, and the host's busy ms a step (engine.step less its wait on the device's results,
               # launches included): a host-bound run has host_step_ms close to step_ms and host_wait_frac near 0
               "step_ms": round(1e3 * elapsed / max(s["num_steps"], 1), 2),
               "host_step_ms": round((s["step_ms"] - s["host_wait_ms"]) / max(s["num_steps"], 1), 2),
               "model": "tiny-v2-dummy" if args.tiny else "deepseek-v2-lite-shape-dummy", "dtype": args.dtype,
               "max_num_seqs": cfg_engine.max_num_seqs, "max_num_batched_tokens": cfg_engine.max_num_batched_tokens,
               "max_model_len": args.max_model_len, "graphs": bool(args.graphs), "backend": args.backend,
               # decode graphs captured inside the timed run, and the host seconds that took
               "graph_capture": capture, "engine_ready_s": round(ready_s, 2),
               "graphs_captured_at_start": at_start[0], "graph_capture_s_at_start": at_start[1],
               "graphs_captured_in_run": (len(graphs.graphs.static_out) - captured0) if graphs is not None else 0,
               "graph_capture_s_in_run": round(graphs.capture_s - capture_s0, 3) if graphs is not None else 0.0,
               "flops": "2 x linear (kv_b decompressed) + 2 x heads x (qk + v dims) a layer per attended position + "
                        "2 x hidden x vocab per logits row"}
        first.setdefault(name, row["req_s"])
        row["over_first_engine"] = round(row["req_s"] / first[name], 4)
        if name == "prefill" and peer is not None:  # the FLOP rates compare: the peer ran the first prompts only
            row.update(peer, over_peer_flop_rate=round(flops / elapsed / 1e12 / peer["peer_model_tflops"], 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
        append_jsonl(args.out, [row])  # as measured: a run stopped by a time limit keeps its finished rows
        log(f"{name} (max_num_batched_tokens {cfg_engine.max_num_batched_tokens}, max_num_seqs "
            f"{cfg_engine.max_num_seqs}, graphs {capture}: {row['graphs_captured_in_run']} captured in the run, "
            f"{row['graph_capture_s_in_run']}s): {len(reqs)} requests in "
            f"{elapsed:.2f}s = {row['req_s']} req/s, prompt "
            f"{row['prompt_tok_s']} tok/s, output {row['output_tok_s']} tok/s, "
            f"{row['frac_of_tensor_core_roofline']:.3f} of {peak:.0f} TFLOP/s; host {row['host_step_ms']} of "
            f"{row['step_ms']} ms a step")
        if args.profile:
            prof = profile_rows(llm, reqs[: args.profile_prompts], params_of, device, args.top)
            prow = {"bench": "throughput_profile", **meta, "workload": name, "requests": args.profile_prompts,
                    "max_num_batched_tokens": cfg_engine.max_num_batched_tokens, **prof}
            rows.append(prow)
            print(json.dumps(prow), flush=True)
            append_jsonl(args.out, [prow])
    del llm, engine
    release_device_memory(device)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workload", nargs="+", default=["prefill", "mix", "vllm"], choices=["prefill", "mix", "vllm"])
    p.add_argument("--num-prompts", type=int, default=0, help="0: each workload's own count (512, 512, 200)")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[256],
                   help="one engine each (after each --max-num-batched-tokens value), side by side in this run")
    p.add_argument("--max-num-batched-tokens", type=int, nargs="*", default=None,
                   help="one engine each, in this order, side by side in this run (rows carry their req/s over the "
                   "first's); none given: the engine's default")
    p.add_argument("--graph-capture", nargs="+", default=["auto"], choices=["auto", "lazy", "startup"],
                   help="EngineConfig.graph_capture; one engine each (innermost), side by side in this run")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--graphs", type=int, default=1, help="decode from captured graphs (1) or eagerly (0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="tiny shapes with the same structure (CPU rehearsal)")
    p.add_argument("--peer-prompts", type=int, default=16,
                   help="prefill: transformers on this many of the prompts first (0: no peer)")
    p.add_argument("--profile", action="store_true", help="also profile the first --profile-prompts of each")
    p.add_argument("--profile-prompts", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="append the JSON lines here")
    args = p.parse_args(argv)

    cfg = TINY if args.tiny else V2_LITE
    device = "cuda" if args.backend == "cuda" else "cpu"
    log = stamped_logger()

    meta = row_meta(device)
    peak = gemm_tflops(device)
    log(f"hardware: {meta['hardware']}; bf16 GEMM {peak:.1f} TFLOP/s")
    peer = None
    if "prefill" in args.workload and args.peer_prompts:  # before the engine holds the device's memory
        prefill_reqs = workload("prefill", args.num_prompts, cfg["vocab_size"], args.seed, args.tiny)
        peer = peer_prefill(cfg, args.dtype, device, prefill_reqs[: args.peer_prompts], log)
    rows: list[dict] = []
    first: dict[str, float] = {}  # workload -> the first engine's req/s (the others' rows carry their ratio)
    for mnbt in args.max_num_batched_tokens or [None]:
        for max_num_seqs in args.max_num_seqs:
            for capture in args.graph_capture:
                rows += run_engine(args, cfg, mnbt, max_num_seqs, capture, peer, meta, peak, log, first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
