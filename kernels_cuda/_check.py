"""Shared by the kernel files' ``--check``: distances in bf16 representable values. Not a kernel file of its own
(no ``ci_compile``)."""

import torch


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-element distance in bf16 representable values between a and b (bf16, same shape); NaN pairs -> 0,
    a NaN against a number -> inf."""
    ia = a.contiguous().view(torch.int16).int()
    ib = b.contiguous().view(torch.int16).int()
    oa = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # order-preserving; +0 and -0 both map to 0
    ob = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    d = (oa - ob).abs().float()
    na, nb = torch.isnan(a), torch.isnan(b)
    d = torch.where(na & nb, torch.zeros_like(d), d)
    return torch.where(na ^ nb, torch.full_like(d, float("inf")), d)
