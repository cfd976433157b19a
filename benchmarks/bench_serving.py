"""Online serving benchmark in the shape of vLLM's ``benchmark_serving``: requests arrive as a Poisson process at
each given rate (``inf``: all at once), stream from ``/v1/completions``, and per rate one JSON line reports
TTFT, TPOT (time per output token after the first), ITL (gap between streamed chunks, per token), end-to-end
latency (mean, p50, p90, p99, in ms), request throughput and output tokens/s.

Prompts: ``--dataset random`` draws ``--input-len`` random token ids per prompt (``ignore_eos``, exactly
``--output-len`` tokens out); ``--dataset FILE`` takes one prompt per line (text or a JSON string).

    python -m benchmarks.bench_serving --launch "--max-num-seqs 64" --rates 2 8 inf --num-prompts 64
    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 --model reference --rates inf

``--launch ARGS`` starts ``python -m deepinfer_npu.serve ARGS`` on a free port for the run and stops it after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import subprocess
import sys
import time

import numpy as np

from deepinfer_npu.benchmark_meta import row_meta


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (http://host:port); else --launch")
    p.add_argument("--launch", default=None, help="start `python -m deepinfer_npu.serve` with these arguments")
    p.add_argument("--model", default=None, help="the served model name; None: the server's only model")
    p.add_argument("--dataset", default="random", help="random, or a file with one prompt per line")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="random prompts: tokens per prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--vocab-size", type=int, default=4096, help="random prompts draw token ids below this")
    p.add_argument("--rates", type=float, nargs="+", default=[float("inf")], help="requests/s; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (None: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-offline", action="store_true",
                   help="with --launch: after the server stops, run the same prompts through LLM.generate with "
                   "the same engine options and report the server's output tok/s at rate inf as a ratio of it")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--hardware", default=None, help="what the rows' hardware field says; None: this host's CPU")
    return p.parse_args(argv)


def _prompts(args, vocab_size: int) -> list:
    rng = np.random.default_rng(args.seed)
    if args.dataset == "random":
        low = min(100, vocab_size // 2)  # clear of the special tokens at the start of the vocabulary
        return [rng.integers(low, vocab_size, args.input_len).tolist() for _ in range(args.num_prompts)]
    with open(args.dataset, encoding="utf-8") as f:
        lines = [json.loads(x) if x.startswith('"') else x.rstrip("\n") for x in f if x.strip()]
    if not lines:
        raise SystemExit(f"error: {args.dataset} has no prompts")
    return [lines[i % len(lines)] for i in range(args.num_prompts)]


async def _one(client, model: str, prompt, output_len: int) -> dict:
    t0 = time.perf_counter()
    marks, tokens, error = [], 0, None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                marks.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        error = f"{type(e).__name__}: {e}"
    return {"start": t0, "end": time.perf_counter(), "marks": marks, "tokens": tokens, "error": error}


async def _run_rate(client, model: str, prompts: list, output_len: int, rate: float, max_concurrency: int | None,
                    seed: int) -> tuple[list[dict], float]:
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(p):
        if gate is None:
            return await _one(client, model, p, output_len)
        async with gate:
            return await _one(client, model, p, output_len)

    tasks = []
    t0 = time.perf_counter()
    for p in prompts:
        tasks.append(asyncio.create_task(limited(p)))
        if rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def _summary(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["error"] is None and r["marks"]]
    ttft = [(r["marks"][0] - r["start"]) * 1e3 for r in ok]
    tpot = [(r["end"] - r["marks"][0]) * 1e3 / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = []
    for r in ok:  # a chunk may carry several tokens (speculative decoding): its gap is spread over them
        gaps = np.diff(r["marks"]) * 1e3
        itl += gaps.tolist()
    e2e = [(r["end"] - r["start"]) * 1e3 for r in ok]
    out_tokens = sum(r["tokens"] for r in ok)

    def stats(name: str, values: list[float]) -> dict:
        if not values:
            return {f"{name}_{k}": None for k in ("mean", "p50", "p90", "p99")}
        v = np.asarray(values)
        return {f"{name}_mean": round(float(v.mean()), 3), f"{name}_p50": round(float(np.percentile(v, 50)), 3),
                f"{name}_p90": round(float(np.percentile(v, 90)), 3),
                f"{name}_p99": round(float(np.percentile(v, 99)), 3)}

    row = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 3),
           "request_throughput": round(len(ok) / duration, 3), "output_tok_s": round(out_tokens / duration, 2),
           "total_output_tokens": out_tokens}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        row.update(stats(name, values))
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        row["first_error"] = errors[0]
    return row


def _launch(extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "deepinfer_npu.serve", "--port", "0", "--log-level", "warning", *shlex.split(extra)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", file=sys.stderr)
        m = re.search(r"serving \S+ on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    raise SystemExit(f"error: the server did not start (exit {proc.wait()})")


def _offline_tok_s(launch: str, prompts: list, output_len: int) -> float:
    """Output tokens/s of ``LLM.generate`` on ``prompts`` with the engine options of ``--launch``."""
    from deepinfer_npu import LLM, SamplingParams
    from deepinfer_npu.engine_args import engine_kwargs
    from deepinfer_npu.serve import build_parser

    opts = build_parser().parse_args(shlex.split(launch))
    llm = LLM(opts.model, **engine_kwargs(opts))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    llm.generate(inputs[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


async def _main(args) -> None:
    import openai

    proc = None
    base = args.base_url
    if base is None:
        if args.launch is None:
            raise SystemExit("error: give --base-url of a running server or --launch ARGS")
        proc, base = _launch(args.launch)
    rows = []
    try:
        client = openai.AsyncOpenAI(base_url=base.rstrip("/") + "/v1", api_key="unused", max_retries=0,
                                    timeout=3600)
        models = (await client.models.list()).data
        model = args.model or models[0].id
        prompts = _prompts(args, args.vocab_size)
        await _one(client, model, prompts[0], 2)  # warm-up
        for rate in args.rates:
            results, duration = await _run_rate(client, model, prompts, args.output_len, rate,
                                                args.max_concurrency, args.seed)
            row = {"bench": "serving", "model": model, "dataset": args.dataset, "num_prompts": len(prompts),
                   "input_len": args.input_len if args.dataset == "random" else None,
                   "output_len": args.output_len, "request_rate": "inf" if rate == float("inf") else rate,
                   "max_concurrency": args.max_concurrency, **_summary(results, duration), **row_meta(None)}
            if args.hardware:
                row["hardware"] = args.hardware
            rows.append(row)
        await client.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    if args.compare_offline and args.launch is not None:
        offline = _offline_tok_s(args.launch, prompts, args.output_len)
        for row in rows:
            row["offline_output_tok_s"] = round(offline, 2)
            row["server_vs_offline"] = round(row["output_tok_s"] / offline, 3)
    for row in rows:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    asyncio.run(_main(parse_args()))
