"""DeepEP (github.com/deepseek-ai/DeepEP): expert-parallel dispatch / combine over NVLink / RDMA when the user built it.

Detects the ``deep_ep`` package (``Buffer``). :class:`ExpertDispatch` wraps one ``deep_ep.Buffer`` (normal mode,
sized by DeepEP's own config hints) and speaks the engine's MoE layout: ``ids`` [T, k] int32 expert ids and
``weights`` [T, k] fp32 from ``moe_gating_topk``, hidden states [T, D] bf16. Used by the CUDA kernel set's
``ep_dispatch`` / ``ep_combine`` (``backends/cuda/ep_deepep.py``); fallback: the all-to-all with variable splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .status import VendorStatus, probe_module, require

NAME = "deep_ep"
FALLBACK = "torch.distributed all_to_all_single (backends/cpu/ep_comm.py)"


def probe() -> VendorStatus:
    return probe_module(NAME, "deep_ep", ("Buffer",), ("deep_ep", "deep-ep"))


@dataclass
class Dispatched:
    """What this rank received: hidden rows for its local experts, their expert ids (-1: not local) and weights,
    the row count per local expert, and the handle :meth:`ExpertDispatch.combine` needs."""

    hidden: torch.Tensor
    ids: torch.Tensor | None
    weights: torch.Tensor | None
    tokens_per_expert: list[int]
    handle: Any


class ExpertDispatch:
    """One DeepEP buffer for a process group; ``hidden_bytes`` = D x element size of the largest dispatch row."""

    def __init__(self, group, num_experts: int, hidden_bytes: int) -> None:
        lib = require(probe(), NAME)
        ranks = group.size()
        nvl_bytes, rdma_bytes = 0, 0
        for config in (lib.Buffer.get_dispatch_config(ranks), lib.Buffer.get_combine_config(ranks)):
            nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, ranks))
            rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, ranks))
        self.buffer = lib.Buffer(group, nvl_bytes, rdma_bytes)
        self.num_experts = num_experts

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        """Send each token to the ranks owning its experts (``get_dispatch_layout`` then ``dispatch``)."""
        topk_idx = ids.to(torch.int64)  # DeepEP's topk_idx_t
        per_rank, per_rdma_rank, per_expert, in_rank, _event = self.buffer.get_dispatch_layout(
            topk_idx, self.num_experts)
        recv, recv_ids, recv_weights, counts, handle, _event = self.buffer.dispatch(
            hidden, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights.float())
        return Dispatched(recv, recv_ids, recv_weights, list(counts), handle)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Sum each token's expert outputs back on its own rank -> [T, D]. DeepEP adds without weights, so
        ``expert_out`` rows already carry their gating weight."""
        combined, _weights, _event = self.buffer.combine(expert_out, dispatched.handle)
        return combined
