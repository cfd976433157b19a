"""CudaKernelSet.warmup (backends/cuda/warmup.py): the TileLang configurations it compiles at start-up for an
engine's KernelWarmupPlan, without a GPU.

The modules' ``precompile`` functions (and moe_gemm's ``get_kernel`` / ``expert_starts``) are replaced by recorders,
so these tests check exactly what would be compiled, and that a failing compile is reported and turns its module
off instead of stopping start-up. The expected MLA decode configurations are recomputed here the slow way (every
host max query length, not every bucket) from the launch's own heuristics. One test compiles for real (the ZOS
correction kernel, a few seconds) when nvcc is present.
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("tilelang", reason="tilelang is not installed (pip install tilelang==0.1.15)")

from deepinfer_npu.backends.cuda import kernels as cuda_kernels  # noqa: E402
from deepinfer_npu.backends.cuda.kernels import CudaKernelSet  # noqa: E402
from deepinfer_npu.kernels_cuda import mla_decode as md  # noqa: E402

from deepinfer_npu.hal.graph_sizes import graph_sizes  # noqa: E402
from deepinfer_npu.hal.types import GatingParams, KernelWarmupPlan  # noqa: E402

SMS = 132  # H200
PRECOMPILED = ("rms_norm", "mla_rope_cache", "mla_decode", "silu_mul", "moe_routing", "spec_verify", "zos_fixup",
               "skinny_gemm", "moe_gemm_swap", "decode_inputs", "mla_absorb")


def v2_lite_plan(k: int = 0, varlen: bool = False, method: str | None = None, max_num_seqs: int = 64,
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
def recorded(monkeypatch):
    """Replace every compile entry point by a recorder: -> {module: [args of each call]}."""
    calls: dict[str, list] = {}
    for name in PRECOMPILED:

        def rec(items, *args, _name=name, **kwargs):
            calls.setdefault(_name, []).append((list(items), kwargs))

        monkeypatch.setattr(importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}"), "precompile", rec)
    from deepinfer_npu.kernels_cuda import moe_gemm

    monkeypatch.setattr(moe_gemm, "get_kernel", lambda *a: calls.setdefault("moe_gemm", []).append(("gemm", a)))
    monkeypatch.setattr(moe_gemm, "expert_starts",
                        lambda t: calls.setdefault("moe_gemm", []).append(("expert_scan", (t.shape[0],))))
    monkeypatch.delenv(cuda_kernels.UNVERIFIED_ENV, raising=False)
    # the expected sets here are the pipelined kernel's on any machine (an H200 would add mla_decode_ws' flag:
    # test_mla_decode_ws_configs_follow_the_gate_and_the_device)
    monkeypatch.setattr(importlib.import_module("deepinfer_npu.backends.cuda.warmup"), "_device_is_sm90", lambda: False)
    return calls


def kernel_set() -> CudaKernelSet:
    ks = CudaKernelSet()
    ks.num_sms = SMS
    return ks


def expected_mla_decode(plan: KernelWarmupPlan) -> set[tuple]:
    """Independently: every host max query length 1..16 of a prefill chunk of B prompts on the scheduler's tables,
    plus each decode graph at max_q = k + 1 on the graphs' tables."""
    h, width = plan.num_heads, math.ceil(plan.max_model_len / plan.block_size)
    out = set()
    for b in range(1, plan.max_num_prompts + 1):
        for q in range(1, 17):
            bq = md.bucket_q(q)
            out.add(md.decode_config(h, bq, md.default_num_splits(b, h, bq, width, SMS)))
    bq = md.bucket_q(plan.num_speculative_tokens + 1)
    for s in plan.decode_graph_sizes:
        out.add(md.decode_config(h, bq, md.default_num_splits(s, h, bq, plan.decode_graph_width, SMS)))
    return out


