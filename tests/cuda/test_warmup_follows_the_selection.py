"""What the warm-up compiles follows the selection: each kernel variant's configurations are there when the
implementation serves the engine (by default) and absent when the selection leaves it out or the device cannot run
it (mla_decode_ws: Hopper only). Recorders stand in for the compilers, as in test_kernel_warmup_configs.py."""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.hal.types import GatingParams
from deepinfer_npu.kernels_cuda import mla_decode as md

pytestmark = pytest.mark.tilelang


def test_mla_decode_ws_configs_follow_the_selection_and_the_device(v2_lite_plan, reachable):
    """On a Hopper device every 64-row decode configuration carries the warp-specialized flag (16-row tiles and
    prefill do not change); left out, or on another device: none."""
    plan = v2_lite_plan(k=3, varlen=True, method="dflash")
    base = reachable(plan, sm90=True, skip={"mla_decode_ws"})["mla_decode"]
    assert not any(len(c) == 6 for c in base)
    ws = reachable(plan, sm90=True)["mla_decode"]
    want = {c + (False, md.BLOCK_M, True) if len(c) == 3 else c for c in base}
    assert set(ws) == want and any(len(c) == 6 for c in ws) and any(len(c) == 4 for c in ws)
    small = reachable(v2_lite_plan(k=0), sm90=True)["mla_decode"]  # one token of 16 heads: the 16-row tile
    assert small == reachable(v2_lite_plan(k=0), sm90=True, skip={"mla_decode_ws"})["mla_decode"]
    assert any(len(c) == 5 for c in small)
    assert reachable(plan, sm90=False)["mla_decode"] == base


def test_warm_up_on_a_hopper_device_takes_mla_decode_ws(recorded, monkeypatch, v2_lite_plan, kernel_set, reachable):
    """warmup asks the device: on compute capability 9.x the 64-row decode configurations carry the flag."""
    plan = v2_lite_plan(k=3, varlen=True, method="dflash")
    monkeypatch.setattr("deepinfer_npu.backends.cuda.kernels.current_device_is_sm90", lambda: True)
    kernel_set().warmup(plan)
    (cfgs, _kw), = recorded["mla_decode"]
    assert cfgs == reachable(plan, sm90=True)["mla_decode"]
    assert any(len(c) == 6 and c[5] for c in cfgs)


MOE_VARIANTS = {"moe_gemm_swap", "moe_combine_add", "moe_dispatch_scan"}


def test_moe_gemm_swap_configs(recorded, v2_lite_plan, kernel_set):
    """w13 (gated) and w2 at the row tiles of 6 .. 1280 rows (1 .. 213 tokens x top-6, up to 20 rows an expert:
    prefill steps of a few prompts reach them), and moe_gemm's own configurations still (larger steps); nothing of
    it when left out."""
    from deepinfer_npu.kernels_cuda import moe_gemm_swap as sw

    kernel_set().warmup(v2_lite_plan(k=0))
    (cfgs, _kw), = recorded["moe_gemm_swap"]
    assert cfgs == [(2816, 2048, 8, True, 64), (2048, 1408, 8, False, 64),
                    (2816, 2048, 16, True, 64), (2048, 1408, 16, False, 64),
                    (2816, 2048, 32, True, 64), (2048, 1408, 32, False, 64)]
    assert all(sw.config_for(*c[:2], r, c[3], 64) in cfgs for c in cfgs for r in (6, 64, 1280))
    assert ("gemm", (2816, 2048, 64, 3, True)) in recorded["moe_gemm"]
    recorded.clear()
    kernel_set(skip=MOE_VARIANTS).warmup(v2_lite_plan(k=0))
    assert "moe_gemm_swap" not in recorded


