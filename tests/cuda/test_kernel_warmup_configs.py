"""CudaKernelSet.warmup: the TileLang configurations the selected op implementations compile at start-up for an
engine's KernelWarmupPlan, without a GPU.

The modules' ``precompile`` functions (and moe_gemm's ``get_kernel`` / ``expert_starts``) are replaced by recorders,
so these tests check exactly what would be compiled, and that a failing compile is reported and turns its module
off instead of stopping start-up. The expected MLA decode configurations are recomputed here the slow way (every
host max query length, not every bucket) from the launch's own heuristics. One test compiles for real (the ZOS
correction kernel, a few seconds) when nvcc is present.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from deepinfer_npu.hal.types import GatingParams, KernelWarmupPlan
from deepinfer_npu.kernels_cuda import mla_decode as md

pytestmark = pytest.mark.tilelang

SMS = 132  # H200


def expected_mla_decode(plan: KernelWarmupPlan, short_prefill_on_decode: bool = False) -> set[tuple]:
    """Independently: each decode graph at max_q = k + 1 on the graphs' tables; with ``short_prefill_on_decode``
    (mla_prefill left out: prefill chunks of <= 16 tokens take the decode kernel) every host max query length
    1..16 of a prefill chunk of B prompts on the scheduler's tables too. A packed FP8 cache's split counts
    count two resident CTAs an SM for its 16-row tile."""
    fp8 = plan.kv_cache_fp8
    h, width = plan.num_heads, math.ceil(plan.max_model_len / plan.block_size)
    out = set()
    for b in range(1, plan.max_num_prompts + 1 if short_prefill_on_decode else 1):
        for q in range(1, 17):
            bq = md.bucket_q(q)
            out.add(md.decode_config(h, bq, md.default_num_splits(b, h, bq, width, SMS, fp8)))
    bq = md.bucket_q(plan.num_speculative_tokens + 1)
    for s in plan.decode_graph_sizes:
        out.add(md.decode_config(h, bq, md.default_num_splits(s, h, bq, plan.decode_graph_width, SMS, fp8)))
    return out


PREFILL_4096 = [(16, q * 16 // 64, 1, True) for q in (32, 64, 128, 256, 512, 1024, 2048, 4096)]
COMMON = {
    "rms_norm": [(2048, False, 1e-6), (2048, True, 1e-6)],
    "mla_rope_cache": [(16, 192, 128, True, 1e-6), (16, 192, 128, True, 1e-6, 3648, 3648, 3072)],  # compact; fused rows
    # the routed experts' width only past 2048 rows (torch._grouped_mm): moe_gemm_swap and the gated moe_gemm below
    "silu_mul": [(2816, True), (2816, False), (10944, True), (10944, False), (1408, False)],
    "moe_routing": [("gating", (64, 6, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False)),
                    ("permute", (2048, 6, 64, "bfloat16")), ("permute", (2048, 6, 64, "bfloat16", 128, True)),
                    # moe_route: the gating fused with the permute for decode sizes
                    ("route", (2048, 6, 64, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False, "bfloat16")),
                    ("unpermute", (2048, 6, "bfloat16", "torch_strided")),
                    ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True)),
                    # prefill steps of 4096 tokens: 24576 assignments > MAX_ASSIGN, the combine by position
                    ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True, True))],
    # w13 with the SwiGLU in its epilogue (64 output columns a CTA), w2 plain
    "moe_gemm": [("gemm", (2816, 2048, 64, 3, True)), ("gemm", (2048, 1408, 128)), ("expert_scan", (64,))],
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


def test_v2_lite_without_speculation(recorded, v2_lite_plan, kernel_set):
    plan = v2_lite_plan(k=0)
    assert plan.decode_graph_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64) and plan.decode_graph_width == 65
    summary = kernel_set().warmup(plan)
    _check_common(recorded, plan)
    assert recorded["zos_fixup"] == [([("correct", ())], {})]  # every decode step corrects; no re-split at k=0
    n = sum(len(c[0][0]) for name, c in recorded.items() if name != "moe_gemm") + 3
    # q = 1: the small tile, split at every graph size up to 64 (one build for every count); every prefill step
    # (short chunks included) on mla_prefill's 8 buckets
    assert summary.startswith(f"{n} configs in ") and "mla_decode: 9 (8 prefill)" in summary
    assert "failed" not in summary and "skipped" not in summary


def test_v2_lite_dflash_varlen(recorded, v2_lite_plan, kernel_set):
    plan = v2_lite_plan(k=5, varlen=True, method="dflash", drafter_rms_norm_eps=1e-5)
    assert len(plan.decode_graph_sizes) == 51 and plan.decode_graph_sizes[-1] == 64 * 6
    kernel_set().warmup(plan)
    # DFlash's own (plain) norms with the drafter's eps
    assert recorded["rms_norm"][0][0][-1] == (2048, False, 1e-5)
    recorded["rms_norm"][0][0].pop()
    _check_common(recorded, plan)
    # verification at k = 5 in the graphs: bucket 8 -> 2 m-tiles at H=16
    mla = recorded["mla_decode"][0][0]
    assert md.default_num_splits(1, 16, 8, 66, SMS) > 1 and (16, 2, md.DYNAMIC_SPLITS) in mla and (16, 2, 1) in mla
    assert recorded["zos_fixup"] == [([("correct", ()), ("resplit", (5, 128, 1))], {})]


def test_resplit_launch_shapes_up_to_max_num_seqs(recorded, v2_lite_plan, kernel_set):
    kernel_set().warmup(v2_lite_plan(k=3, varlen=True, method="dflash", max_num_seqs=300))
    assert recorded["zos_fixup"][0][0] == [("correct", ()), ("resplit", (3, 128, 1)), ("resplit", (3, 1024, 1))]


def test_mtp_eager_steps_and_chains(recorded, v2_lite_plan, kernel_set):
    """MTP runs the target's MLA eagerly (catch-up on the step's metadata, chains on tables padded by k + 1 keys):
    a short max_model_len keeps the tables under 32 blocks, where the width changes the split count."""
    plan = v2_lite_plan(k=2, varlen=True, method="mtp", max_model_len=512, max_num_seqs=4)
    kernel_set().warmup(plan)
    got = {c for c in recorded["mla_decode"][0][0] if len(c) != 4}
    widths = {8, 9}  # the scheduler's 512 / 64, and (512 + 2*2 + 2 + 1) // 64 + 1 for the padded chains
    assert {md.decode_config(16, 1, md.default_num_splits(1, 16, 1, w, SMS)) for w in widths} <= got
    assert md.decode_config(16, 1, 9) == md.decode_config(16, 1, 8) in got  # one build, every count above 1
    # the chain replayed from graphs: one query a row at each propose graph size, on the chain graphs' width
    from deepinfer_npu.spec.mtp_drafter import chain_graph_width

    w = chain_graph_width(512, 2, 64)
    assert {md.decode_config(16, 1, md.default_num_splits(b, 16, 1, w, SMS)) for b in (1, 2, 4)} <= got


def test_not_bf16_or_off_dims_compile_what_still_applies(recorded, v2_lite_plan, kernel_set):
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


def test_skipped_implementations_compile_nothing(recorded, v2_lite_plan, kernel_set):
    kernel_set(skip={"spec_verify", "zos_fixup", "mla_prefill"}).warmup(v2_lite_plan(k=5, varlen=True, method="dflash"))
    assert "spec_verify" not in recorded and "zos_fixup" not in recorded
    assert all(len(c) != 4 for c in recorded["mla_decode"][0][0])


def test_failing_compile_is_reported_and_falls_back(recorded, monkeypatch, v2_lite_plan, kernel_set):
    def boom(items):
        raise RuntimeError("nvcc exploded")

    monkeypatch.setattr("deepinfer_npu.kernels_cuda.zos_fixup.precompile", boom)
    ks = kernel_set()
    summary = ks.warmup(v2_lite_plan(k=5, varlen=True, method="dflash"))  # does not raise
    assert "failed: zos_fixup (warm-up compile failed: RuntimeError: nvcc exploded)" in summary
    assert "zos_fixup:" not in summary.split(";")[0]  # not counted as compiled
    assert "spec_verify" in recorded  # the modules after it still compiled
    assert ks.modules.get("zos_fixup") is None
    mod, path = ks.impl("step").checked("zos_fixup", SimpleNamespace(is_cuda=True))
    assert mod is None and "warm-up compile failed: RuntimeError: nvcc exploded" in path
    assert "warm-up compile failed" in ks.op_report()["zos_fixup"]  # before any call: off, with the reason


def test_a_build_that_fails_once_is_retried_and_stays_on(recorded, monkeypatch, v2_lite_plan, kernel_set, caplog):
    """A failure of the moment (a killed compiler on a loaded host) is not a reason to turn the module off: the
    serial pass tries once more, and only a second failure turns it off (previous test)."""
    from deepinfer_npu.kernels_cuda import zos_fixup

    calls = []
    real = zos_fixup.precompile

    def flaky(items):
        calls.append(list(items))
        if len(calls) == 1:
            raise RuntimeError("nvcc killed")
        return real(items)

    monkeypatch.setattr("deepinfer_npu.kernels_cuda.zos_fixup.precompile", flaky)
    ks = kernel_set()
    with caplog.at_level("WARNING"):
        summary = ks.warmup(v2_lite_plan(k=5, varlen=True, method="dflash"))
    assert len(calls) == 2 and calls[0] == calls[1]
    assert "failed" not in summary and "zos_fixup: 2" in summary.split(";")[0], summary  # counted as compiled
    assert ks.modules.get("zos_fixup") is not None
    assert "kernels_cuda.zos_fixup failed to build (RuntimeError: nvcc killed); trying once more" in caplog.text


def test_listing_failure_does_not_raise(recorded, monkeypatch, v2_lite_plan, kernel_set):
    from deepinfer_npu.backends.cuda import warmup

    def broken(*a, **k):
        raise KeyError("bug")

    monkeypatch.setattr(warmup, "reachable_configs", broken)
    assert kernel_set().warmup(v2_lite_plan()).startswith("skipped: listing the configurations failed")


@pytest.mark.nvcc
def test_real_compile_of_a_tiny_plan(v2_lite_plan, kernel_set):
    """End to end through the real precompile: an fp32 dense plan with spec_verify and decode_inputs left out leaves
    the ZOS correction kernel only (a few seconds of nvcc, or TileLang's cache)."""
    from deepinfer_npu.kernels_cuda import zos_fixup

    plan = v2_lite_plan(dtype=torch.float32, moe_gating=None, moe_intermediate_size=0)
    summary = kernel_set(skip={"spec_verify", "decode_inputs"}).warmup(plan)
    assert summary.startswith("1 configs in ") and "zos_fixup: 1" in summary, summary
    assert ("correct", ()) in zos_fixup._KERNELS


def test_eager_decode_after_a_resplit_stays_within_k_plus_1(recorded, v2_lite_plan, kernel_set):
    """The MLA layer passes AttentionMetadata.max_seqlen_q (k + 1 after a device re-split) to mla_attention, so
    eager decode launches buckets up to bucket_q(k + 1) only, not those of the shape bound T - B + 1: with fewer
    prompts than decode rows, the decode-only row counts must not compile query buckets 8 and 16 at k = 3."""
    k = 3
    plan = v2_lite_plan(k=k, varlen=True, method="dflash", graphs=False, max_num_prompts=2, max_model_len=256)
    kernel_set().warmup(plan)
    h, width = plan.num_heads, plan.block_table_width
    want = set()  # prefill chunks of <= 16 tokens take mla_prefill (its 32-query bucket), not the decode kernel
    for b in range(1, plan.max_num_seqs + 1):  # eager decode, re-split or not: max q <= k + 1
        for q in range(1, k + 2):
            bq = md.bucket_q(q)
            want.add(md.decode_config(h, bq, md.default_num_splits(b, h, bq, width, SMS)))
    cfgs = recorded["mla_decode"][0][0]
    assert {c for c in cfgs if len(c) != 4} == want
    # prefill buckets up to the longest chunk, min(max_num_batched_tokens, max_model_len) = 256
    assert [c for c in cfgs if len(c) == 4] == [(16, q * 16 // 64, 1, True) for q in (32, 64, 128, 256)]


def test_more_experts_than_the_expert_scan_takes_use_the_library_gemm(recorded, v2_lite_plan, kernel_set):
    """kernels_cuda.moe_gemm's expert scan runs one thread an expert (MAX_EXPERTS = 256): with more experts,
    grouped_mlp must route to torch._grouped_mm (expert_starts would raise), and the warm-up compiles no GEMM."""
    from deepinfer_npu.kernels_cuda import moe_gemm

    bf16 = torch.bfloat16
    ks = kernel_set()

    def route(experts: int):
        a = SimpleNamespace(is_cuda=True, shape=(6, 2048), dtype=bf16)
        w13 = SimpleNamespace(shape=(experts, 2816, 2048), dtype=bf16)
        w2 = SimpleNamespace(shape=(experts, 2048, 1408), dtype=bf16)
        return ks.impl("grouped_mlp").moe_gemm_for(a, w13, w2)

    assert route(moe_gemm.MAX_EXPERTS) is not None
    assert route(moe_gemm.MAX_EXPERTS + 128) is None
    ks.warmup(v2_lite_plan(moe_gating=GatingParams(top_k=8, num_experts=384)))
    assert "moe_gemm" not in recorded


def test_skinny_gemm_configs_cover_every_linear_at_decode_rows(recorded, monkeypatch, v2_lite_plan, kernel_set):
    """Every (in_features, dtype) of the model's weights with K <= DENSE_MAX_K at the row blocks of 1 ..
    DENSE_MAX_ROWS tokens (the fp32 router up to 16), the dense MLPs' gated gate/up GEMM and W_UV at one token;
    nothing with skinny_gemm left out."""
    from deepinfer_npu.kernels_cuda import skinny_gemm as sk

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
    router_blocks = {sk.rows_block(m) for m in range(1, 17)}  # router_logits: up to 16 rows
    assert router_blocks == {1, 2, 4, 8}
    want |= {(2048, rb, False, False, "bfloat16", "float32", "float32", *v) for rb in router_blocks}
    # W_UV at one token (mla_epilogue): 16 heads, one row each, launched in blocks of two rows
    want.add((512, 2, False, True, "bfloat16", "bfloat16", "bfloat16", *v))
    assert (10944, 1, False, False, "bfloat16", "bfloat16", "bfloat16", *v) not in want
    assert len(got) == len(set(got)) and set(got) == want
    recorded.clear()
    kernel_set(skip={"skinny_gemm"}).warmup(v2_lite_plan(k=0, linear_weights=weights))
    assert "skinny_gemm" not in recorded


def test_packed_fp8_cache_compiles_the_fp8_variant(recorded, v2_lite_plan, kernel_set, reachable):
    """``kv_cache_dtype="fp8"``: the decode and prefill configurations of the bf16 plan, each as the FP8 variant
    (never the warp-specialized kernel). The prolog tail: on a Hopper mla_rope_cache (into scratch rows) and
    fp8_quant at the latent width; without fp8_quant (not a Hopper) the composed tail (rms_norm of the latent)."""
    plan = dataclasses.replace(v2_lite_plan(k=0), kv_cache_fp8=True)
    kernel_set().warmup(plan)
    cfgs = recorded["mla_decode"][0][0]
    decode = {md._normalize(c)[:5] for c in cfgs if not md._normalize(c)[3]}
    assert decode == {md._normalize(c)[:5] for c in expected_mla_decode(plan)}
    # twice the split count of the bf16 cache's where one wave of 16-row CTAs does not fill the SMs twice over
    assert md.default_num_splits(16, 16, 1, 66, SMS, True) == 2 * md.default_num_splits(16, 16, 1, 66, SMS) == 16
    assert all(md._normalize(c)[5:] == (False, True) for c in cfgs)
    assert [md._normalize(c)[:4] for c in cfgs if md._normalize(c)[3]] == PREFILL_4096
    assert "mla_rope_cache" not in recorded  # this machine: not a Hopper, fp8_quant is off
    assert (512, False, 1e-6) in recorded["rms_norm"][0][0]
    from deepinfer_npu.kernels_cuda import fp8_quant

    hopper = reachable(plan, sm90=True)
    assert hopper["mla_rope_cache"] == [(16, 192, 128, True, 1e-6), (16, 192, 128, True, 1e-6, 3648, 3648, 3072)]
    assert {fp8_quant.config_for(512, m) for m in (1, 600)} <= set(hopper["fp8_quant"])
    assert (512, False, 1e-6) not in hopper.get("rms_norm", [])
    assert "fp8_gemm" not in hopper  # bf16 weights


@pytest.fixture
def background(monkeypatch):
    """Worker processes allowed (4), and the background build replaced by a recorder: -> its calls."""
    from deepinfer_npu.backends.cuda import warmup, warmup_background

    calls: list[tuple] = []
    monkeypatch.setattr(warmup, "compile_workers", lambda num_jobs: 4 if num_jobs > 1 else 0)
    monkeypatch.setattr(warmup, "fill_disk_cache", lambda *a, **k: [])  # the foreground workers build nothing
    monkeypatch.setattr(warmup, "usable_cores", lambda: 16)
    monkeypatch.setattr(warmup_background, "start",
                        lambda configs, workers, fill, mark, key, on_failed:
                        calls.append((configs, fill.keywords["softmax_scale"], workers, fill.func, mark, key,
                                      on_failed)) or sum(len(c) for c in configs.values()))
    return calls


def test_prefill_on_decompressed_keys_leaves_the_absorbed_prefill_kernels_to_the_background(
        recorded, background, v2_lite_plan, kernel_set):
    """bf16 cache: prefill steps attend on decompressed keys (flash attention), so the absorbed path's 8 causal
    prefill configurations are only its fallback: built after start-up, in the background, not waited for."""
    from deepinfer_npu.backends.cuda import warmup

    plan = v2_lite_plan(k=0)
    ks = kernel_set()
    summary = ks.warmup(plan)
    (mla_cfgs, _kw), = recorded["mla_decode"]
    assert [c for c in mla_cfgs if len(c) == 4] == []  # not in the foreground
    assert set(mla_cfgs) == expected_mla_decode(plan)
    (configs, scale, workers, fill, mark, key, on_failed), = background
    assert configs == {"mla_decode": PREFILL_4096} and scale == pytest.approx(192**-0.5) and workers == 4
    assert fill == warmup.fill_disk_cache and mark.func == warmup.mark_compiled and key == scale
    assert mark.keywords == {"softmax_scale": scale}  # mla_decode is built per scale: its markers say which
    # a configuration that fails to build turns the absorbed prefill off: those steps take the reference
    assert "mla_prefill" not in ks.impl("mla_attention").off
    on_failed(["mla_decode (16, 8, 1, True): RuntimeError: nvcc exploded"])
    assert ks.impl("mla_attention").off["mla_prefill"].startswith("background build failed: mla_decode (16, 8")
    assert summary.split(";")[0].startswith("34 configs in ") and "mla_decode: 1," in summary.split(";")[0]
    assert summary.endswith("; 8 fallback-only configs (mla_decode: 8 (8 prefill)) building in the background "
                            "(8 in 4 processes)"), summary


@pytest.mark.parametrize("case", ["fp8-cache", "fp8-weights", "mla_prefill_mha-left-out", "float32"])
def test_prefill_kernels_stay_in_the_foreground_where_they_are_the_main_path(
        case, recorded, background, v2_lite_plan, kernel_set):
    """A packed FP8 cache, quantised projections (their layers run the absorbed attention), prefill on
    decompressed keys left out, or a float32 model: every prefill step runs the absorbed path's kernels, so
    start-up builds them (float32: no MLA kernel at all, nothing deferred)."""
    plan = v2_lite_plan(k=0)
    if case == "fp8-cache":
        plan = dataclasses.replace(plan, kv_cache_fp8=True)
    elif case == "fp8-weights":
        plan = dataclasses.replace(plan, quantization="fp8")
    elif case == "float32":
        plan = dataclasses.replace(plan, dtype=torch.float32)
    summary = kernel_set(skip={"mla_prefill_mha"} if case == "mla_prefill_mha-left-out" else ()).warmup(plan)
    assert background == [] and "background" not in summary
    if case != "float32":
        (mla_cfgs, _kw), = recorded["mla_decode"]
        assert len([c for c in mla_cfgs if len(c) > 3 and c[3] is True]) == 8


def test_without_worker_processes_the_fallback_kernels_are_built_in_the_foreground(
        recorded, background, monkeypatch, v2_lite_plan, kernel_set):
    """No worker process to spare (``compile_workers`` 0: one core, TileLang's disk cache off, or
    ``DEEPINFER_COMPILE_WORKERS=1``): nothing is deferred."""
    from deepinfer_npu.backends.cuda import warmup

    monkeypatch.setattr(warmup, "compile_workers", lambda num_jobs: 0)
    summary = kernel_set().warmup(v2_lite_plan(k=0))
    assert background == [] and "mla_decode: 9 (8 prefill)" in summary


@pytest.mark.parametrize("failures,marked", [
    ([], ["a", "b"]),
    (["mla_decode (16, 8, 1, True): RuntimeError: nvcc exploded"], ["b"]),  # the failed one is not marked
    (["a worker exited with -9"], []),  # which ones the dead worker built is unknown: none marked
], ids=["all-built", "one-failed", "worker-died"])
def test_the_background_build_marks_only_what_it_built(failures, marked):
    from deepinfer_npu.backends.cuda import warmup_background

    jobs = {"mla_decode": [(16, 8, 1, True), (16, 16, 1, True)]}
    names = {(16, 8, 1, True): "a", (16, 16, 1, True): "b"}
    got: list[str] = []
    reported: list[list[str]] = []
    warmup_background._build(jobs, 2, lambda configs, **kw: list(failures), lambda n, c: got.append(names[c]), True,
                             key="k", on_failed=reported.append)
    assert got == marked
    # a configuration that failed to build is reported (the warm-up then turns mla_prefill off); a dead worker is not
    assert reported == ([failures] if marked == ["b"] else [])
    # what was not built is released: a later engine of the process may try it again
    assert all(("k", "mla_decode", c) not in warmup_background._building for c, n in names.items() if n not in got)


def test_early_build_fills_the_cache_and_the_warm_up_waits_for_it(recorded, monkeypatch, v2_lite_plan, kernel_set):
    """``start_early`` (before the weights load): the plan's foreground configurations go to worker processes on a
    thread (here a recorder stands in for ``fill_disk_cache``), the fallback-only ones do not; the live kernel set's
    selection is untouched. The warm-up then waits for that build and finds every configuration marked compiled:
    it starts no worker of its own, and its serial pass loads them all as before."""
    import threading

    from deepinfer_npu.backends.cuda import warmup, warmup_background

    plan = v2_lite_plan(k=0)
    filled, release = [], threading.Event()

    def fill(configs, softmax_scale, workers, background=False, running=None):
        release.wait(10)  # the warm-up below must wait for this
        filled.append((configs, workers, background))
        return []

    monkeypatch.setattr(warmup, "fill_disk_cache", fill)
    monkeypatch.setattr(warmup, "compile_workers", lambda num_jobs: 3)
    ks = kernel_set()
    note = ks.start_early_warmup(plan)
    assert note.endswith("configurations building in 3 processes"), note
    assert ks.config is None  # the probe selected, not the live set
    started = int(note.split()[0])
    threading.Timer(0.3, release.set).start()
    real_workers = []
    monkeypatch.setattr(warmup, "compile_workers", lambda num_jobs: real_workers.append(num_jobs) or 0)
    summary = ks.warmup(plan)
    (configs, workers, background), = filled
    assert workers == 3 and background is True  # the lowest CPU priority: the weight load comes first
    assert sum(len(c) for c in configs.values()) == started
    assert all(len(c) != 4 for c in configs.get("mla_decode", []))  # the fallback-only prefill: after ready
    # with no workers (this stand-in) the fallback-only configurations are built now; nothing else is pending
    deferred = sum(1 for c in ks.warmup_configs(plan, SMS)["mla_decode"] if len(c) == 4)
    assert deferred and real_workers == [deferred, deferred], (real_workers, deferred)
    assert summary.startswith(f"{started + deferred} configs in "), (summary, started)
    assert warmup_background.wait_key(("early", float(plan.softmax_scale)), 0)


def test_early_build_without_workers_starts_nothing(recorded, v2_lite_plan, kernel_set):
    ks = kernel_set()
    note = ks.start_early_warmup(v2_lite_plan(k=0))
    assert note.startswith("not started: ") and note.endswith("configurations to build, no worker processes")