PREFILL_4096 = [(16, q * 16 // 64, 1, True) for q in (32, 64, 128, 256, 512, 1024, 2048, 4096)]
COMMON = {
    "rms_norm": [(2048, False, 1e-6), (2048, True, 1e-6)],
    "mla_rope_cache": [(16, 192, 128, True, 1e-6)],
    "silu_mul": [(2816, True), (2816, False), (10944, True), (10944, False), (1408, True), (1408, False)],
    "moe_routing": [("gating", (64, 6, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False)),
                    ("permute", (2048, 6, 64, "bfloat16")), ("permute", (2048, 6, 64, "bfloat16", 128, True)),
                    # moe_route: the gating fused with the permute for decode sizes (on since session 7)
                    ("route", (2048, 6, 64, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False, "bfloat16")),
                    ("unpermute", (2048, 6, "bfloat16", "torch_strided")),
                    ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True))],
    "moe_gemm": [("gemm", (2816, 2048, 128)), ("gemm", (2048, 1408, 128)), ("expert_scan", (64,))],
    # the worker samples every step through spec_verify (prefill rows too), speculation or not
    "spec_verify": [("argmax", (102400, False)), ("accept", ()), ("argmax", (102400, True))],
}


def _check_common(calls, plan):
    for name, want in COMMON.items():
        got = calls[name]
        if name == "moe_gemm":
            assert got == want
        else:
            assert len(got) == 1, f"{name}: one precompile call"
            assert got[0][0] == want, (name, got[0][0])
    (mla_cfgs, mla_kw), = calls["mla_decode"]
    assert mla_kw == {"softmax_scale": pytest.approx(192**-0.5)}
    decode = [c for c in mla_cfgs if len(c) != 4]
    assert len(decode) == len(set(decode))
    assert set(decode) == expected_mla_decode(plan)
    assert [c for c in mla_cfgs if len(c) == 4] == PREFILL_4096


def test_v2_lite_without_speculation(recorded):
    plan = v2_lite_plan(k=0)
    assert plan.decode_graph_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64) and plan.decode_graph_width == 65
    summary = kernel_set().warmup(plan)
    _check_common(recorded, plan)
    assert recorded["zos_fixup"] == [([("correct", ())], {})]  # every decode step corrects; no re-split at k=0
    n = sum(len(c[0][0]) for name, c in recorded.items() if name != "moe_gemm") + 3
    assert summary.startswith(f"{n} configs in ") and "mla_decode: 69 (8 prefill)" in summary  # q = 1: the small tile
    assert "failed" not in summary and "skipped" not in summary


def test_v2_lite_dflash_varlen(recorded):
    plan = v2_lite_plan(k=5, varlen=True, method="dflash", drafter_rms_norm_eps=1e-5)
    assert len(plan.decode_graph_sizes) == 51 and plan.decode_graph_sizes[-1] == 64 * 6
    kernel_set().warmup(plan)
    # DFlash's own (plain) norms with the drafter's eps
    assert recorded["rms_norm"][0][0][-1] == (2048, False, 1e-5)
    recorded["rms_norm"][0][0].pop()
    _check_common(recorded, plan)
    # verification at k = 5 in the graphs: bucket 8 -> 2 m-tiles at H=16
    mla = recorded["mla_decode"][0][0]
    assert (16, 2, md.default_num_splits(1, 16, 8, 66, SMS)) in mla and (16, 2, 1) in mla
    assert recorded["zos_fixup"] == [([("correct", ()), ("resplit", (5, 128, 1))], {})]


def test_resplit_launch_shapes_up_to_max_num_seqs(recorded):
    kernel_set().warmup(v2_lite_plan(k=3, varlen=True, method="dflash", max_num_seqs=300))
    assert recorded["zos_fixup"][0][0] == [("correct", ()), ("resplit", (3, 128, 1)), ("resplit", (3, 1024, 1))]


def test_mtp_eager_steps_and_chains(recorded):
    """MTP runs the target's MLA eagerly (catch-up on the step's metadata, chains on tables padded by k + 1 keys):
    a short max_model_len keeps the tables under 32 blocks, where the width changes the split count."""
    plan = v2_lite_plan(k=2, varlen=True, method="mtp", max_model_len=512, max_num_seqs=4)
    kernel_set().warmup(plan)
    got = {c for c in recorded["mla_decode"][0][0] if len(c) != 4}
    widths = {8, 9}  # the scheduler's 512 / 64, and (512 + 2*2 + 2 + 1) // 64 + 1 for the padded chains
    assert {md.decode_config(16, 1, md.default_num_splits(1, 16, 1, w, SMS)) for w in widths} <= got
    assert md.decode_config(16, 1, 9) in got and md.decode_config(16, 1, 8) in got
    # the chain replayed from graphs: one query a row at each propose graph size, on the chain graphs' width
    from deepinfer_npu.spec.mtp_drafter import chain_graph_width

    w = chain_graph_width(512, 2, 64)
    assert {md.decode_config(16, 1, md.default_num_splits(b, 16, 1, w, SMS)) for b in (1, 2, 4)} <= got


