"""End-to-end decode on a DeepSeek shape: the engine vs Hugging Face transformers vs the roofline.

``--shape``: ``v2-lite`` (DeepSeek-V2-Lite, the default), ``v3-4l`` (DeepSeek-V3's dims at 4 layers, 1 dense +
3 MoE; transformers is left out there: its random init of 37 B parameters takes longer than the engine's run) or
``tiny`` (the same structure as v2-lite at tiny sizes, the CPU rehearsal; ``--tiny`` says the same).

Random bf16 weights (the engine's ``load_format="dummy"``; transformers' own init), prompt ``--prompt-len``,
greedy, ``--gen`` decode tokens per request timed after the prefill, at each ``--batch`` (``--repeat`` windows,
the median reported). Both sides are timed
decode-only the same way: wall clock over the decode steps, device synchronised at both ends (the engine: steps
after the first token; transformers: ``generate`` with 1 + N new tokens minus ``generate`` with 1).

Roofline: bytes that must move per decode step / the device-to-device copy bandwidth measured in this run
(bytes read + written). Bytes per step = attention weights of every layer + the dense MLP + router and shared
experts + the routed experts expected to be hit at that batch (E * (1 - (1 - k/E)^B), uniform routing) + lm_head
+ the latent KV cache read (B * context * 576 values per layer at the mean context of the timed window), in the
weights' dtype (``--quantization fp8``: projections and experts at one byte a weight; ``--kv-cache-dtype fp8``:
the cache's packed 656-byte rows). Several ``--quantization`` / ``--kv-cache-dtype`` values run one engine each, side
by side; each row carries its ratio to the first (``over_baseline_engine``). Output, one JSON line per batch::

    {"bench": "decode_e2e", "batch": B, "engine_tok_s": x, "hf_tok_s": y, "roofline_tok_s": z,
     "frac_of_roofline": f, ..., "date": ..., "commit": ..., "hardware": ..., "command": ...}

GPU:  python -m benchmarks.bench_decode_e2e --backend cuda --out benchmarks/results/h200_decode_e2e.jsonl
V3:   python -m benchmarks.bench_decode_e2e --backend cuda --shape v3-4l --graphs --quantization none fp8
CPU rehearsal (tiny shapes):  python -m benchmarks.bench_decode_e2e --backend cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

from benchmarks.decode_workload import (
    SHAPES,
    append_jsonl,
    mla_projection_params,
    pdl_enabled,
    pdl_off,
    prompts_for,
    release_device_memory,
    stamped_logger,
    sync,
    warmup_summary,
    write_model_dir,
)
from deepinfer_npu.benchmark_meta import row_meta

_GPU_FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")


#: engine stats split into host ms a step: step_ms (all of engine.step), forward_ms (launching the forward: inputs,
#: metadata, the graph launch), model_ms (within it, the graph replay / eager model launch), sample_ms (launching
#: sampling + verification), host_wait_ms (blocked on the previous step's end event). Under ZOS a step's launch times
#: are added when its results are, one step later: a window's sums are shifted by one step.
HOST_SPLIT = ("step_ms", "forward_ms", "model_ms", "sample_ms", "host_wait_ms")
# engine steps a batch's prefill (one step when it fits max_num_batched_tokens) or warm-up may take before the run
# stops with the reason: far past any healthy run, short of an endless loop
PREFILL_STEP_LIMIT = 1000


def gpu_state(device_type: str) -> dict | None:
    """The GPU's SM / memory clocks (MHz), power (W), temperature and clock-event reasons (bitmask) now, from
    nvidia-smi (~tens of ms; called between timed windows): a window that ran slow at a lower clock tells itself
    apart from one that lost time elsewhere. None without a CUDA device or nvidia-smi."""
    if device_type != "cuda":
        return None
    import subprocess

    import torch

    idx = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if visible[0].strip():  # nvidia-smi numbers the physical devices
        idx = visible[idx].strip() if idx < len(visible) else idx
    for fields in (_GPU_FIELDS, _GPU_FIELDS[:-1]):  # older drivers lack clocks_event_reasons
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                  "-i", str(idx)], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode == 0 and out.stdout.strip():
            values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
            return dict(zip(fields, values))
    return None


def copy_bandwidth(device_type: str) -> float:
    """Bytes read + written per second of a large device-to-device copy (median of timed copies)."""
    import torch

    if device_type == "cuda":
        n = 1 << 30  # 2 GiB of bf16
        a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
        b = torch.empty_like(a)
        for _ in range(5):
            b.copy_(a)
        times = []
        for _ in range(30):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        t = sorted(times)[len(times) // 2]
        del a, b
        torch.cuda.empty_cache()
        return 2 * n * 2 / t
    a = torch.empty(1 << 26, dtype=torch.float32).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * 4 / sorted(times)[3]


def bytes_per_step(cfg: dict, batch: int, context: float, itemsize: int = 2, fp8: bool = False,
                   kv_fp8: bool = False) -> dict:
    """Bytes a decode step must move (see the module docstring), by part. ``fp8``: the projections and experts are
    e4m3 (1 byte a weight, plus a 4-byte scale per 128 x 128 block); the absorbed kv_b, router and lm_head stay in
    ``itemsize``. ``kv_fp8``: the cache rows are packed FP8 (L e4m3 bytes, 4 per 128 of them, 2 per RoPE value),
    else L + R values of ``itemsize``."""
    d = cfg["hidden_size"]
    rope, lrank = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    layers, dense_layers = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    e, k, mi = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    mla = mla_projection_params(cfg)
    attn_q = mla["q"] + mla["kv_a"] + mla["o"]  # the quantisable projections
    attn_kvb = mla["kv_b"]  # absorbed into w_uk / w_uv, model dtype
    dense = 3 * d * cfg["intermediate_size"]
    hit = e * (1.0 - (1.0 - k / e) ** batch)
    experts = 3 * d * mi * cfg["n_shared_experts"] + hit * 3 * d * mi
    moe_layers = layers - dense_layers
    quantisable = layers * attn_q + dense_layers * dense + moe_layers * experts
    plain = layers * attn_kvb + moe_layers * e * d + cfg["vocab_size"] * d
    qbytes = (1 + 4 / 128**2) if fp8 else itemsize
    weights = quantisable * qbytes + plain * itemsize
    kv_row = (lrank + 4 * -(-lrank // 128) + 2 * rope) if kv_fp8 else (lrank + rope) * itemsize
    kv = layers * batch * context * kv_row
    return {"weights": weights, "kv": kv, "experts_hit": hit, "total": weights + kv}


def run_engine(args, model_dir: str, cfg: dict, log, out: dict, quantization: str | None = None,
               kv_cache_dtype: str = "auto") -> dict:
    from deepinfer_npu import LLM, SamplingParams

    max_model_len = 64 * -(-(args.prompt_len + args.gen + 8) // 64)
    blocks = max(args.batch) * (max_model_len // 64) + 2
    llm = LLM(model_dir, load_format="dummy", backend=args.backend, dtype=args.dtype, max_model_len=max_model_len,
              max_num_seqs=max(args.batch), num_kv_blocks=blocks,
              max_num_batched_tokens=max(4096, max(args.batch) * args.prompt_len),  # one prefill step per batch
              # --graphs: decode replayed from CUDA graphs (captured in the warm-up)
              enable_graphs=args.graphs, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    engine = llm.llm_engine
    dev = engine.backend.device_type
    log(f"engine built: backend={engine.backend.name} dtype={args.dtype} quantization={quantization} "
        f"kv_cache_dtype={kv_cache_dtype} max_model_len={max_model_len} blocks={blocks}")
    log("kernels: " + warmup_summary(engine))
    for batch in args.batch:
        # warm-up: prefill + a few decode steps (compiles this batch's kernel configurations, cuBLAS plans)
        for i, p in enumerate(prompts_for(batch, args.prompt_len, cfg["vocab_size"], salt=1)):
            engine.add_request(f"w{batch}-{i}", {"prompt_token_ids": p},
                               SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        warm_steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            warm_steps += 1
            if warm_steps > PREFILL_STEP_LIMIT:
                raise RuntimeError(f"batch {batch}: the warm-up requests (3 tokens each) are unfinished after "
                                   f"{warm_steps} steps (the KV cache has {blocks} blocks)")
        params = SamplingParams(max_tokens=args.gen + 1, temperature=0.0, ignore_eos=True)
        windows = []  # one timed decode window per repeat, fresh requests each time (the same prompts)
        for rep in range(args.repeat):
            for i, p in enumerate(prompts_for(batch, args.prompt_len, cfg["vocab_size"])):
                engine.add_request(f"d{batch}-{rep}-{i}", {"prompt_token_ids": p}, params)
            # Prefill until EVERY request has its first token (the whole batch fits one prefill step; counting
            # generation_tokens alone would stop early when decode steps of the first admitted requests interleave
            # with later prefill chunks - that flaw is in the first H200 run's batch 16 / 64 numbers).
            # A request that finishes without a token (an error the engine reports on it) or a prefill that makes
            # no progress ends the run with the reason, rather than waiting for a first token that never comes.
            started: set[str] = set()
            prefill_steps = 0
            while len(started) < batch:
                for o in engine.step():
                    if o.outputs and len(o.outputs[0].token_ids) >= 1:
                        started.add(o.request_id)
                    elif o.finished:
                        c = o.outputs[0] if o.outputs else None
                        raise RuntimeError(f"batch {batch}: request {o.request_id} finished without a token "
                                           f"({getattr(c, 'finish_reason', None)}: {getattr(c, 'finish_message', '')})")
                prefill_steps += 1
                if prefill_steps > PREFILL_STEP_LIMIT:
                    raise RuntimeError(f"batch {batch}: {batch - len(started)} of {batch} requests have no first "
                                       f"token after {prefill_steps} steps (unfinished: "
                                       f"{engine.has_unfinished_requests()}; the KV cache has {blocks} blocks)")
            sync(dev)
            engine.stats["generation_tokens"] = 0
            host0 = {k: engine.stats[k] for k in HOST_SPLIT}
            steps = 0
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            sync(dev)
            elapsed = time.perf_counter() - t0
            tokens = engine.stats["generation_tokens"]
            clean = tokens == batch * args.gen and steps <= args.gen + 1
            # share of the window the host spent blocked on the device: ~1 - host work / step when the device
            # bounds the loop, ~0 when the host does (tells a slow window's cause apart)
            wait_frac = (engine.stats["host_wait_ms"] - host0["host_wait_ms"]) / (1e3 * elapsed)
            # host ms a step by phase (engine stats): where the host's time goes when it bounds the loop
            split = {k: round((engine.stats[k] - host0[k]) / max(steps, 1), 4) for k in HOST_SPLIT}
            windows.append((tokens / elapsed, elapsed, tokens, steps, prefill_steps, clean, wait_frac,
                            gpu_state(dev) if args.gpu_state else None, split))
        # the median window (a host hiccup in one short window at batch 1 moves a single reading by 10-20 %); with an
        # even --repeat the upper of the two middle windows
        tok_s, elapsed, tokens, steps, prefill_steps, clean, _wait, _gpu, split = sorted(windows, key=lambda w: w[0])[
            len(windows) // 2]
        clean = all(w[5] for w in windows)
        out[batch] = {"engine_tok_s": tok_s, "engine_step_ms": 1e3 * elapsed / max(steps, 1),
                      "engine_tokens": tokens, "engine_steps": steps, "prefill_steps": prefill_steps,
                      "pure_decode_window": clean,
                      "engine_tok_s_windows": [round(w[0], 1) for w in windows],
                      "host_wait_frac_windows": [round(w[6], 3) for w in windows],
                      "host_ms_per_step": split, "host_ms_per_step_windows": [w[8] for w in windows],
                      "gpu_state_windows": [w[7] for w in windows] if args.gpu_state else None}
        stats = engine.get_stats()
        out[batch].update(graphs=args.graphs, engine_graph_steps=stats["graph_steps"],
                          graphs_disabled=stats.get("graphs_disabled"))
        log(f"engine batch={batch}: {tokens} tokens in {elapsed:.3f}s ({tok_s:.1f} tok/s, median of "
            f"{[round(w[0], 1) for w in windows]}, host blocked {[round(w[6], 2) for w in windows]}, "
            + (f"SM MHz after {[(w[7] or {}).get('clocks.sm') for w in windows]}, " if args.gpu_state else "")
            + f"host ms/step of the median window {split}, "
            + f"{steps} steps after {prefill_steps} prefill steps; pure decode window: {clean}; "
            f"graphs={args.graphs}: {stats['graph_steps']} graph steps so far, "
            f"captured {stats.get('graphs_captured')}, disabled: {stats.get('graphs_disabled')})")
    out["op_report"] = engine.backend.op_report()
    del llm, engine
    release_device_memory(dev)
    return out


def build_hf_model(cfg: dict, dtype_name: str, device: str):
    """transformers' DeepseekV2ForCausalLM for a V2-shaped config with random weights (the peer of the runs)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    hf_cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype",
                                                       "rope_scaling", "scoring_func", "moe_layer_freq")}
    config = DeepseekV2Config(**hf_cfg)
    dtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV2ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    return model.to(device=device, dtype=dtype).eval()