def test_moe_gemm_w13_gated_follows_the_setting(recorded, v2_lite_plan, kernel_set, monkeypatch):
    """moe_gemm's w13 configuration fuses the SwiGLU by default; ``DEEPINFER_MOE_GEMM_GATED=0`` warms the plain
    GEMM (then silu_mul) instead."""
    kernel_set().warmup(v2_lite_plan(k=0, max_num_seqs=256))
    assert recorded["moe_gemm"][0] == ("gemm", (2816, 2048, 64, 3, True))
    monkeypatch.setenv("DEEPINFER_MOE_GEMM_GATED", "0")
    recorded.clear()
    kernel_set().warmup(v2_lite_plan(k=0, max_num_seqs=256))
    assert recorded["moe_gemm"][0] == ("gemm", (2816, 2048, 128))
    assert ("gemm", (2816, 2048, 64, 3, True)) not in recorded["moe_gemm"]


@pytest.mark.parametrize("swap,gated,want", [
    ("auto", "1", [(1408, False)]),  # past 2048 rows only (torch._grouped_mm)
    ("auto", "0", [(1408, False)]),  # moe_gemm + silu_mul from 1281 rows: the tile variant
    ("0", "1", [(1408, False)]),
    ("0", "0", [(1408, True), (1408, False)]),  # moe_gemm + silu_mul from one token's 6 rows: the row variant too
])
def test_expert_width_silu_mul_where_a_step_reaches_it(recorded, v2_lite_plan, kernel_set, monkeypatch, swap, gated,
                                                       want):
    """``silu_mul`` at the routed experts' width (1408) is warmed only for the row counts neither moe_gemm_swap nor
    the gated moe_gemm takes (prefill steps of 16384 tokens reach torch._grouped_mm's 98304 rows)."""
    monkeypatch.setenv("DEEPINFER_MOE_SWAP_MAX_ROWS", swap)
    monkeypatch.setenv("DEEPINFER_MOE_GEMM_GATED", gated)
    kernel_set().warmup(v2_lite_plan(k=0, max_num_seqs=256))
    (cfgs, _kw), = recorded["silu_mul"]
    assert [c for c in cfgs if c[0] == 1408] == want


def test_quantised_experts_warm_none_of_the_bf16_expert_kernels(reachable, v2_lite_plan):
    """FP8 (or W8A8) experts run the scheme's grouped MLP: moe_gemm, moe_gemm_swap and silu_mul at the experts' width
    are not built for them (10 configurations on V2-Lite); the dense MLPs' silu_mul widths stay."""
    import dataclasses

    bf16 = reachable(v2_lite_plan(k=0), sm90=True)
    fp8 = reachable(dataclasses.replace(v2_lite_plan(k=0), quantization="fp8"), sm90=True)
    assert any(kind == "gemm" for kind, _c in bf16["moe_gemm"]) and bf16["moe_gemm_swap"]
    assert (1408, False) in bf16["silu_mul"]
    # the FP8 experts keep moe_gemm's expert scan (fp8_grouped_mlp's row starts) and their own GEMMs
    assert fp8["moe_gemm"] == [("expert_scan", (64,))] and fp8["fp8_grouped_gemm"]
    assert "moe_gemm_swap" not in fp8
    assert all(width != 1408 for width, _variant in fp8["silu_mul"]) and (10944, False) in fp8["silu_mul"]


def test_moe_gemm_swap_row_tiles_follow_the_batch_and_the_setting(recorded, v2_lite_plan, kernel_set, monkeypatch):
    """256 sequences: up to 20 rows an expert (1280 rows, 213 tokens) on moe_gemm_swap, 32-row tiles from 114
    tokens; ``DEEPINFER_MOE_SWAP_MAX_ROWS`` caps the rows (0: never)."""
    kernel_set().warmup(v2_lite_plan(k=0, max_num_seqs=256))
    (cfgs, _kw), = recorded["moe_gemm_swap"]
    assert sorted({c[2] for c in cfgs}) == [8, 16, 32]
    monkeypatch.setenv("DEEPINFER_MOE_SWAP_MAX_ROWS", "64")
    recorded.clear()
    kernel_set().warmup(v2_lite_plan(k=0, max_num_seqs=256))
    (cfgs, _kw), = recorded["moe_gemm_swap"]
    assert sorted({c[2] for c in cfgs}) == [8, 16]
    monkeypatch.setenv("DEEPINFER_MOE_SWAP_MAX_ROWS", "0")
    recorded.clear()
    kernel_set().warmup(v2_lite_plan(k=0, max_num_seqs=256))
    assert not recorded.get("moe_gemm_swap")