def test_not_bf16_or_off_dims_compile_what_still_applies(recorded):
    plan = v2_lite_plan(dtype=torch.float32)
    kernel_set().warmup(plan)
    # fp32 routing, logits, lengths; decode_inputs (integers only) whatever the dtype
    assert set(recorded) == {"moe_routing", "spec_verify", "zos_fixup", "decode_inputs"}
    assert ("permute", (2048, 6, 64, "float32")) in recorded["moe_routing"][0][0]
    recorded.clear()
    kernel_set().warmup(v2_lite_plan(block_size=16, moe_gating=None, moe_intermediate_size=0))
    assert "mla_decode" not in recorded and "mla_rope_cache" not in recorded  # the kernels read pages of 64
    assert recorded["rms_norm"][0][0][-1] == (512, False, 1e-6)  # kv_a norm: the composed prolog's
    assert "moe_gemm" not in recorded and "moe_routing" not in recorded


def test_unverified_gate_is_respected(recorded, monkeypatch):
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", {"spec_verify", "zos_fixup", "mla_prefill"})
    kernel_set().warmup(v2_lite_plan(k=5, varlen=True, method="dflash"))
    assert "spec_verify" not in recorded and "zos_fixup" not in recorded
    assert all(len(c) != 4 for c in recorded["mla_decode"][0][0])


def test_failing_compile_is_reported_and_falls_back(recorded, monkeypatch):
    def boom(items):
        raise RuntimeError("nvcc exploded")

    monkeypatch.setattr("deepinfer_npu.kernels_cuda.zos_fixup.precompile", boom)
    ks = kernel_set()
    summary = ks.warmup(v2_lite_plan(k=5, varlen=True, method="dflash"))  # does not raise
    assert "failed: zos_fixup (warm-up compile failed: RuntimeError: nvcc exploded)" in summary
    assert "zos_fixup:" not in summary.split(";")[0]  # not counted as compiled
    assert "spec_verify" in recorded  # the modules after it still compiled
    assert ks._kernel("zos_fixup") is None
    mod, path = ks._gated_kernel("zos_fixup", SimpleNamespace(is_cuda=True))
    assert mod is None and "warm-up compile failed: RuntimeError: nvcc exploded" in path


def test_listing_failure_does_not_raise(recorded, monkeypatch):
    from deepinfer_npu.backends.cuda import warmup

    def broken(*a, **k):
        raise KeyError("bug")

    monkeypatch.setattr(warmup, "reachable_configs", broken)
    assert kernel_set().warmup(v2_lite_plan()).startswith("skipped: listing the configurations failed")


def test_mla_decode_precompile_takes_prefill_configs(monkeypatch):
    """The 4-tuple form builds the causal-tile-bound variant and primes get_kernel with the launcher's own call."""
    built, primed = [], []
    monkeypatch.setattr(md, "build_mla_decode", lambda *a, **k: built.append((a, k)) or object())
    monkeypatch.setattr(md.tilelang, "compile", lambda f, **k: f)
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: primed.append((a, k)))
    md.precompile([(16, 1, 4), (16, 8, 1, True)], softmax_scale=0.125)
    assert [k.get("causal_tile_bound") for _a, k in built] == [False, True]
    assert primed == [((16, 1, 4, 0.125), {}), ((16, 8, 1, 0.125), {"causal_tile_bound": True})]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not found")
def test_real_compile_of_a_tiny_plan(monkeypatch):
    """End to end through the real precompile: an fp32 dense plan with spec_verify gated off leaves the ZOS
    correction kernel only (a few seconds of nvcc, or TileLang's cache)."""
    from deepinfer_npu.kernels_cuda import zos_fixup

    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", {"spec_verify", "decode_inputs"})
    monkeypatch.delenv(cuda_kernels.UNVERIFIED_ENV, raising=False)
    summary = kernel_set().warmup(v2_lite_plan(dtype=torch.float32, moe_gating=None, moe_intermediate_size=0))
    assert summary.startswith("1 configs in ") and "zos_fixup: 1" in summary, summary
    assert ("correct", ()) in zos_fixup._KERNELS


