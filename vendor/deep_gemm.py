"""DeepGEMM (github.com/deepseek-ai/DeepGEMM): grouped GEMMs for the MoE experts when the user built it.

Detects the ``deep_gemm`` package and its M-grouped contiguous entry points (bf16, and fp8 with 1x128 activation /
128x128 weight scales). :func:`m_grouped_gemm` takes the engine's expert layout — rows sorted by expert
(``moe_dispatch``'s ``sorted_hidden``) with ``tokens_per_expert`` — pads each expert's rows to DeepGEMM's alignment
on the device (no host read of the counts), runs one grouped call, and returns the rows in the input order.
Fallback: ``kernels_cuda.moe_gemm`` (bf16 decode batches) and ``torch._grouped_mm``.
"""

from __future__ import annotations

import torch

from .status import VendorStatus, probe_module, require

NAME = "deep_gemm"
FALLBACK = "kernels_cuda.moe_gemm / torch._grouped_mm"
BF16_ENTRY = "m_grouped_bf16_gemm_nt_contiguous"
FP8_ENTRIES = ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous")  # newer, older
ALIGNMENT_ENTRIES = ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout")


def probe() -> VendorStatus:
    return probe_module(NAME, "deep_gemm", (BF16_ENTRY, "|".join(FP8_ENTRIES)), ("deep_gemm", "deep-gemm"))


def _first(lib, names: tuple[str, ...]):
    return next((getattr(lib, n) for n in names if hasattr(lib, n)), None)


def _alignment(lib) -> int:
    get = _first(lib, ALIGNMENT_ENTRIES)
    return int(get()) if get is not None else 128


def m_grouped_gemm(x: torch.Tensor, w: torch.Tensor, tokens_per_group: torch.Tensor,
                   x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = x[i] @ w[g(i)].T`` for rows grouped contiguously by ``tokens_per_group`` [G] -> [M, N] bf16.

    bf16: ``x`` [M, K], ``w`` [G, N, K] (our ``w13`` [E, 2I, D] and ``w2`` [E, D, I]). fp8: ``x`` / ``w`` in
    float8_e4m3fn with ``x_scale`` [M, K/128] and ``w_scale`` [G, N/128, K/128] fp32. DeepGEMM's contiguous layout
    wants every group's rows padded to its alignment and an expert index per row (-1 on padding), built here.
    """
    lib = require(probe(), NAME)
    m, k = x.shape
    groups, n, _ = w.shape
    align = _alignment(lib)
    counts = tokens_per_group.to(torch.int64)
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    group_of_row = torch.repeat_interleave(torch.arange(groups, device=x.device), counts, output_size=m)
    dest = padded_starts[group_of_row] + torch.arange(m, device=x.device) - starts[group_of_row]
    rows = -(-(m + groups * (align - 1)) // align) * align  # a bound on the padded total, known on the host
    m_indices = torch.full((rows,), -1, dtype=torch.int32, device=x.device)
    m_indices[dest] = group_of_row.to(torch.int32)
    a = x.new_zeros(rows, k)
    a[dest] = x
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device)
    if x_scale is None:
        getattr(lib, BF16_ENTRY)(a, w, out, m_indices)
    else:
        a_scale = x_scale.new_zeros(rows, x_scale.shape[1])
        a_scale[dest] = x_scale
        _first(lib, FP8_ENTRIES)((a, a_scale), (w, w_scale), out, m_indices)
    return out[dest]
