"""kernels_cuda.fp8_quant and kernels_cuda.fp8_gemm (DeepGEMM's FP8 numerics: 1 x 128 activation groups, 128 x 128
weight blocks, fp32 promotion per 128-wide K block).

Tolerances, against the fp32 product of the dequantised operands (``dequantize_per_token_group`` and
``dequantize_fp8_block``; TF32 off):
- ``fp8_quant``: bit-exact to ``quantize_per_token_group`` (the e4m3 bytes and the fp32 scales) run on the CPU;
  torch's CUDA division by a scalar multiplies by the reciprocal, one ulp off IEEE division for some scales, and
  the kernel divides as IEEE and the CPU do.
- ``fp8_gemm`` (bf16 out): every element within ``2**-8 * |ref| + 2**-12 * (|a| @ |w|.T) + 1e-4 * max|ref|``:
  one bf16 rounding, plus the accumulation inside each 128-wide K block, which Hopper's fp8 wgmma keeps to about
  14 mantissa bits before the fp32 promotion (DeepSeek-V3 report, section 3.3.2), so an element may move by a few
  2**-14 of the sum of its products' magnitudes; cosine >= 0.99999. The operands carry random per-group and
  per-block magnitudes, so a scale applied to the wrong row, column or K block fails both.
Shapes: the DeepSeek-V2-Lite projections (q_proj, kv_a_proj, o_proj, the dense down projection with K = 10944, a
partial last K block) and V3's (q_a / q_b, kv_a, o_proj, the dense gate/up and down), at M in {1, 16, 64, 512, 4096}.

GPU tier: ``pytest -m gpu tests/kernels_cuda/test_fp8_gemm.py tests/kernels_cuda/test_fp8_grouped_gemm.py
tests/cuda/test_fp8_quant_ops.py``; the selected cases' configurations compile once per module, in worker processes,
before the first case (TileLang's disk cache makes a rerun fast). Without a GPU, tests/kernels_cuda/test_compile.py
builds every form (CI_CONFIGS) for sm_90a and sm_100a and checks the fp8 wgmma and the PDL wait.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from deepinfer_npu.kernels_cuda import fp8_gemm, fp8_quant
from deepinfer_npu.kernels_cuda.bench import precompile_in_processes
from deepinfer_npu.model_executor.quantization.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_per_token_group,
    quantize_fp8_block,
    quantize_per_token_group,
)

ROWS = (1, 16, 64, 512, 4096)
SHAPES = {  # name: (N, K)
    "v2lite-q_proj": (3072, 2048), "v2lite-kv_a_proj": (576, 2048), "v2lite-dense-down": (2048, 10944),
    "v3-q_b_proj": (24576, 1536), "v3-kv_a_proj": (576, 7168), "v3-o_proj": (7168, 16384),
    "v3-dense-down": (7168, 18432),
}
QUANT_CASES = [(2048, False), (7168, False), (10944, False), (1408, True), (2048, True), (10944, True)]


# ---- operands and the fp32 reference (shared with test_fp8_grouped_gemm.py) ------------------------------------
def activations(m: int, k: int, device="cuda", seed=0) -> torch.Tensor:
    """bf16 [m, k]: normal values times a random magnitude per 1 x 128 group (2**-6 .. 2**6), so every group gets
    its own scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    groups = -(-k // 128)
    mag = torch.exp2(torch.randint(-6, 7, (m, groups), generator=g, device=device).float())
    return (torch.randn(m, k, generator=g, device=device) * mag.repeat_interleave(128, 1)[:, :k]).bfloat16()


@functools.lru_cache(maxsize=8)
def fp8_weight(*lead: int, n: int, k: int, device="cuda", seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [*lead, n, k], block scales [*lead, ceil(n/128), ceil(k/128)]) of a weight with a random magnitude per
    128 x 128 block; cached (the cases only read it). Built one [n, k] slice at a time: the fp32 temporaries of a
    whole V3-size expert stack (32 x 4096 x 7168) were ~15 GB a call, too much with many test processes on one GPU."""
    g = torch.Generator(device=device).manual_seed(seed)
    nb, kb = -(-n // 128), -(-k // 128)
    q = torch.empty(math.prod(lead), n, k, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(math.prod(lead), nb, kb, dtype=torch.float32, device=device)
    for i in range(q.shape[0]):
        mag = torch.exp2(torch.randint(-4, 5, (nb, kb), generator=g, device=device).float())
        mag = mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        q[i], s[i] = quantize_fp8_block(torch.randn(n, k, generator=g, device=device) * k**-0.5 * mag)
    return q.view(*lead, n, k), s.view(*lead, nb, kb)


def gemm_fp32(aq, a_scale, wq, w_scale, magnitude: bool = False) -> torch.Tensor:
    """The fp32 product of the dequantised operands; ``magnitude``: of their absolute values (``|a| @ |w|.T``, the
    scale of the accumulation error)."""
    a, w = dequantize_per_token_group(aq, a_scale), dequantize_fp8_block(wq, w_scale)
    return a.abs() @ w.abs().t() if magnitude else a @ w.t()


#: fp8 wgmma accumulation error per unit of ``|a| @ |w|.T`` (about 14 mantissa bits inside a 128-wide K block)
WGMMA_FP8_ACCUM = 2.0**-12


def check_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 2.0**-8, floor: float = 1e-4, cos: float = 0.99999,
                magnitude: torch.Tensor | None = None):
    """Every element within ``rel * |ref| + WGMMA_FP8_ACCUM * magnitude + floor * max|ref|`` (``magnitude``: the
    product of the operands' absolute values, when given) and the cosine at least ``cos``."""
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all(), "non-finite output"
    err = (out - ref).abs()
    tol = rel * ref.abs() + floor * ref.abs().max()
    if magnitude is not None:
        tol = tol + WGMMA_FP8_ACCUM * magnitude.float()
    c = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item() if ref.numel() else 1.0
    assert int((err > tol).sum()) == 0 and c >= cos, dict(max_err=err.max().item(), beyond=int((err > tol).sum()),
                                                         max_ref=ref.abs().max().item(), cos=c)


# ---- everywhere --------------------------------------------------------------------------------------------------
def test_rejects_bad_operands_with_the_parameter_named():
    a, sa = torch.zeros(3, 256, dtype=FP8_DTYPE), torch.zeros(3, 2)
    w, sw = torch.zeros(128, 256, dtype=FP8_DTYPE), torch.zeros(1, 2)
    with pytest.raises(ValueError, match="K=256 but w is"):
        fp8_gemm.fp8_gemm(a, sa, torch.zeros(128, 128, dtype=FP8_DTYPE), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="N=100"):
        fp8_gemm.fp8_gemm(a, sa, torch.zeros(100, 256, dtype=FP8_DTYPE), sw)
    with pytest.raises(ValueError, match=r"a_scale \[3, 2\]"):
        fp8_gemm.fp8_gemm(a, torch.zeros(3, 1), w, sw)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm.fp8_gemm(a.float(), sa, w, sw)
    with pytest.raises(ValueError, match="K=8"):
        fp8_quant.quantize(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D bf16"):
        fp8_quant.quantize(torch.zeros(2, 128))


def test_configurations_by_rows():
    assert fp8_gemm.configs_for(2048, 2048, 1) == [("swap", (2048, 2048, 16, 4)), ("reduce", (2048, 4, 256))]
    assert fp8_gemm.configs_for(7168, 16384, 64) == [("swap", (7168, 16384, 64, 1))]  # 112 tiles: no slicing
    assert fp8_gemm.configs_for(576, 7168, 1)[0] == ("swap", (576, 7168, 16, 14))  # 9 tiles x 14 slices
    assert fp8_gemm.configs_for(2048, 2048, 65) == [("tile", (2048, 2048, 128, 128))]
    assert fp8_gemm.configs_for(576, 7168, 4096) == [("tile", (576, 7168, 128, 64))]
    assert fp8_quant.config_for(1408, 6, gated=True) == (1408, 8, True)
    assert fp8_gemm.reason(1, 2048, 10944) is None and "multiple of 16" in fp8_gemm.reason(1, 2048, 1000)


# ---- GPU ---------------------------------------------------------------------------------------------------------
def selected_params(request) -> list[dict]:
    """The parameters of this module's selected cases that use the ``compiled`` fixture."""
    return [item.callspec.params for item in request.session.items
            if item.module is request.module and "compiled" in item.fixturenames and hasattr(item, "callspec")]


@pytest.fixture(scope="module")
def compiled(request):
    """The configurations the selected GPU cases launch, compiled in parallel once (the GEMM cases' activations
    are quantised by the reference, so only the quant cases compile fp8_quant)."""
    params = selected_params(request)
    precompile_in_processes(
        [("fp8_gemm", c) for p in params if "name" in p for c in fp8_gemm.configs_for(*SHAPES[p["name"]], p["m"])]
        + [("fp8_quant", fp8_quant.config_for(p["k"], p["m"], p["gated"])) for p in params if "gated" in p])


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("k,gated", QUANT_CASES)
@pytest.mark.parametrize("m", ROWS)
def test_quant_is_bit_exact_to_the_reference_gpu(compiled, m, k, gated):
    x = activations(m, 2 * k if gated else k, seed=m + k)
    x[0, :5] = 0  # a zero group start; and a group of zeros where there is one
    if k >= 256:
        x[-1, 128:256] = 0
    q, s = fp8_quant.quantize(x, gated=gated)
    src = x.float()
    if gated:  # silu_mul's roundings, then the quantisation of the bf16 product
        g, u = x.chunk(2, dim=-1)
        src = (torch.nn.functional.silu(g) * u).float()
    q_ref, s_ref = quantize_per_token_group(src.cpu())
    assert torch.equal(s.cpu(), s_ref), (s.cpu() - s_ref).abs().max()
    codes, codes_ref = q.cpu().view(torch.uint8), q_ref.view(torch.uint8)
    assert torch.equal(codes, codes_ref), f"{int((codes != codes_ref).sum())} codes differ"


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemm_matches_fp32_reference_gpu(compiled, name, m):
    n, k = SHAPES[name]
    aq, sa = quantize_per_token_group(activations(m, k, seed=m))
    wq, sw = fp8_weight(n=n, k=k)
    check_close(fp8_gemm.fp8_gemm(aq, sa, wq, sw), gemm_fp32(aq, sa, wq, sw),
                magnitude=gemm_fp32(aq, sa, wq, sw, magnitude=True))


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("m", [17, 48, 100, 300])
def test_partial_row_tiles_of_the_default_forms_gpu(m):
    """Row counts that leave the last 64-row swapped tile or 128-row tile partial (rows past M read as zeros
    from the TMA unit and are not stored)."""
    n, k = SHAPES["v2lite-q_proj"]
    aq, sa = quantize_per_token_group(activations(m, k, seed=m))
    wq, sw = fp8_weight(n=n, k=k)
    check_close(fp8_gemm.fp8_gemm(aq, sa, wq, sw), gemm_fp32(aq, sa, wq, sw),
                magnitude=gemm_fp32(aq, sa, wq, sw, magnitude=True))


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("config", [("swap", (3072, 2048, 16, 1)), ("swap", (3072, 2048, 16, 8)),
                                    ("tile", (3072, 2048, 128, 64))])
def test_other_forms_on_row_counts_they_do_not_divide_gpu(config):
    """The swapped form looping over row tiles (100 rows in tiles of 16), unsliced and in 8 K slices, and
    64-wide tiles over 1 row."""
    for m in (1, 100):
        aq, sa = quantize_per_token_group(activations(m, 2048, seed=m))
        wq, sw = fp8_weight(n=3072, k=2048)
        check_close(fp8_gemm.fp8_gemm(aq, sa, wq, sw, config=config), gemm_fp32(aq, sa, wq, sw),
                    magnitude=gemm_fp32(aq, sa, wq, sw, magnitude=True))


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("rt,split", [(16, 1), (16, 4), (64, 2)])
def test_staged_scales_give_the_same_bits_as_global_reads_gpu(rt, split):
    """The swapped form with its scales staged in shared memory (the default) against the same form reading them
    from global memory in the promotion: the same products and sums, so bit-equal, at row counts that fill a row
    tile, leave it partial and loop over several (the staging is redone for each row tile)."""
    n, k = 3648, 2048  # V2-Lite's q + kv_a projection
    wq, sw = fp8_weight(n=n, k=k)
    staged, unstaged = ("swap", (n, k, rt, split)), ("swap", (n, k, rt, split, 64, 4, 128, False))
    precompile_in_processes([("fp8_gemm", c) for c in (staged, unstaged)])
    for m in (1, rt - 1, rt, 3 * rt + 5):
        aq, sa = quantize_per_token_group(activations(m, k, seed=m))
        a = fp8_gemm.fp8_gemm(aq, sa, wq, sw, config=staged)
        b = fp8_gemm.fp8_gemm(aq, sa, wq, sw, config=unstaged)
        assert torch.equal(a, b), (m, int((a != b).sum()))
        check_close(a, gemm_fp32(aq, sa, wq, sw), magnitude=gemm_fp32(aq, sa, wq, sw, magnitude=True))