def test_eager_decode_after_a_resplit_stays_within_k_plus_1(recorded):
    """The MLA layer passes AttentionMetadata.max_seqlen_q (k + 1 after a device re-split) to mla_attention, so
    eager decode launches buckets up to bucket_q(k + 1) only, not those of the shape bound T - B + 1: with fewer
    prompts than decode rows, the decode-only row counts must not compile query buckets 8 and 16 at k = 3."""
    k = 3
    plan = v2_lite_plan(k=k, varlen=True, method="dflash", graphs=False, max_num_prompts=2, max_model_len=256)
    kernel_set().warmup(plan)
    h, width = plan.num_heads, plan.block_table_width
    want = set()
    for b in range(1, plan.max_num_prompts + 1):  # prefill chunks of <= 16 tokens: every bucket
        for q in range(1, 17):
            bq = md.bucket_q(q)
            want.add(md.decode_config(h, bq, md.default_num_splits(b, h, bq, width, SMS)))
    for b in range(1, plan.max_num_seqs + 1):  # eager decode, re-split or not: max q <= k + 1
        for q in range(1, k + 2):
            bq = md.bucket_q(q)
            want.add(md.decode_config(h, bq, md.default_num_splits(b, h, bq, width, SMS)))
    cfgs = recorded["mla_decode"][0][0]
    assert {c for c in cfgs if len(c) != 4} == want
    # prefill buckets up to the longest chunk, min(max_num_batched_tokens, max_model_len) = 256
    assert [c for c in cfgs if len(c) == 4] == [(16, q * 16 // 64, 1, True) for q in (32, 64, 128, 256)]


def test_more_experts_than_the_expert_scan_takes_use_the_library_gemm(recorded):
    """kernels_cuda.moe_gemm's expert scan runs one thread an expert (MAX_EXPERTS = 256): with more experts,
    grouped_mlp must route to torch._grouped_mm (expert_starts would raise), and the warm-up compiles no GEMM."""
    from deepinfer_npu.kernels_cuda import moe_gemm

    bf16 = torch.bfloat16
    ks = kernel_set()

    def route(experts: int):
        a = SimpleNamespace(is_cuda=True, shape=(6, 2048), dtype=bf16)
        w13 = SimpleNamespace(shape=(experts, 2816, 2048), dtype=bf16)
        w2 = SimpleNamespace(shape=(experts, 2048, 1408), dtype=bf16)
        return ks._moe_gemm_for(a, w13, w2)

    assert route(moe_gemm.MAX_EXPERTS) is not None
    assert route(moe_gemm.MAX_EXPERTS + 128) is None
    ks.warmup(v2_lite_plan(moe_gating=GatingParams(top_k=8, num_experts=384)))
    assert "moe_gemm" not in recorded


def test_skinny_gemm_configs_cover_every_linear_at_decode_rows(recorded, monkeypatch):
    """Every (in_features, dtype) of the model's weights with K <= DENSE_MAX_K at the row blocks of 1 ..
    DENSE_MAX_ROWS tokens, and the dense MLPs' gated gate/up GEMM; the grouped expert GEMMs only where
    SKINNY_GROUPED_MAX_ROWS routes rows to them."""
    from deepinfer_npu.kernels_cuda import skinny_gemm as sk

    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", set())
    bf, f32 = torch.bfloat16, torch.float32
    weights = ((2048, bf), (2816, bf), (10944, bf), (2048, f32))
    kernel_set().warmup(v2_lite_plan(k=0, linear_weights=weights))
    got = recorded["skinny_gemm"][0][0]
    v = sk.default_variant()
    name = {bf: "bfloat16", f32: "float32"}
    blocks = {sk.rows_block(m) for m in range(1, sk.DENSE_MAX_ROWS + 1)}
    want = {(k, rb, False, False, name[dt], name[dt], name[dt], *v) for k, dt in weights for rb in blocks
            if k <= sk.DENSE_MAX_K and dt == bf}  # fp32 x fp32 is unreachable in a bf16 model
    want |= {(2048, rb, True, False, "bfloat16", "bfloat16", "bfloat16", *v) for rb in blocks}
    want |= {(2048, rb, False, False, "bfloat16", "float32", "float32", *v) for rb in blocks}  # router_logits
    want.add((512, 1, False, True, "bfloat16", "bfloat16", "bfloat16", *v))  # W_UV at one token (SKINNY_W_UV)
    assert (10944, 1, False, False, "bfloat16", "bfloat16", "bfloat16", *v) not in want
    assert len(got) == len(set(got)) and set(got) == want
    recorded.clear()
    monkeypatch.setattr(cuda_kernels, "SKINNY_GROUPED_MAX_ROWS", 24)
    monkeypatch.setattr("deepinfer_npu.backends.cuda.warmup.SKINNY_GROUPED_MAX_ROWS", 24)
    kernel_set().warmup(v2_lite_plan(k=0, linear_weights=weights))
    got = set(recorded["skinny_gemm"][0][0])
    assert {(2048, 2, True, True, "bfloat16", "bfloat16", "bfloat16", *v),
            (1408, 2, False, True, "bfloat16", "bfloat16", "bfloat16", *v)} <= got
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", {"skinny_gemm"})
    recorded.clear()
    kernel_set().warmup(v2_lite_plan(k=0, linear_weights=weights))
    assert "skinny_gemm" not in recorded


def test_mla_decode_launch_uses_precompile_call_form(monkeypatch):
    """get_kernel is a functools.cache keyed on the call's spelling: the launch must call it exactly as precompile
    primes it, or every warmed-up configuration is rebuilt at its first launch."""
    calls = []
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: calls.append((a, k)) or (lambda *args: None))
    bf = torch.bfloat16
    one, cu = torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    args = (torch.zeros(1, 16, 512, dtype=bf), torch.zeros(1, 16, 64, dtype=bf), torch.zeros(2, 64, 576, dtype=bf),
            torch.zeros(1, 2, dtype=torch.int32), one, one, cu, 0.125)
    md.mla_decode(*args, max_seqlen_q=1, num_splits=2, num_sms=SMS)  # 16 rows: the small tile
    md.mla_decode(*args, max_seqlen_q=1, num_splits=2, num_sms=SMS, num_stages=1, threads=128)  # a sweep's call
    md.mla_decode(*args, max_seqlen_q=2, num_splits=2, num_sms=SMS)  # 32 rows: the 64-row tile
    monkeypatch.undo()
    primed = []
    monkeypatch.setattr(md, "build_mla_decode", lambda *a, **k: object())
    monkeypatch.setattr(md.tilelang, "compile", lambda f, **k: f)
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: primed.append((a, k)))
    md.precompile([md.decode_config(16, 1, 2), md.decode_config(16, 2, 2)], softmax_scale=0.125)
    assert calls[0] == primed[0] == ((16, 1, 2, 0.125, 2), {"threads": 128, "block_m": 16})
    assert calls[1] == ((16, 1, 2, 0.125, 1), {"threads": 128, "block_m": 16, "skip_empty_splits": False})
    assert calls[2] == primed[1] == ((16, 1, 2, 0.125), {})


