"""Diagnose DFlash + varlen at concurrency 1 on CUDA (190 vs 550 tok/s for fixed on an H200, session 3):
cProfile of one timed generate with varlen on and off, graph-step counts, chosen total_q."""
import cProfile
import pstats
import sys
import time
from collections import Counter

sys.path.insert(0, "benchmarks")
from bench_spec import heldout_prompts  # noqa: E402

from deepinfer_npu import LLM, SamplingParams  # noqa: E402

prompts = heldout_prompts(16)[:1]
greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
for varlen in (True, False):
    llm = LLM(backend="cuda", speculative_method="dflash", num_speculative_tokens=5, varlen_verification=varlen,
              max_num_seqs=1, enable_graphs=True, graph_capture="startup")
    llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    pr.disable()
    dt = time.perf_counter() - t0
    s = llm.get_stats()
    eng = llm.llm_engine
    print(f"== varlen={varlen}: {len(outs[0].outputs[0].token_ids) / dt:.1f} tok/s, {dt * 1e3:.1f} ms, stats "
          f"{ {k: s[k] for k in s if 'graph' in k or 'steps' in k} }", flush=True)
    if varlen and eng.varlen is not None:
        print("chosen total_q", Counter(eng.varlen.chosen_total_q).most_common(8), "curve", eng.varlen.sizes[:8],
              [round(x, 3) for x in eng.varlen.curve[:8]], "slope", eng.varlen.forward_est.slope(),
              "sampler", eng.varlen.sampler_est.estimate(1))
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(14)
    st.sort_stats("cumulative").print_stats("deepinfer_npu|backends", 22)
