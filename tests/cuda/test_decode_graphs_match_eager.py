"""Captured CUDA graphs of decode steps (worker/decode_graphs.py + backends/cuda/graph.py): greedy tokens of the
reference model with ``enable_graphs=True`` against eager on backend="cuda" (skipped without CUDA); the dense
sync-free MLA decode fallback that makes the reference model's attention capturable, against the CPU reference
(runs everywhere)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_npu.backends.cpu import mla as ref_mla
from deepinfer_npu.backends.cuda.mla_dense import mla_attention_dense

from deepinfer_npu.config import REFERENCE_MODEL_DIR

needs_reference = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "config.json").exists(),
                                     reason="the reference model is not installed")


def _padded_problem(seed=0, block=16):
    """3 real rows (q 1, 3, 2), one padding row (q = k = 1 on block 0) and two empty rows, as a graph pads."""
    g = torch.Generator().manual_seed(seed)
    sq, sk = [1, 3, 2, 1, 0, 0], [20, 37, 5, 1, 0, 0]
    width = 4
    tables = torch.zeros(len(sq), width, dtype=torch.int32)
    nxt = 1
    for b, k in enumerate(sk[:3]):
        n = -(-k // block)
        tables[b, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
        nxt += n
    cache = torch.randn(nxt, block, 64 + 32, generator=g)
    t = sum(sq)
    cu = torch.zeros(len(sq) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(sq), 0)
    return dict(q_latent=torch.randn(t, 4, 64, generator=g), q_rope=torch.randn(t, 4, 32, generator=g),
                kv_cache=cache, block_tables=tables, seqlens_q=torch.tensor(sq, dtype=torch.int32),
                seqlens_k=torch.tensor(sk, dtype=torch.int32), cu_seqlens_q=cu, softmax_scale=96 ** -0.5)


def test_dense_mla_decode_matches_reference_with_padding_rows():
    inp = _padded_problem()
    out = mla_attention_dense(**inp)
    ref = ref_mla.mla_attention(**inp)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_reference
@pytest.mark.parametrize("method", [None, "mtp", "dflash"])
def test_cuda_graph_decode_matches_eager(method):
    from deepinfer_npu import LLM, SamplingParams

    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
               "class Stack:\n    def __init__(self):\n", "    for i in range(len(items)):\n",
               "# Copyright 2001 Python Software Foundation\n"]  # 5 rows: padded to the graph of 8
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    kw = dict(backend="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8, speculative_method=method,
              num_speculative_tokens=3)

    def run(**extra):
        llm = LLM(**kw, **extra)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    eager_llm, eager = run(enable_graphs=False)
    llm, graphed = run(enable_graphs=True)
    worker = llm.llm_engine.worker
    assert worker.graphs is not None, "the CUDA backend's graph runner was not used"
    runner, stats = worker.graphs.graphs, llm.get_stats()
    diag = (method, runner.num_captures, runner.num_replays, worker.graph_steps, stats["decode_steps"],
            sorted(runner.graphs), id(runner))
    varlen = llm.llm_engine.varlen  # its start-up curve times each size's graph: 1 capturing + 5 timed replays
    profiled = varlen.profile_replays if varlen is not None else 0
    assert runner.num_captures > 0 and runner.num_replays == worker.graph_steps + profiled > 0, diag
    assert worker.graph_steps == stats["decode_steps"], diag
    # bf16: padded shapes may pick other GEMM tiles than eager; demand exact agreement on most sequences and a
    # long common prefix on all (a real replay bug, e.g. stale inputs, breaks the first tokens).
    exact = sum(a == b for a, b in zip(eager, graphed))
    for a, b in zip(eager, graphed):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert common >= 8, (common, a, b)
    assert exact >= len(prompts) - 1, (exact, eager, graphed)
    if method == "dflash":  # the ring write runs inside the decode graph: a stale or misplaced write would show as
        # drafts that stop being accepted (tokens stay right: verification is lossless)
        assert worker.graphs.drafter_hook is not None
        got, want = stats["mean_accepted_length"], eager_llm.get_stats()["mean_accepted_length"]
        assert got >= 0.8 * want, (got, want)


@pytest.mark.gpu
def test_cuda_graph_decode_on_deepseek_dims_matches_eager(deepseek_dims_model, assert_logprobs_close):
    """The TileLang MLA decode kernel (DeepSeek dims: kv_lora 512 + rope 64, page 64) inside captured graphs:
    random bf16 weights, greedy; graphed tokens follow eager ones (logprobs-close rule at a first difference: each
    side's token is in the other's top-5)."""

    from deepinfer_npu import LLM, SamplingParams

    path = deepseek_dims_model(num_hidden_layers=3, max_position_embeddings=2048)
    prompts = [{"prompt_token_ids": [(37 * i + 11 * b) % 4000 + 5 for i in range(40 + 13 * b)]} for b in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)

    def run(**extra):
        llm = LLM(path, load_format="dummy", backend="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                  **extra)
        return llm, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    eager_llm, eager = run(enable_graphs=False)
    llm, graphed = run(enable_graphs=True)
    worker = llm.llm_engine.worker
    assert worker.graph_steps == llm.get_stats()["decode_steps"] > 0
    assert "kernels_cuda.mla_decode" in llm.llm_engine.backend.op_report()["mla_attention"]
    assert_logprobs_close(eager, graphed)


@pytest.mark.gpu
@needs_reference
def test_cuda_decodes_from_graphs_by_default():
    from deepinfer_npu import LLM, SamplingParams

    llm = LLM(backend="cuda", max_model_len=256, max_num_seqs=4)
    llm.generate(["def f(x):\n"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.worker.graphs is not None and llm.llm_engine.worker.graph_steps > 0
    eager = LLM(backend="cuda", max_model_len=256, max_num_seqs=4, enable_graphs=False)
    assert eager.llm_engine.worker.graphs is None
