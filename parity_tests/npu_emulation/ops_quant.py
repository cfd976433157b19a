"""Emulated INT8 W8A8 torch_npu ops, as their documentation states them (CPU, fp32 arithmetic):

* ``npu_dynamic_quant(x, smooth_scales=None, group_index=None, dst_type=torch.int8)`` -> ``(y int8, scale fp32
  [rows])`` with ``scale = rowMax(|x|) / 127`` and ``y = round(x / scale)`` (torch_npu-npu_dynamic_quant.md);
* ``npu_quant_matmul(x1 int8 [M, K], x2 int8 [K, N], scale [N], *, pertoken_scale=[M], bias=, output_dtype=)`` ->
  ``(x1 @ x2) * scale * pertoken_scale (+ bias)`` in ``output_dtype`` (torch_npu-npu_quant_matmul.md, table 2);
* ``npu_grouped_matmul`` with int8 ``x``, ``scale=[[E, N]]`` and ``per_token_scale=[[M]]`` (dynamic pertoken +
  perchannel quantisation, aclnnGroupedMatmulV4.md); other calls go to the floating-point emulation.

A zero row's scale is clamped (amax >= 1e-10) as the CPU reference does; the documentation leaves that case open.
"""

from __future__ import annotations

import torch

from . import ops_moe
from .contract import check, record

INT8_MAX = 127.0


def npu_dynamic_quant(x: torch.Tensor, smooth_scales=None, group_index=None, dst_type=torch.int8):
    record("npu_dynamic_quant")
    check(smooth_scales is None and group_index is None, "emulated: no smooth scales / groups")
    check(dst_type == torch.int8, "emulated: int8 output")
    check(x.dim() >= 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32), "x [..., K] float")
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / INT8_MAX
    y = torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return y, scale.squeeze(-1)


def npu_quant_matmul(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset=None, pertoken_scale=None,
                     bias=None, output_dtype=None, **unused) -> torch.Tensor:
    record("npu_quant_matmul")
    check(x1.dtype == torch.int8 and x2.dtype == torch.int8, "x1 / x2 int8")
    check(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0], "x1 [M, K], x2 [K, N]")
    check(offset is None, "emulated: no offset")
    check(scale.dim() == 1 and scale.shape[0] in (1, x2.shape[1]) and scale.dtype in (torch.float32, torch.bfloat16),
          "scale [N] (or [1]) float32 / bfloat16")
    check(pertoken_scale is not None and pertoken_scale.dtype == torch.float32
          and pertoken_scale.shape == (x1.shape[0],), "pertoken_scale fp32 [M] (dynamic W8A8)")
    check(output_dtype in (torch.bfloat16, torch.float16, torch.float32), "output_dtype bf16 / fp16 (fp32 emulated)")
    check(output_dtype != torch.float16 or scale.dtype == torch.float32, "fp16 output needs a float32 scale")
    acc = x1.to(torch.int32) @ x2.to(torch.int32)
    out = acc.float() * pertoken_scale.unsqueeze(-1) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(output_dtype)


def npu_grouped_matmul(x: list[torch.Tensor], weight: list[torch.Tensor], *, scale=None, per_token_scale=None,
                       output_dtype=None, **kw) -> list[torch.Tensor]:
    if not (x and x[0].dtype == torch.int8):
        return ops_moe.npu_grouped_matmul(x, weight, scale=scale, per_token_scale=per_token_scale,
                                          output_dtype=output_dtype, **kw)
    record("npu_grouped_matmul")
    check(len(x) == len(weight) == 1 and weight[0].dtype == torch.int8, "one int8 x, one stacked int8 weight")
    check(kw.get("split_item") == 2 and kw.get("group_type") == 0 and kw.get("group_list_type") == 1,
          "emulated: split_item 2, M groups, counts")
    a, w, counts = x[0], weight[0], kw.get("group_list")
    check(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], "x [M, K], weight [E, K, N]")
    check(counts is not None and counts.dtype == torch.int64 and counts.shape == (w.shape[0],), "group_list int64 [E]")
    check(scale is not None and len(scale) == 1 and scale[0].shape == (w.shape[0], w.shape[2]), "scale [[E, N]]")
    check(per_token_scale is not None and len(per_token_scale) == 1 and per_token_scale[0].shape == (a.shape[0],)
          and per_token_scale[0].dtype == torch.float32, "per_token_scale [[M]] fp32")
    check(output_dtype in (torch.bfloat16, torch.float16, torch.float32), "output_dtype bf16 / fp16 (fp32 emulated)")
    out = torch.zeros(a.shape[0], w.shape[2], dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            acc = a[start : start + c].to(torch.int32) @ w[e].to(torch.int32)
            out[start : start + c] = acc.float() * per_token_scale[0][start : start + c].unsqueeze(-1) * \
                scale[0][e].float()
        start += c
    return [out.to(output_dtype)]
