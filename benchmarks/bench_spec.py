"""Speculative decoding on the reference model: acceptance and varlen vs fixed verification.

JSON lines:

* ``{"bench": "spec_acceptance", "method": ..., "k": 5, "mean_accepted_length": ..., "per_position_acceptance":
  [...], "tokens_per_verify_step": ...}`` — greedy, on held-out prompts;
* ``{"bench": "spec_throughput", "method": ..., "varlen": bool, "concurrency": c, "tok_s": ...,
  "mean_verify_length": ..., "mean_accepted_length": ...}`` plus the no-speculation baseline;
* with ``--plot FILE.png``, the profiled step-time curve with the total_q values varlen chose.

Every row also carries date, commit, hardware and command. Run:  python -m benchmarks.bench_spec --backend cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

from deepinfer_npu.benchmark_meta import row_meta


def heldout_prompts(n: int, chars: int = 160) -> list[str]:
    """Prompts cut from held-out stdlib files (the reference model's split), or built-in prompts."""
    try:
        from examples.reference_model.corpus import is_heldout, list_stdlib_files, stdlib_root

        root = stdlib_root()
        files = [f for f in list_stdlib_files(root) if is_heldout(f)]
        prompts = []
        for f in files:
            text = (root / f).read_text(encoding="utf-8", errors="replace")
            for start in range(0, max(len(text) - chars, 1), max(len(text) // 3, chars)):
                prompts.append(text[start : start + chars])
                if len(prompts) >= n:
                    return prompts
        if prompts:
            return prompts
    except Exception as e:  # the corpus is optional for this benchmark
        print(f"# held-out prompts unavailable ({e}); using built-in prompts", file=sys.stderr)
    from deepinfer_npu.run import DEFAULT_PROMPTS

    return (DEFAULT_PROMPTS * (n // len(DEFAULT_PROMPTS) + 1))[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["mtp", "dflash"])
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--plot", default=None, help="PNG path for the step-time curve with varlen's choices")
    p.add_argument("--dtype", default=None, help="model dtype (default: the engine's default for the backend)")
    p.add_argument("--graphs", action="store_true", help="decode from captured graphs (enable_graphs=True)")
    p.add_argument("--skip-acceptance", action="store_true", help="only the throughput runs")
    p.add_argument("--out", default=None, help="append the JSON lines here")
    p.add_argument("--repeat", type=int, default=1, help="timed generates per configuration; tok_s is their median")
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    out_lines: list[dict] = []

    def emit(line: dict) -> None:
        line.update(graphs=args.graphs, dtype=args.dtype or "default", backend=args.backend)
        out_lines.append(line)
        print(json.dumps(line), flush=True)

    from deepinfer_npu import LLM, SamplingParams
    from deepinfer_npu.config import REFERENCE_MODEL_DIR

    methods = [m for m in args.methods if m != "dflash" or (REFERENCE_MODEL_DIR / "dflash").exists()]
    meta = row_meta(args.backend)
    extra = {"enable_graphs": args.graphs, **({"graph_capture": "startup"} if args.graphs else {}),
             **({"dtype": args.dtype} if args.dtype else {})}
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = heldout_prompts(max(args.concurrency + [16]))

    for method in [] if args.skip_acceptance else methods:
        llm = LLM(backend=args.backend, speculative_method=method, num_speculative_tokens=args.k,
                  varlen_verification=False, **extra)
        llm.generate(prompts[:16], greedy, use_tqdm=False)
        s = llm.get_stats()
        emit({
            "bench": "spec_acceptance", "method": method, "k": args.k, "prompts": 16, "heldout": True,
            "mean_accepted_length": round(s["mean_accepted_length"], 4),
            "per_position_acceptance": [round(x, 4) if x is not None else None for x in s["per_position_acceptance"]],
            "emitted_tokens_per_step_all_requests": round(s["spec_emitted_tokens"] / max(s["spec_verify_steps"], 1), 3),
            **meta,
        })

    chosen: Counter = Counter()
    curve = None
    for conc in args.concurrency:
        batch = prompts[:conc]
        runs = [(None, False)] + [(m, v) for m in methods for v in (False, True)]
        for method, varlen in runs:
            llm = LLM(backend=args.backend, speculative_method=method, num_speculative_tokens=args.k,
                      varlen_verification=varlen, max_num_seqs=max(conc, 1), **extra)
            llm.generate(batch[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
            engine = llm.llm_engine
            rates = []
            for _ in range(args.repeat):  # host-bound runs vary by +-15 % run to run: report the median of several
                for key in list(engine.stats):
                    engine.stats[key] = 0 if isinstance(engine.stats[key], int) else 0.0
                t0 = time.perf_counter()
                outs = llm.generate(batch, greedy, use_tqdm=False)
                dt = time.perf_counter() - t0
                rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            s = llm.get_stats()  # of the last repeat (greedy: every repeat runs the same steps)
            line = {"bench": "spec_throughput", "method": method or "none", "varlen": varlen, "k": args.k,
                    "concurrency": conc, "tok_s": round(statistics.median(rates), 1), "decode_steps": s["decode_steps"],
                    **meta}
            if args.repeat > 1:
                line["tok_s_runs"] = [round(r, 1) for r in rates]
            if method:
                line["mean_verify_length"] = round(s["mean_verify_length"], 3)
                line["mean_accepted_length"] = round(s["mean_accepted_length"], 3)
            if varlen and engine.varlen is not None:
                curve = (engine.varlen.sizes, engine.varlen.curve)
                chosen.update(engine.varlen.chosen_total_q)
                line["slope_ms_per_token"] = round(engine.varlen.forward_est.slope(), 5)
            emit(line)

    if args.out:
        with open(args.out, "a") as f:
            for line in out_lines:
                f.write(json.dumps(line) + "\n")
    if args.plot and curve is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        sizes, ms = curve
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(sizes, ms, marker="o", ms=3, label="profiled forward time per graph size")
        ax2 = ax.twinx()
        xs = sorted(chosen)
        ax2.bar(xs, [chosen[x] for x in xs], width=1.5, alpha=0.4, color="tab:orange",
                label="total_q chosen by varlen (steps)")
        ax.set_xlabel("total_q (tokens in the decode step)")
        ax.set_ylabel("forward ms")
        ax2.set_ylabel("steps")
        ax.set_title(f"Varlen verification on {meta['hardware']}")
        fig.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(json.dumps({"bench": "spec_plot", "path": args.plot}))


if __name__ == "__main__":
    main()