def test_mla_decode_ws_configs_follow_the_gate_and_the_device():
    """mla_decode_ws (verified in session 8: on by default): on a Hopper device every 64-row decode configuration
    carries the warp-specialized flag (16-row tiles and prefill do not change); put back into the gate, or on
    another device: none."""
    from deepinfer_npu.backends.cuda.warmup import reachable_configs

    plan = v2_lite_plan(k=3, varlen=True, method="dflash")
    base = reachable_configs(plan, SMS, enabled=lambda name: name != "mla_decode_ws", sm90=True)["mla_decode"]
    assert not any(len(c) == 6 for c in base)
    ws = reachable_configs(plan, SMS, enabled=lambda name: True, sm90=True)["mla_decode"]
    want = {c + (False, md.BLOCK_M, True) if len(c) == 3 else c for c in base}
    assert set(ws) == want and any(len(c) == 6 for c in ws) and any(len(c) == 5 for c in ws)
    assert reachable_configs(plan, SMS, enabled=lambda name: True, sm90=False)["mla_decode"] == base
    assert "mla_decode_ws" not in cuda_kernels.UNVERIFIED_KERNELS
    assert reachable_configs(plan, SMS, sm90=True)["mla_decode"] == ws  # the default gate: on


def test_warm_up_on_a_hopper_device_takes_mla_decode_ws(recorded, monkeypatch):
    """warm_up asks the device: on compute capability 9.x the 64-row decode configurations carry the flag."""
    from deepinfer_npu.backends.cuda import warmup

    plan = v2_lite_plan(k=3, varlen=True, method="dflash")
    monkeypatch.setattr(warmup, "_device_is_sm90", lambda: True)
    kernel_set().warmup(plan)
    (cfgs, _kw), = recorded["mla_decode"]
    assert cfgs == warmup.reachable_configs(plan, SMS, sm90=True)["mla_decode"]
    assert any(len(c) == 6 and c[5] for c in cfgs)


