"""kernels_cuda.mla_decode's FP8 variant (``kv_cache_dtype="fp8"``): a packed cache of FlashMLA's 656-byte rows (512
e4m3 latent values, 4 fp32 scales, 64 bf16 RoPE values), read through three views of its bytes; each page's latents
are dequantised to bf16 in shared memory before the two GEMMs.

The oracle is test_mla_decode.py's fp32 attention over the cache the kernel sees: the packed rows unpacked by the
CPU reference (``unpack_fp8_latents``) and rounded to bf16 (the kernel's tile dtype); the tolerances are that test's
(cosine deficit < 1e-5, 2 bf16 ulps of |ref| + rms(ref), 3 for prefill; lse within 0.25 ulps). A wrong scale
group, byte offset or page moves whole rows by their own size.
"""

import pytest
import torch

from deepinfer_npu.kernels_cuda import mla_decode as mla
from deepinfer_npu.kernels_cuda._testing import mla_paged
from deepinfer_npu.model_executor.quantization.kv_fp8 import (
    fp8_latent_row_bytes,
    pack_fp8_latents,
    unpack_fp8_latents,
)

from tests.kernels_cuda.test_mla_decode import HEAD_DIM, KV_LORA, PREFILL_OUT_ULPS, compare, mla_decode_ref

ROPE = HEAD_DIM - KV_LORA

# (batch, heads, seqlens_k, seqlens_q, num_splits): the 16-row tile (one token of 16 heads), a 64-row tile of 16 heads
# (4 query tokens), 128 heads with splits and the combine, a varlen batch of 16 heads with splits
DECODE_CASES = [(4, 16, 1000, 1, 1), (5, 16, 777, 4, 1), (3, 128, 64, 1, 3), (4, 128, 1500, 2, 1),
                (6, 16, [700, 64, 1500, 2, 3000, 129], [1, 1, 1, 1, 1, 1], 3)]
PREFILL_CASES = [(3, 16, 1000, 257), (2, 128, 300, 300)]  # chunked prefill after a context; whole prompts


def packed(inp: dict) -> tuple[dict, torch.Tensor]:
    """``inp`` with its bf16 cache packed into FP8 rows (on the CPU: IEEE division, as the reference writes them)
    -> (inputs for the kernel, the bf16 cache the kernel computes with)."""
    kv = inp["kv_cache"]
    rows = pack_fp8_latents(kv.reshape(-1, HEAD_DIM).float().cpu(), KV_LORA)
    assert rows.shape[-1] == fp8_latent_row_bytes(KV_LORA, ROPE) == mla.FP8_ROW_BYTES
    seen = unpack_fp8_latents(rows, KV_LORA, ROPE).to(torch.bfloat16).view(kv.shape).to(kv.device)
    return {**inp, "kv_cache": rows.view(kv.shape[0], kv.shape[1], -1).to(kv.device)}, seen


def test_fp8_views_and_configs():
    cache = torch.zeros(3, mla.PAGE, mla.FP8_ROW_BYTES, dtype=torch.uint8)
    lat, sc, pe = mla.fp8_views(cache)
    assert lat.dtype == torch.float8_e4m3fn and sc.shape[-1] == 164 and pe.shape[-1] == 328
    assert sc.shape[-1] > mla.FP8_SCALE_OFFSET + 3 and pe.shape[-1] == mla.FP8_PE_OFFSET + ROPE
    with pytest.raises(ValueError, match="contiguous uint8"):
        mla.fp8_views(torch.zeros(3, mla.PAGE, HEAD_DIM, dtype=torch.bfloat16))
    # never the warp-specialized kernel; the engine's tile size either way
    small = (16, 1, mla.DYNAMIC_SPLITS, False, mla.SMALL_BLOCK_M, False, True)
    assert mla.decode_config(16, 1, 32, True, kv_fp8=True) == small
    assert mla.decode_config(128, 1, 1, True, kv_fp8=True) == (128, 2, 1, False, 64, False, True)


SMEM_LIMIT = 227 * 1024  # dynamic shared memory a Hopper CTA may hold


@pytest.mark.nvcc
@pytest.mark.tilelang
def test_fp8_variant_compiles_within_the_shared_memory_gpu_free():
    """The 64-row FP8 tile (128 heads) for sm_90a: the packed rows load through the TMA unit (the e4m3 latents,
    their fp32 scales and the bf16 RoPE values), and the double-buffered staging tiles fit the shared memory
    (whole-page tiles did not: 288 KB)."""
    import re

    (kernel,) = mla.ci_compile([(128, 2, 1, False, 64, False, True)])
    src = kernel.get_kernel_source()
    assert "mla_decode_split_fp8" in src and all(f"{v}_desc" in src for v in ("KV8", "KVs", "KVr"))
    offsets = [int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)]
    assert offsets and max(offsets) < SMEM_LIMIT - 8 * 1024, max(offsets)  # the last buffers are a few KB


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("i,case", list(enumerate(DECODE_CASES)), ids=lambda c: str(c)[:40] if isinstance(c, tuple)
                         else str(c))
def test_fp8_cache_decode_matches_reference_gpu(i, case):
    batch, heads, seqlens_k, seqlens_q, splits = case
    inp, seen = packed(mla_paged(batch, heads, seqlens_k, seqlens_q, seed=300 + i))
    tq = inp["q_latent"].shape[0]
    out = torch.full((tq, heads, KV_LORA), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tq, heads), float("nan"), dtype=torch.float32, device="cuda")
    max_q = max(seqlens_q) if isinstance(seqlens_q, list) else seqlens_q
    mla.mla_decode(**inp, softmax_scale=HEAD_DIM**-0.5, max_seqlen_q=max_q, num_splits=splits, out=out, lse=lse,
                   warp_specialized=True)  # asked for, and not taken: the FP8 variant is the pipelined kernel's
    ref_o, ref_l = mla_decode_ref(**{**inp, "kv_cache": seen}, softmax_scale=HEAD_DIM**-0.5)
    ok_o, so = compare(out, ref_o, "out")
    ok_l, sl = compare(lse, ref_l, "lse", ulps=0.25)
    assert ok_o and ok_l, dict(out=so, lse=sl)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("i,case", list(enumerate(PREFILL_CASES)), ids=lambda c: str(c)[:40] if isinstance(c, tuple)
                         else str(c))
def test_fp8_cache_prefill_matches_reference_gpu(i, case):
    batch, heads, seqlens_k, seqlens_q = case
    inp, seen = packed(mla_paged(batch, heads, seqlens_k, seqlens_q, seed=400 + i))
    tq = inp["q_latent"].shape[0]
    out = torch.full((tq, heads, KV_LORA), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tq, heads), float("nan"), dtype=torch.float32, device="cuda")
    max_q = max(seqlens_q) if isinstance(seqlens_q, list) else seqlens_q
    mla.mla_prefill(**inp, softmax_scale=HEAD_DIM**-0.5, max_seqlen_q=max_q, out=out, lse=lse)
    ref_o, ref_l = mla_decode_ref(**{**inp, "kv_cache": seen}, softmax_scale=HEAD_DIM**-0.5)
    ok_o, so = compare(out, ref_o, "out", ulps=PREFILL_OUT_ULPS)
    ok_l, sl = compare(lse, ref_l, "lse", ulps=0.25)
    assert ok_o and ok_l, dict(out=so, lse=sl)
