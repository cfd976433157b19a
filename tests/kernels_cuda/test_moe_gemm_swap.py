"""kernels_cuda.moe_gemm_swap: the swapped-operand expert GEMM (weight tile on wgmma's M side, SwiGLU fused into
w13) against its fp32 reference on a CUDA device (bf16 within 2 ulp of |ref| + 1e-2,
gated 4 ulp; NaN positions equal; cosine > 0.99999); on the CPU: its gated reference equals the CPU backend's
expert MLP arithmetic, and bad shapes are rejected with the dims named."""

import pytest
import torch

from deepinfer_npu.kernels_cuda import moe_gemm_swap as sw
from deepinfer_npu.kernels_cuda._testing import close_to, expert_rows, grouped_gemm_fp32, grouped_mlp_gate_fp32

# (tokens, top_k, experts, N, K, skew, gated, (block_n, stages) or None for the engine's choice); skew: one expert
# gets every token, so it loops over row tiles (gated and not)
CASES = [(1, 6, 64, 2816, 2048, False, True, None), (1, 6, 64, 2048, 1408, False, False, None),
         (2, 6, 64, 2816, 2048, False, True, None), (7, 6, 64, 2048, 1408, False, False, None),
         (10, 6, 64, 2816, 2048, True, True, None), (5, 8, 256, 4096, 7168, False, True, None),
         (40, 2, 16, 256, 512, True, False, None), (20, 2, 16, 256, 512, True, True, None)]
CASES += [(1, 6, 64, 2816, 2048, False, True, (bn, st)) for bn in (64, 128) for st in (3, 6)]
CASES += [(4, 6, 64, 2048, 1408, False, False, (128, 3))]


def reference(a, w, tokens_per_expert, gated=False):
    """fp32 reference (gated: the roundings of the kernel's epilogue, i.e. of the CPU reference's SwiGLU)."""
    if gated:
        return grouped_mlp_gate_fp32(a, w, tokens_per_expert)
    return grouped_gemm_fp32(a, w, tokens_per_expert)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[2]}-N{c[3]}-K{c[4]}-g{int(c[6])}-{c[7]}")
def test_moe_gemm_swap_matches_fp32_reference_gpu(case):
    """bf16 within 2 ulp of |ref| + 1e-2 (gated: 4 ulp, the extra roundings); NaN positions equal; cosine >
    0.99999."""
    from deepinfer_npu.kernels_cuda.moe_gemm import expert_starts

    tokens, top_k, experts, n, k, skew, gated, tune = case
    a, w, counts = expert_rows(tokens, top_k, experts, n, k, skew=skew)
    ref = reference(a, w, counts, gated)
    bn, st = tune or (None, None)
    out = sw.moe_gemm_swap(a, w, expert_starts(counts), gated=gated, block_n=bn, num_stages=st)
    ok, stats = close_to(out, ref, (4 if gated else 2) * 2.0**-8 * ref.abs() + 1e-2)
    assert ok, stats


# batch-decode sizes at row tiles of 32 and 64 (tokens, top_k, experts, N, K, skew, gated, rows tile); skew: one
# expert holds every token and loops over the tile
WIDE = [(200, 6, 64, 2816, 2048, False, True, 32), (200, 6, 64, 2048, 1408, False, False, 32),
        (256, 6, 64, 2816, 2048, False, True, 64), (100, 6, 64, 2048, 1408, True, False, 64),
        (100, 6, 64, 2816, 2048, True, True, 32)]


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", WIDE, ids=lambda c: f"T{c[0]}-N{c[3]}-g{int(c[6])}-skew{int(c[5])}-rt{c[7]}")
def test_wide_row_tiles_match_fp32_reference_gpu(case):
    from deepinfer_npu.kernels_cuda.moe_gemm import expert_starts

    tokens, top_k, experts, n, k, skew, gated, rt = case
    a, w, counts = expert_rows(tokens, top_k, experts, n, k, skew=skew)
    ref = reference(a, w, counts, gated)
    out = sw.moe_gemm_swap(a, w, expert_starts(counts), gated=gated, rows_tile_=rt)
    ok, stats = close_to(out, ref, (4 if gated else 2) * 2.0**-8 * ref.abs() + 1e-2)
    assert ok, stats


def test_gated_reference_is_the_cpu_expert_mlp():
    """Small integers keep every GEMM exact, so the reference's roundings must equal the CPU backend's
    silu_and_mul(bf16 GEMM) bit for bit."""
    from deepinfer_npu.backends.cpu.linear import silu_and_mul

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([2, 0, 3, 1])
    a = torch.randint(-2, 3, (6, 64), generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (4, 2 * 64, 64), generator=g).to(torch.bfloat16) * 0.125
    got = reference(a, w, counts, gated=True)
    want, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            want.append(silu_and_mul(a[start : start + c] @ w[e].t()).float())
        start += c
    assert torch.equal(got, torch.cat(want))


def test_rejects_bad_shapes_with_the_dims_named():
    a = torch.zeros(3, 64, dtype=torch.bfloat16)
    scan = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="K=64"):
        sw.moe_gemm_swap(a, torch.zeros(2, 128, 128, dtype=torch.bfloat16), scan)
    with pytest.raises(ValueError, match=r"int32 \[2E\+1\]"):
        sw.moe_gemm_swap(a, torch.zeros(2, 128, 64, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="N=96"):
        sw.moe_gemm_swap(a, torch.zeros(2, 96, 64, dtype=torch.bfloat16), scan, gated=True)
    with pytest.raises(ValueError, match="rows_tile_=24"):
        sw.moe_gemm_swap(a, torch.zeros(2, 128, 64, dtype=torch.bfloat16), scan, rows_tile_=24)


def test_row_tiles():
    assert [sw.rows_tile(m) for m in (1, 6, 8, 9, 48)] == [8, 8, 8, 16, 16]
    # by an expert's mean rows past 64 rows: 64 tokens x top-6 of 64 experts = 6 a mean (16), 128 tokens = 12 (32)
    assert [sw.rows_tile(t * 6, 64) for t in (64, 113, 114, 200, 341)] == [16, 16, 32, 32, 32]
    assert sw.config_for(2816, 2048, 1200, True, 64) == (2816, 2048, 32, True, 64)
    assert sw.config_for(2816, 2048, 6, True) == (2816, 2048, 8, True, 64)