def test_mla_decode_ws_launch_uses_precompile_call_form(monkeypatch):
    """The warp-specialized launch calls mla_decode_ws.get_kernel as its precompile primes it, with Q and Q_pe as
    [T * H, D] row views; a 16-row step keeps the small pipelined tile even when asked for it."""
    from deepinfer_npu.kernels_cuda import mla_decode_ws as ws

    launched, small = [], []
    monkeypatch.setattr(ws, "get_kernel", lambda *a, **k: lambda *args: launched.append((a, k, args[0].shape,
                                                                                         args[1].shape)))
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: small.append((a, k)) or (lambda *args: None))
    bf = torch.bfloat16
    one, cu = torch.ones(1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    args = (torch.zeros(2, 16, 512, dtype=bf), torch.zeros(2, 16, 64, dtype=bf), torch.zeros(2, 64, 576, dtype=bf),
            torch.zeros(1, 2, dtype=torch.int32), one * 2, one * 2, cu, 0.125)
    md.mla_decode(*args, max_seqlen_q=2, num_splits=2, num_sms=SMS, warp_specialized=True)
    assert launched == [((16, 1, 2, 0.125), {}, (32, 512), (32, 64))] and not small
    md.mla_decode(args[0][:1], args[1][:1], *args[2:4], one, one, torch.tensor([0, 1], dtype=torch.int32), 0.125,
                  max_seqlen_q=1, num_splits=2, num_sms=SMS, warp_specialized=True)
    assert len(launched) == 1 and small == [((16, 1, 2, 0.125, 2), {"threads": 128, "block_m": 16})]
    monkeypatch.undo()
    primed = []
    monkeypatch.setattr(ws, "build_mla_decode_ws", lambda *a, **k: object())
    monkeypatch.setattr(ws, "_compile", lambda f: f)
    monkeypatch.setattr(ws, "get_kernel", lambda *a, **k: primed.append((a, k)))
    md.precompile([md.decode_config(16, 2, 2, warp_specialized=True)], softmax_scale=0.125)
    assert primed == [((16, 1, 2, 0.125), {})]


def test_mla_decode_ws_off_switch(monkeypatch):
    """DEEPINFER_CUDA_MLA_WS=0 (kernels.MLA_WS): no warp-specialized configuration even on a Hopper."""
    from deepinfer_npu.backends.cuda.warmup import reachable_configs

    plan = v2_lite_plan(k=3, varlen=True, method="dflash")
    monkeypatch.setattr(cuda_kernels, "MLA_WS", False)
    assert not any(len(c) == 6 for c in reachable_configs(plan, SMS, sm90=True)["mla_decode"])


def test_mla_decode_ws_compile_failure_falls_back_to_the_pipelined_kernel(monkeypatch):
    """A failed mla_decode_ws compile turns that kernel off (with the reason), compiles the pipelined 64-row kernel
    for the same configurations instead, and the launch then takes it: mla_decode stays on."""
    from deepinfer_npu.kernels_cuda import mla_decode_ws as ws

    monkeypatch.setattr(ws, "disabled_reason", None)

    def boom(*a, **k):
        raise RuntimeError("nvcc: out of memory")

    monkeypatch.setattr(ws, "precompile", boom)
    built = []
    monkeypatch.setattr(md, "build_mla_decode", lambda *a, **k: built.append(a[:3]) or object())
    monkeypatch.setattr(md, "compile_sm90", lambda f: f)
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: (lambda *args: None))
    md.precompile([md.decode_config(16, 2, 2, warp_specialized=True), md.decode_config(16, 1, 4)], 0.125)
    assert ws.disabled_reason == "compile failed: RuntimeError: nvcc: out of memory"
    assert sorted(built) == [(16, 1, 2), (16, 1, 4)]
    launched = []
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: launched.append((a, k)) or (lambda *args: None))
    monkeypatch.setattr(ws, "get_kernel", lambda *a, **k: pytest.fail("mla_decode_ws is off"))
    bf = torch.bfloat16
    one, cu = torch.ones(1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    q, q_pe, kv = (torch.zeros(2, 16, 512, dtype=bf), torch.zeros(2, 16, 64, dtype=bf),
                   torch.zeros(2, 64, 576, dtype=bf))
    md.mla_decode(q, q_pe, kv, torch.zeros(1, 2, dtype=torch.int32), one * 2, one * 2, cu, 0.125, max_seqlen_q=2,
                  num_splits=2, num_sms=SMS, warp_specialized=True)
    assert launched == [((16, 1, 2, 0.125), {})]


GATED_MOE = {"moe_gemm_swap", "moe_combine_add", "moe_dispatch_scan"}  # session 5's, verified in session 6


def test_moe_gemm_swap_warmup_and_gate(recorded, monkeypatch):
    """moe_gemm_swap (verified): w13 (gated) and w2 at the row tiles of 6 .. 64 rows (1 .. 10 tokens x top-6), and
    moe_gemm's own configurations still (larger batches); nothing of it while it is gated and the gate is shut."""
    from deepinfer_npu.kernels_cuda import moe_gemm_swap as sw

    monkeypatch.delenv(cuda_kernels.UNVERIFIED_ENV, raising=False)
    assert "moe_gemm_swap" not in cuda_kernels.UNVERIFIED_KERNELS
    kernel_set().warmup(v2_lite_plan(k=0))
    (cfgs, _kw), = recorded["moe_gemm_swap"]
    assert cfgs == [(2816, 2048, 8, True, 64), (2048, 1408, 8, False, 64),
                    (2816, 2048, 16, True, 64), (2048, 1408, 16, False, 64)]
    assert all(sw.config_for(*c[:2], r, c[3]) in cfgs for c in cfgs for r in (6, 64))
    assert ("gemm", (2816, 2048, 128)) in recorded["moe_gemm"]
    recorded.clear()
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", set(GATED_MOE))
    kernel_set().warmup(v2_lite_plan(k=0))
    assert "moe_gemm_swap" not in recorded


def test_moe_combine_add_warmup_and_gate(recorded, monkeypatch):
    """The un-permute with the shared experts' output fused: compiled by default (verified); not while gated."""
    fused = ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True))
    monkeypatch.delenv(cuda_kernels.UNVERIFIED_ENV, raising=False)
    kernel_set().warmup(v2_lite_plan(k=0))
    assert recorded["moe_routing"][0][0][-1] == fused
    recorded.clear()
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", set(GATED_MOE))
    kernel_set().warmup(v2_lite_plan(k=0))
    assert fused not in recorded["moe_routing"][0][0]