def run_hf(args, cfg: dict, device: str, log, out: dict) -> dict:
    import torch

    model = build_hf_model(cfg, args.dtype, device)
    log(f"transformers model built ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params)")
    for batch in args.batch:
        ids = torch.tensor(prompts_for(batch, args.prompt_len, cfg["vocab_size"]), device=device)
        mask = torch.ones_like(ids)

        def gen(n: int, model=model, ids=ids, mask=mask) -> float:
            sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                res = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=0, use_cache=True)
            sync(device)
            assert res.shape[1] == args.prompt_len + n, res.shape
            return time.perf_counter() - t0

        gen(2)  # warm-up
        t_short = gen(1)
        t_long = gen(1 + args.gen)
        decode = max(t_long - t_short, 1e-9)
        out[batch] = {"hf_tok_s": batch * args.gen / decode, "hf_prefill_s": t_short}
        log(f"transformers batch={batch}: decode {args.gen} steps in {decode:.3f}s "
            f"({batch * args.gen / decode:.1f} tok/s; prefill+1 {t_short:.3f}s)")
    del model
    release_device_memory(device)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen", type=int, default=32, help="decode tokens per request timed after the prefill")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed decode windows per batch (fresh requests each); the row reports the median window "
                   "(odd counts: the middle one)")
    p.add_argument("--gpu-state", action="store_true",
                   help="after each timed window, record the GPU's clocks / power / clock-event reasons (nvidia-smi)")
    p.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES), help="the model's dims (module docstring)")
    p.add_argument("--tiny", action="store_true", help="--shape tiny: the CPU rehearsal")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--no-engine", action="store_true", help="skip the engine")
    p.add_argument("--graphs", action="store_true", help="engine with enable_graphs=True (captured decode graphs)")
    p.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "fp8"],
                   help="weights quantised at load (the roofline counts 1-byte projections and experts); several: "
                   "one engine each, in this order, side by side in this run (fp8 rows carry their ratio to none)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8"],
                   help="latent cache dtype(s): each with each --quantization, side by side in this run")
    p.add_argument("--out", default=None, help="append the JSON lines here")
    args = p.parse_args(argv)

    import torch

    if args.tiny:
        args.shape = "tiny"
    cfg, model_name = SHAPES[args.shape]
    if args.shape == "v3-4l":
        args.no_hf = True
    device = "cuda" if args.backend == "cuda" else "cpu"
    log = stamped_logger()

    meta = row_meta(device)
    bw = copy_bandwidth(device)
    log(f"hardware: {meta['hardware']}; copy bandwidth {bw / 1e9:.1f} GB/s (read + write)")
    tmp = write_model_dir(cfg, "bench_decode_e2e_")
    # (quantization, kv_cache_dtype) engines in this order; rows carry their ratio to the first one
    variants = [(q, kv) for q in args.quantization for kv in args.kv_cache_dtype]
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    context = args.prompt_len + args.gen / 2.0

    def variant_rows(q: str, kv: str) -> list[dict]:
        """The rows of one (quantization, kv_cache_dtype) engine, printed as they are made."""
        rows = []
        eng = engines.get((q, kv), {})
        base = engines.get(variants[0], {})
        for batch in args.batch:
            by = bytes_per_step(cfg, batch, context, itemsize, fp8=q == "fp8", kv_fp8=kv == "fp8")
            roof = batch / (by["total"] / bw)
            e_tok = eng.get(batch, {}).get("engine_tok_s")
            b_tok = base.get(batch, {}).get("engine_tok_s") if (q, kv) != variants[0] else None
            row = {
                "bench": "decode_e2e", **meta, "batch": batch,
                "engine_tok_s": round(e_tok, 2) if e_tok is not None else None,
                "hf_tok_s": round(hf[batch]["hf_tok_s"], 2) if batch in hf else None,
                "roofline_tok_s": round(roof, 1),
                "frac_of_roofline": round(e_tok / roof, 4) if e_tok is not None else None,
                "hf_frac_of_roofline": round(hf[batch]["hf_tok_s"] / roof, 4) if batch in hf else None,
                # the first variant's engine in this run at this batch (a quantised or FP8-cache row's speed-up)
                "over_baseline_engine": round(e_tok / b_tok, 4) if e_tok and b_tok else None,
                "baseline": f"quantization={variants[0][0]} kv_cache_dtype={variants[0][1]}",
                "engine_step_ms": round(eng[batch]["engine_step_ms"], 3) if batch in eng else None,
                "engine_steps": eng.get(batch, {}).get("engine_steps"),
                "engine_tok_s_windows": eng.get(batch, {}).get("engine_tok_s_windows"),
                "host_wait_frac_windows": eng.get(batch, {}).get("host_wait_frac_windows"),
                "host_ms_per_step": eng.get(batch, {}).get("host_ms_per_step"),
                "host_ms_per_step_windows": eng.get(batch, {}).get("host_ms_per_step_windows"),
                "gpu_state_windows": eng.get(batch, {}).get("gpu_state_windows"),
                "pure_decode_window": eng.get(batch, {}).get("pure_decode_window"),
                "bytes_per_step": int(by["total"]), "kv_bytes_per_step": int(by["kv"]),
                "experts_hit": round(by["experts_hit"], 2), "copy_GBps": round(bw / 1e9, 1),
                "model": model_name,
                "dtype": args.dtype, "quantization": None if q == "none" else q, "kv_cache_dtype": kv,
                "prompt_len": args.prompt_len, "decode_tokens": args.gen,
                "backend": args.backend, "torch": torch.__version__,
                "timing": "wall clock over decode steps, device synchronised at both ends; "
                + ("decode from captured CUDA graphs (--graphs)" if args.graphs else "eager (no CUDA graphs)"),
                "engine_graph_steps": eng.get(batch, {}).get("engine_graph_steps"),
                "graphs_disabled": eng.get(batch, {}).get("graphs_disabled"),
            }
            if args.backend == "cuda":  # kernels_cuda/_pdl.py: programmatic dependent launch on or off
                row["pdl"] = pdl_enabled()
                row["pdl_off"] = pdl_off()
            # the engine switches set in the environment (A/B runs), cache locations left out
            row["env"] = {k: v for k, v in sorted(os.environ.items())
                          if k.startswith("DEEPINFER_") and not k.endswith("_DIR")}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if "op_report" in eng:
            print(json.dumps({"bench": "decode_e2e_op_report", "backend": args.backend, "quantization": q,
                              "kv_cache_dtype": kv, **eng["op_report"]}), flush=True)
        return rows

    engines: dict[tuple[str, str], dict] = {}  # variant -> {batch: measurements, "op_report": ...}
    hf = {}
    written = set()  # variants whose rows are in --out already
    if not args.no_engine:
        for q, kv in variants:
            eng = engines[q, kv] = {}
            try:
                run_engine(args, tmp, cfg, log, eng, quantization=None if q == "none" else q, kv_cache_dtype=kv)
            except Exception:  # noqa: BLE001 - report what was measured, then the error
                log(f"engine (quantization={q}, kv_cache_dtype={kv}) failed:\n" + traceback.format_exc())
            for batch in args.batch:
                if batch in eng:
                    print(json.dumps({"bench": "decode_e2e_engine_partial", "quantization": q, "kv_cache_dtype": kv,
                                      "batch": batch, **eng[batch]}), flush=True)
            if args.no_hf:  # no transformers rows to wait for: this engine's rows now (a later stall loses nothing)
                append_jsonl(args.out, variant_rows(q, kv))
                written.add((q, kv))
    if not args.no_hf:
        try:
            run_hf(args, cfg, device, log, hf)
        except Exception:  # noqa: BLE001
            log("transformers failed:\n" + traceback.format_exc())
    lines = [r for q, kv in (variants if not args.no_engine else variants[:1]) if (q, kv) not in written
             for r in variant_rows(q, kv)]
    append_jsonl(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
