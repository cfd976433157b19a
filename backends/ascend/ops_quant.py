"""INT8 W8A8 (dynamic) on torch_npu: activations quantised per token on the device, int8 GEMMs with the
per-token x per-channel scales applied in the op, the model dtype out.

The numerics are those of the CPU reference (``backends/cpu/quant.py``): ``scale = rowmax(|x|) / 127``,
``q = round(x / scale)``, int32 accumulation, ``acc * token_scale * channel_scale`` in fp32, then the output dtype.
Our int8 weights are stored [N, K] (experts [E, N, K]); the ops take [K, N] (experts [E, K, N]), so the transposed
views are passed, as torch_npu's documentation does for ``npu_quant_matmul(x1, x2.t(), ...)``.
"""

from __future__ import annotations

import torch

from . import runtime


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ ``weight`` [N, K] int8 (``weight_scale`` [N])^T (+ ``bias``) -> [..., N] in x's dtype.

    torch_npu.npu_dynamic_quant(x) -> (int8 x, fp32 per-token scale [M]); npu_quant_matmul(x1, x2 [K, N], scale
    [N], pertoken_scale=[M], bias=, output_dtype=). Docs: torch_npu-npu_dynamic_quant.md,
    torch_npu-npu_quant_matmul.md; usage: vllm_ascend/quantization/methods/w8a8/w8a8_dynamic.py."""
    npu = runtime.load()
    flat = x.reshape(-1, x.shape[-1])
    xq, token_scale = npu.npu_dynamic_quant(flat)
    out = npu.npu_quant_matmul(xq, weight.t(), weight_scale.float(), pertoken_scale=token_scale, bias=bias,
                               output_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def w8a8_grouped_mlp(sorted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor,
                     w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor) -> torch.Tensor:
    """The routed experts' SwiGLU MLP with int8 weights: quantise, grouped GEMM (gate | up), npu_swiglu,
    quantise again, grouped GEMM (down). ``npu_grouped_matmul(x=[int8 x], weight=[w [E, K, N]], scale=[[E, N]],
    per_token_scale=[[M]], split_item=2, group_type=0, group_list_type=1, group_list=counts, output_dtype=)``.
    Doc: aclnnGroupedMatmulV4.md (dynamic pertoken + perchannel quantisation); usage:
    vllm_ascend/ops/fused_moe/moe_mlp.py (quant_apply_mlp)."""
    npu = runtime.load()
    counts = tokens_per_expert.to(torch.int64)
    xq, x_scale = npu.npu_dynamic_quant(sorted_hidden)
    gate_up = npu.npu_grouped_matmul(
        x=[xq], weight=[w13.transpose(1, 2)], scale=[w13_scale.float()], per_token_scale=[x_scale], split_item=2,
        group_list_type=1, group_type=0, group_list=counts, output_dtype=sorted_hidden.dtype)[0]
    act = npu.npu_swiglu(gate_up, dim=-1)
    aq, a_scale = npu.npu_dynamic_quant(act)
    return npu.npu_grouped_matmul(
        x=[aq], weight=[w2.transpose(1, 2)], scale=[w2_scale.float()], per_token_scale=[a_scale], split_item=2,
        group_list_type=1, group_type=0, group_list=counts, output_dtype=sorted_hidden.dtype)[0]