def test_moe_dispatch_scan_warmup_and_gate(recorded, monkeypatch):
    """The permute that also writes the expert GEMMs' scan: compiled by default (verified); not while gated."""
    fused = ("permute", (2048, 6, 64, "bfloat16", 128, True))
    monkeypatch.delenv(cuda_kernels.UNVERIFIED_ENV, raising=False)
    kernel_set().warmup(v2_lite_plan(k=0))
    assert fused in recorded["moe_routing"][0][0]
    recorded.clear()
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", set(GATED_MOE))
    kernel_set().warmup(v2_lite_plan(k=0))
    assert fused not in recorded["moe_routing"][0][0]


def test_unverified_gate_takes_a_list_of_modules(monkeypatch):
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", {"moe_gemm_swap", "moe_combine_add", "moe_dispatch_scan"})
    monkeypatch.setenv(cuda_kernels.UNVERIFIED_ENV, "moe_gemm_swap, moe_dispatch_scan")
    assert cuda_kernels.unverified_kernel_enabled("moe_gemm_swap")
    assert cuda_kernels.unverified_kernel_enabled("moe_dispatch_scan")
    assert not cuda_kernels.unverified_kernel_enabled("moe_combine_add")
    assert cuda_kernels.unverified_kernel_enabled("rms_norm")  # not gated
    monkeypatch.setenv(cuda_kernels.UNVERIFIED_ENV, "on")
    assert cuda_kernels.unverified_kernel_enabled("moe_combine_add")
    monkeypatch.setenv(cuda_kernels.UNVERIFIED_ENV, "0")
    assert not cuda_kernels.unverified_kernel_enabled("moe_gemm_swap")


