"""Token embedding and the LM head (logits in fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet

from .linear import empty_param


class VocabEmbedding(nn.Module):
    """``weight`` [V, D]; ``forward(ids [T]) -> [T, D]``."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.long(), self.weight)


class LMHead(nn.Module):
    """``weight`` [V, D]; ``forward(hidden [N, D]) -> logits [N, V]`` in fp32 (the sampler's dtype)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        kernels: KernelSet,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(hidden, self.weight).float()