@pytest.mark.parametrize("variant, fused", [
    ("moe_combine_add", ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True))),  # shared experts added
    ("moe_dispatch_scan", ("permute", (2048, 6, 64, "bfloat16", 128, True))),  # the expert GEMMs' scan written too
])
def test_fused_moe_routing_variants(recorded, variant, fused, v2_lite_plan, kernel_set):
    kernel_set().warmup(v2_lite_plan(k=0))
    assert fused in recorded["moe_routing"][0][0]
    recorded.clear()
    kernel_set(skip={variant}).warmup(v2_lite_plan(k=0))
    assert fused not in recorded["moe_routing"][0][0]


def test_moe_route_configs(recorded, v2_lite_plan, kernel_set):
    """The gating fused with the permute: one build; no ("route", cfg) build when left out."""
    from deepinfer_npu.kernels_cuda import moe_routing as mr

    kernel_set(skip={"moe_route"}).warmup(v2_lite_plan(k=0))
    assert all(kind != "route" for kind, _cfg in recorded["moe_routing"][0][0])
    recorded.clear()
    kernel_set().warmup(v2_lite_plan(k=0))
    routes = [cfg for kind, cfg in recorded["moe_routing"][0][0] if kind == "route"]
    gating = GatingParams(num_experts=64, top_k=6, scoring_func="softmax", topk_method="greedy", n_group=1,
                          topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    assert routes == [mr._route_cfg(gating, 2048, "bfloat16", True)]


def test_w_uv_skinny_configuration(recorded, v2_lite_plan, kernel_set, monkeypatch):
    """mla_epilogue's W_UV at one token: the warm-up lists the key skinny_gemm's launch of one row a head (16 heads,
    V2-Lite) takes, found by running the launch code with the kernel stood in for."""
    from deepinfer_npu.kernels_cuda import skinny_gemm as sk

    launched = []
    monkeypatch.setattr(sk, "reason", lambda *a: None)
    monkeypatch.setattr(sk, "get_kernel", lambda *cfg: launched.append(cfg) or (lambda *tensors: None))
    heads, rank, v_dim = 16, 512, 128
    scan = torch.cat([torch.arange(heads + 1), torch.arange(heads)]).int()
    sk.skinny_gemm(torch.zeros(heads, rank, dtype=torch.bfloat16),
                   torch.zeros(heads, v_dim, rank, dtype=torch.bfloat16), scan=scan)
    assert launched == [(rank, 2, False, True, "bfloat16", "bfloat16", "bfloat16", *sk.default_variant())]
    kernel_set().warmup(v2_lite_plan(k=0))
    assert launched[0] in recorded["skinny_gemm"][0][0]


def test_decode_inputs_configs(recorded, v2_lite_plan, kernel_set):
    """One build for the page size; nothing when left out."""
    from deepinfer_npu.kernels_cuda import decode_inputs as di

    kernel_set().warmup(v2_lite_plan(k=0))
    assert recorded["decode_inputs"] == [([(64, di.THREADS)], {})]
    recorded.clear()
    kernel_set(skip={"decode_inputs"}).warmup(v2_lite_plan(k=0))
    assert "decode_inputs" not in recorded


def test_mla_absorb_configs(recorded, v2_lite_plan, kernel_set):
    """W_UK of one token: one build for the model's dims; none for an fp32 model or when left out."""
    from deepinfer_npu.kernels_cuda import mla_absorb as ma

    kernel_set().warmup(v2_lite_plan(k=0))
    assert recorded["mla_absorb"] == [([ma.config_for(16, 128, 512, 192)], {})]
    recorded.clear()
    kernel_set().warmup(v2_lite_plan(k=0, dtype=torch.float32))
    assert "mla_absorb" not in recorded
    kernel_set(skip={"mla_absorb"}).warmup(v2_lite_plan(k=0))
    assert "mla_absorb" not in recorded
