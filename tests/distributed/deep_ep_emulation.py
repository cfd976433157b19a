"""DeepEP's normal-mode contract over torch.distributed, for CPU tests of the engine's DeepEP path
(``backends/cuda/ep_deepep.py``). Installed as the ``deep_ep`` module in a rank process (``install()``).

From DeepEP's ``deep_ep/buffer.py`` docstrings and its intranode test: ``get_dispatch_layout(topk_idx int64 [T, k],
num_experts)`` -> (tokens per rank int, None intranode, tokens per expert int, is_token_in_rank [T, ranks] bool,
event); ``dispatch`` sends each token once to every rank owning one of its experts (x bf16 only) and returns
(recv_x, recv_topk_idx with this rank's local expert ids and -1 elsewhere, recv_topk_weights, a Python list of
received (token, choice) rows per local expert, handle, event); ``combine(x, handle)`` adds the ranks' rows of each
token on its own rank without weights -> (combined, weights, event). Experts are contiguous, num_experts / ranks a
rank. Every call is a collective; the split sizes go through the host here (DeepEP's kernels do not need to)."""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

WORLD_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)  # DeepEP's config maps


class Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, ranks: int) -> int:
        return hidden_bytes * ranks * 1024

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, ranks: int) -> int:
        return 0


def _config(num_ranks: int) -> Config:
    assert num_ranks in WORLD_SIZES, f"Unsupported number of EP ranks: {num_ranks}"
    return Config()


class Buffer:
    num_sms = 20
    created = 0  # buffers made in this process (the engine makes one per group)
    get_dispatch_config = staticmethod(_config)
    get_combine_config = staticmethod(_config)

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 12) -> None:
        assert not low_latency_mode and num_nvl_bytes > 0
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        dist.barrier(group)  # DeepEP all-gathers device ids and IPC handles here: a collective
        Buffer.created += 1

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        assert topk_idx.dtype == torch.int64 and num_experts % self.group_size == 0
        per = num_experts // self.group_size
        dest = torch.where(topk_idx >= 0, topk_idx // per, torch.full_like(topk_idx, -1))
        in_rank = torch.stack([(dest == r).any(dim=1) for r in range(self.group_size)], dim=1)
        valid = topk_idx[topk_idx >= 0]
        per_expert = torch.bincount(valid, minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(out, send.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                               group=self.group)
        return out

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        assert handle is None and x.dtype == torch.bfloat16 and expert_alignment == 1
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and topk_idx is not None
        ranks = self.group_size
        per = num_tokens_per_expert.numel() // ranks
        order = [torch.nonzero(is_token_in_rank[:, r]).flatten() for r in range(ranks)]
        send_idx = torch.cat(order)
        send_counts = [int(o.numel()) for o in order]
        recv_counts_t = torch.empty(ranks, dtype=torch.int64)
        dist.all_to_all_single(recv_counts_t, torch.tensor(send_counts, dtype=torch.int64), group=self.group)
        recv_counts = recv_counts_t.tolist()
        local_ids = torch.cat([torch.where(topk_idx[o] // per == r, topk_idx[o] - r * per,
                                           torch.full_like(topk_idx[o], -1)) for r, o in enumerate(order)])
        recv_x = self._exchange(x[send_idx], send_counts, recv_counts)
        recv_ids = self._exchange(local_ids, send_counts, recv_counts)
        recv_w = self._exchange(topk_weights.float()[send_idx], send_counts, recv_counts)
        per_expert = [int((recv_ids == i).sum()) for i in range(per)]
        handle = (send_idx, send_counts, recv_counts, x.shape[0])
        return recv_x, recv_ids, recv_w, per_expert, handle, None

    def combine(self, x, handle, topk_weights=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        assert x.dtype == torch.bfloat16
        send_idx, send_counts, recv_counts, num_tokens = handle
        back = self._exchange(x, recv_counts, send_counts)
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)
        out.index_add_(0, send_idx, back.float())  # in rank order, as DeepEP's reduction
        return out.to(x.dtype), None, None


def install() -> types.ModuleType:
    """Make ``import deep_ep`` give this emulation in this process."""
    mod = types.ModuleType("deep_ep")
    mod.__version__ = "emulated"
    mod.Buffer, mod.Config = Buffer, Config
    sys.modules["deep_ep"] = mod
    return mod
