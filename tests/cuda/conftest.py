"""Shared by the tests here: a DeepSeek-V2 model directory at the real MLA dims (random weights through
``load_format="dummy"``), the logprobs-close rule for greedy runs on different kernels, and for the warm-up tests a
V2-Lite plan, kernel sets with chosen kernels left out, and recorders in place of the kernel compilers."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

from deepinfer_npu.hal.graph_sizes import graph_sizes
from deepinfer_npu.hal.types import GatingParams, KernelWarmupPlan

DEEPSEEK_DIMS = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 4096,
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "topk_method": "greedy", "scoring_func": "softmax",
    "moe_layer_freq": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "initializer_range": 0.02,
}


@pytest.fixture
def deepseek_dims_model(tmp_path):
    """-> make(**overrides): writes config.json (DEEPSEEK_DIMS with the overrides) to a temporary directory and
    returns its path as a string, for ``LLM(path, load_format="dummy")``."""

    def make(**overrides) -> str:
        (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_DIMS | overrides))
        return str(tmp_path)

    return make


@pytest.fixture
def assert_logprobs_close():
    """-> check(a_outputs, b_outputs): greedy runs on different kernels (logprobs=5): at the first position where
    the tokens differ, each run's token is in the other's top-5."""

    def check(a_outputs, b_outputs) -> None:
        for a, b in zip(a_outputs, b_outputs):
            ta, tb = list(a.token_ids), list(b.token_ids)
            first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
            if first is not None:
                assert tb[first] in a.logprobs[first] and ta[first] in b.logprobs[first], (first, ta, tb)

    return check


# ---- kernel warm-up without a GPU (test_kernel_warmup_configs.py, test_warmup_follows_the_selection.py) -------
SMS = 132  # H200
PRECOMPILED = ("rms_norm", "mla_rope_cache", "mla_decode", "silu_mul", "moe_routing", "spec_verify", "zos_fixup",
               "skinny_gemm", "moe_gemm_swap", "decode_inputs", "mla_absorb")


def _v2_lite_plan(k: int = 0, varlen: bool = False, method: str | None = None, max_num_seqs: int = 64,
                  max_model_len: int = 4096, graphs: bool = True, **kw) -> KernelWarmupPlan:
    """DeepSeek-V2-Lite (16 heads, vocab 102400, 64 experts top-6) in bf16, max_num_batched_tokens 4096, with the
    decode graphs the worker would capture (worker._build_graphs / DecodeGraphs)."""
    mml, mnbt, bs = max_model_len, 4096, kw.get("block_size", 64)
    fields = dict(
        dtype=torch.bfloat16, vocab_size=102400, hidden_size=2048, num_heads=16, qk_nope_head_dim=128,
        qk_rope_head_dim=64, kv_lora_rank=512, q_lora_rank=None, rope_interleaved=True, softmax_scale=192**-0.5,
        rms_norm_eps=1e-6, latent_norm_eps=1e-6, mlp_intermediate_sizes=(2816, 10944),
        moe_gating=GatingParams(top_k=6, num_experts=64), moe_intermediate_size=1408,
        block_size=bs, max_model_len=mml, max_num_seqs=max_num_seqs, max_num_prompts=max_num_seqs,
        max_num_batched_tokens=mnbt, num_speculative_tokens=k, speculative_method=method, varlen=varlen,
        decode_graph_sizes=tuple(graph_sizes(min(mnbt, max_num_seqs * (k + 1)))) if graphs else (),
        decode_graph_width=math.ceil((mml + 2 * k) / bs) + 1 if graphs else 0,
    )
    fields.update(kw)
    return KernelWarmupPlan(**fields)


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Replace every compile entry point by a recorder: -> {module: [args of each call]}."""
    calls: dict[str, list] = {}
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))  # the warm-up's compiled-markers: nothing compiled
    for name in PRECOMPILED:

        def rec(items, *args, _name=name, **kwargs):
            calls.setdefault(_name, []).append((list(items), kwargs))

        monkeypatch.setattr(importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}"), "precompile", rec)
    from deepinfer_npu.kernels_cuda import moe_gemm

    monkeypatch.setattr(moe_gemm, "get_kernel", lambda *a: calls.setdefault("moe_gemm", []).append(("gemm", a)))
    monkeypatch.setattr(moe_gemm, "expert_starts",
                        lambda t: calls.setdefault("moe_gemm", []).append(("expert_scan", (t.shape[0],))))
    # the expected sets here are the pipelined kernel's on any machine (a Hopper adds mla_decode_ws' flag:
    # test_mla_decode_ws_configs_follow_the_selection_and_the_device)
    monkeypatch.setattr("deepinfer_npu.backends.cuda.kernels.current_device_is_sm90", lambda: False)
    # no worker subprocesses (they would compile for real, whatever the recorders say): the serial pass records
    monkeypatch.setattr("deepinfer_npu.backends.cuda.warmup.compile_workers", lambda num_jobs: 0)
    return calls


def _kernel_set(skip=()):
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    ks.num_sms = SMS
    ks.SKIP = frozenset(skip)
    return ks


def _reachable(plan, sm90: bool = False, skip=()) -> dict[str, list[tuple]]:
    """What the warm-up compiles for ``plan`` once the kernel set is selected for it."""
    from deepinfer_npu.backends.cuda.ops import OpConfig
    from deepinfer_npu.backends.cuda.warmup import reachable_configs

    ks = _kernel_set()
    ks.select(OpConfig.from_plan(plan, sm90, frozenset(skip)))
    return reachable_configs(ks, plan, SMS)


@pytest.fixture
def v2_lite_plan():
    """-> the DeepSeek-V2-Lite KernelWarmupPlan factory (keyword overrides)."""
    return _v2_lite_plan


@pytest.fixture
def kernel_set():
    """-> make(skip=()): a CudaKernelSet on an H200's SM count, the named kernels left out of its selection."""
    return _kernel_set


@pytest.fixture
def reachable():
    """-> reachable(plan, sm90=False, skip=()): the configurations the warm-up compiles for ``plan``."""
    return _reachable


@pytest.fixture
def cuda_backend():
    """The registry's CUDA backend, built fresh for the test (GPU tests only)."""
    from deepinfer_npu.hal import registry

    registry.clear_cache()
    be = registry.get_backend("cuda")
    yield be
    registry.clear_cache()
