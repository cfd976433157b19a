"""Quantised-weight reference ops.

FP8 (DeepGEMM's numerics): activations quantised per token in 1 x 128 groups to e4m3 with fp32 scales, weights
float8_e4m3fn with 128 x 128 fp32 block scales (``scale_inv``); both operands dequantised to fp32, multiplied in
fp32, the result returned in the activation's dtype. A GPU kernel that fuses the activation quantisation into the
GEMM matches this up to fp32 accumulation order.

W8A8 (INT8, ``torch_npu.npu_dynamic_quant`` + ``npu_quant_matmul``'s numerics): activations quantised per token to
int8 (symmetric, ``amax / 127``), weights int8 with one fp32 scale per output channel; the int8 product is
accumulated exactly in int32, then scaled by both scales in fp32.
"""

from __future__ import annotations

import torch

from deepinfer_npu.hal.types import MLAWeights, RopeLike
from deepinfer_npu.model_executor.quantization.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_per_token_group,
    quantize_per_token_group,
)
from deepinfer_npu.model_executor.quantization.int8 import quantize_int8_rows

from .linear import silu_and_mul
from .mla import write_kv_cache
from .norm import rms_norm
from .rope import rope as apply_rope


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., K] -> fp32 [M, K]: quantised to e4m3 per 1 x 128 group and dequantised (what the GEMM sees)."""
    rows = x.reshape(-1, x.shape[-1])
    return dequantize_per_token_group(*quantize_per_token_group(rows))


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` [..., K] @ ``weight`` [N, K] (float8_e4m3fn, ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] fp32)^T
    (+ ``bias`` [N]) -> [..., N] in ``x``'s dtype."""
    out = quantize_activations(x) @ dequantize_fp8_block(weight, weight_scale_inv).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_grouped_mlp(
    sorted_hidden: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
) -> torch.Tensor:
    """``grouped_mlp`` with FP8 experts: ``w13`` [E, 2I, D] / ``w2`` [E, D, I] float8_e4m3fn with block scales
    [E, ceil(2I/128), ceil(D/128)] / [E, ceil(D/128), ceil(I/128)]; the SwiGLU output is quantised again per
    token group before the down projection (as the two-GEMM FP8 MoE does) -> [M, D]."""
    return _per_expert_mlp(fp8_linear, sorted_hidden, tokens_per_expert, w13, w13_scale_inv, w2, w2_scale_inv)


def w8a8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` [..., K] @ ``weight`` [N, K] (int8, ``weight_scale`` [N] fp32)^T (+ ``bias`` [N]) -> [..., N] in
    ``x``'s dtype; ``x`` quantised per token to int8, int32 accumulation."""
    xq, xs = quantize_int8_rows(x.reshape(-1, x.shape[-1]))
    acc = xq.to(torch.int32) @ weight.to(torch.int32).t()
    out = acc.float() * xs.unsqueeze(-1) * weight_scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def w8a8_grouped_mlp(
    sorted_hidden: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
) -> torch.Tensor:
    """``grouped_mlp`` with INT8 experts: ``w13`` [E, 2I, D] / ``w2`` [E, D, I] int8 with per-channel scales [E, 2I] /
    [E, D]; both GEMMs are ``w8a8_linear``'s (the SwiGLU output is quantised per token again) -> [M, D]."""
    return _per_expert_mlp(w8a8_linear, sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale)


def _per_expert_mlp(linear, sorted_hidden, tokens_per_expert, w13, w13_scale, w2, w2_scale) -> torch.Tensor:
    """SwiGLU MLP of each expert over its contiguous rows, both GEMMs through the quantised ``linear``."""
    out = torch.empty_like(sorted_hidden)
    start = 0
    for expert, count in enumerate(tokens_per_expert.tolist()):
        if count == 0:
            continue
        rows = sorted_hidden[start : start + count]
        act = silu_and_mul(linear(rows, w13[expert], w13_scale[expert]))
        out[start : start + count] = linear(act, w2[expert], w2_scale[expert])
        start += count
    return out


def quant_linear(x, weight, scale, bias=None):
    """The quantised GEMM of ``weight``'s format: ``fp8_linear`` (float8_e4m3fn) or ``w8a8_linear`` (int8)."""
    if weight.dtype == FP8_DTYPE:
        return fp8_linear(x, weight, scale, bias)
    if weight.dtype == torch.int8:
        return w8a8_linear(x, weight, scale, bias)
    raise TypeError(f"quantised projection of dtype {weight.dtype}; expected float8_e4m3fn or int8")


def mla_prolog_quant(
    hidden: torch.Tensor,
    w: MLAWeights,
    scales: dict[str, torch.Tensor],
    positions: torch.Tensor,
    rope: RopeLike,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_prolog`` with the projections (``q_proj`` or ``q_a_proj`` / ``q_b_proj``, ``kv_a_proj``) quantised (FP8
    or INT8, :func:`quant_linear`) and ``scales[name]`` their scales; the absorbed ``w_uk`` stays in the model
    dtype."""
    q_latent, q_rope, c_kv, k_pe = mla_prolog_quant_parts(hidden, w, scales, positions, rope)
    write_kv_cache(kv_cache, torch.cat((c_kv, k_pe), dim=-1), slot_mapping, w.kv_lora_rank)
    return q_latent, q_rope


def mla_prolog_quant_parts(hidden, w: MLAWeights, scales, positions, rope: RopeLike):
    """:func:`mla_prolog_quant` before its cache write: ``(q_latent, q_rope, c_kv, k_pe)``, for a backend that
    stores the latents in a layout of its own."""
    num_tokens = hidden.shape[0]
    nope, rdim, lrank = w.qk_nope_head_dim, w.qk_rope_head_dim, w.kv_lora_rank
    if w.q_proj is not None:
        q = quant_linear(hidden, w.q_proj, scales["q_proj"])
    else:
        q_a = rms_norm(quant_linear(hidden, w.q_a_proj, scales["q_a_proj"], w.q_a_bias), w.q_a_layernorm, w.norm_eps)
        q = quant_linear(q_a, w.q_b_proj, scales["q_b_proj"])
    q_nope, q_pe = q.view(num_tokens, w.num_heads, nope + rdim).split([nope, rdim], dim=-1)
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w.w_uk)
    q_rope = apply_rope(q_pe, positions, rope.cos_sin_cache, rope.interleaved)

    c_kv, k_pe = quant_linear(hidden, w.kv_a_proj, scales["kv_a_proj"], w.kv_a_bias).split([lrank, rdim], dim=-1)
    c_kv = rms_norm(c_kv, w.kv_a_layernorm, w.norm_eps)
    k_pe = apply_rope(k_pe.unsqueeze(1), positions, rope.cos_sin_cache, rope.interleaved).squeeze(1)
    return q_latent, q_rope, c_kv, k_pe


def mla_epilogue_quant(out_latent: torch.Tensor, w: MLAWeights, scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """``mla_epilogue`` with ``o_proj`` quantised (``scales["o_proj"]``); ``w_uv`` in the model dtype."""
    values = torch.einsum("thl,hvl->thv", out_latent, w.w_uv)
    return quant_linear(values.reshape(values.shape[0], -1), w.o_proj, scales["o_proj"], w.o_bias)