def test_w_uv_skinny_configuration_only_when_on(recorded, monkeypatch):
    """mla_epilogue's W_UV at one token (SKINNY_W_UV, on by default since session 7): skinny_gemm's grouped
    configuration at K = kv_lora_rank."""
    assert cuda_kernels.SKINNY_W_UV or "DEEPINFER_CUDA_SKINNY_W_UV" in os.environ
    from deepinfer_npu.kernels_cuda import skinny_gemm as sk

    want = sk.config_for(512, sk.rows_block(1), False, True, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(cuda_kernels, "SKINNY_W_UV", False)
    kernel_set().warmup(v2_lite_plan(k=0))
    assert want not in recorded["skinny_gemm"][0][0]
    recorded.clear()
    monkeypatch.setattr(cuda_kernels, "SKINNY_W_UV", True)
    kernel_set().warmup(v2_lite_plan(k=0))
    assert want in recorded["skinny_gemm"][0][0]


def test_decode_inputs_compiled_only_with_its_gate_open(recorded, monkeypatch):
    """decode_inputs (verified on an H200 in session 7, on by default): one build for the page size; put back into
    UNVERIFIED_KERNELS, nothing compiled while gated, the build again with the gate open."""
    from deepinfer_npu.kernels_cuda import decode_inputs as di

    assert "decode_inputs" not in cuda_kernels.UNVERIFIED_KERNELS
    monkeypatch.delenv(cuda_kernels.UNVERIFIED_ENV, raising=False)
    kernel_set().warmup(v2_lite_plan(k=0))
    assert recorded["decode_inputs"] == [([(64, di.THREADS)], {})]
    recorded.clear()
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", {"decode_inputs"})
    kernel_set().warmup(v2_lite_plan(k=0))
    assert "decode_inputs" not in recorded
    monkeypatch.setenv(cuda_kernels.UNVERIFIED_ENV, "decode_inputs")
    kernel_set().warmup(v2_lite_plan(k=0))
    assert recorded["decode_inputs"] == [([(64, di.THREADS)], {})]


def test_moe_route_compiled_only_with_its_gate_open(recorded, monkeypatch):
    """The gating fused with the permute (moe_route, verified on an H200 in session 7, on by default): put back into
    UNVERIFIED_KERNELS, no ("route", cfg) build while gated; one with its gate open."""
    from deepinfer_npu.kernels_cuda import moe_routing as mr

    assert "moe_route" not in cuda_kernels.UNVERIFIED_KERNELS
    monkeypatch.delenv(cuda_kernels.UNVERIFIED_ENV, raising=False)
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", {"moe_route"})
    kernel_set().warmup(v2_lite_plan(k=0))
    assert all(kind != "route" for kind, _cfg in recorded["moe_routing"][0][0])
    recorded.clear()
    monkeypatch.setenv(cuda_kernels.UNVERIFIED_ENV, "moe_route")
    kernel_set().warmup(v2_lite_plan(k=0))
    routes = [cfg for kind, cfg in recorded["moe_routing"][0][0] if kind == "route"]
    gating = GatingParams(num_experts=64, top_k=6, scoring_func="softmax", topk_method="greedy", n_group=1,
                          topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    assert routes == [mr._route_cfg(gating, 2048, "bfloat16", True)]


def test_mla_absorb_compiled_for_bf16_models_and_not_when_gated(recorded, monkeypatch):
    """mla_absorb (W_UK of one token, verified in session 8): one build for the model's dims; none for an fp32 model;
    nothing compiled when it is put back into the gate."""
    from deepinfer_npu.kernels_cuda import mla_absorb as ma

    assert "mla_absorb" not in cuda_kernels.UNVERIFIED_KERNELS
    monkeypatch.delenv(cuda_kernels.UNVERIFIED_ENV, raising=False)
    kernel_set().warmup(v2_lite_plan(k=0))
    assert recorded["mla_absorb"] == [([ma.config_for(16, 128, 512, 192)], {})]
    recorded.clear()
    kernel_set().warmup(v2_lite_plan(k=0, dtype=torch.float32))
    assert "mla_absorb" not in recorded
    monkeypatch.setattr(cuda_kernels, "UNVERIFIED_KERNELS", {"mla_absorb"})
    kernel_set().warmup(v2_lite_plan(k=0))
    assert "mla_absorb" not in recorded
