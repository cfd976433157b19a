"""Expert-parallel dispatch / combine on MC2: ``torch_npu.npu_moe_distribute_dispatch`` / ``_combine``.

One dispatch sends every (token, choice) row to the rank owning its physical expert slot and returns this rank's
rows grouped by local slot with the per-slot counts (``expert_token_nums``) on the device; the combine brings the
expert outputs back and sums each token's rows with the router weights. Shapes are fixed by host integers
(``expand_x`` has ``A = global_bs * min(slots_per_rank, K)`` rows, ``global_bs = token_bound * ep_world_size``), so
nothing is read back to the host and the pair can sit in a captured NPU graph, unlike the reference
all-to-all whose split sizes the host must read.

Docs: Ascend/op-plugin docs/context torch_npu-npu_moe_distribute_dispatch.md and
torch_npu-npu_moe_distribute_combine.md (limits in capabilities.Mc2Limits). Usage:
vllm_ascend/ops/fused_moe/token_dispatcher.py (TokenDispatcherWithMC2), whose readings we follow: the ops run on a
group of their own (the docs allow no other op in MC2's communication domain), named by
``group._get_backend(device).get_hccl_comm_name(rank)``; ``global_bs`` is an upper bound on every rank's BS times
``ep_world_size`` when ranks differ; ``expert_token_nums_type=1`` gives counts, the grouped GEMM's group list.

BS must be > 0 (docs): a rank with no tokens sends one zero row routed to its own first slots (then the next
ranks'); the row is computed by those experts, counted in their ``tokens_per_slot``, and dropped by the combine.
The engine never needs this: a rank with nothing scheduled runs a one-token dummy step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer_npu.hal.types import EPDispatched

from . import runtime


HCCL_BUFFSIZE_ENV = "HCCL_BUFFSIZE"  # CANN's, read by HCCL itself: MB a communication domain, default 200


def hccl_buffsize_mb() -> int:
    """CANN's ``HCCL_BUFFSIZE`` as HCCL will read it (MC2 needs enough of it: capabilities.mc2_buffer_mb)."""
    raw = os.environ.get(HCCL_BUFFSIZE_ENV, "200")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{HCCL_BUFFSIZE_ENV}={raw!r} is not an integer (MB)") from None


@dataclass(frozen=True)
class Mc2Comm:
    """The MC2 communication domain: a group over the EP group's ranks used by the MC2 ops only."""

    group: dist.ProcessGroup
    name: str  # the HCCL communicator's name, MC2's ``group_ep``
    world: int
    rank: int


def open_comm(ep_group: dist.ProcessGroup | None, device: torch.device) -> Mc2Comm:
    """A new group over ``ep_group``'s ranks on its backend, and its HCCL name. ``dist.new_group`` is a collective
    of the default group: every process calls this in the same order (the EP group is the world today)."""
    ep_group = ep_group if ep_group is not None else dist.group.WORLD
    own = dist.new_group(ranks=dist.get_process_group_ranks(ep_group), backend=dist.get_backend(ep_group))
    rank = dist.get_rank(own)
    name = own._get_backend(torch.device(device.type)).get_hccl_comm_name(rank)
    return Mc2Comm(group=own, name=name, world=dist.get_world_size(own), rank=rank)


@dataclass
class Mc2State:
    """What the combine needs from the dispatch: the ids it sent and the dispatch's opaque routing outputs."""

    comm: Mc2Comm
    expert_ids: torch.Tensor  # [BS, K] int32 as sent (one padding row when num_tokens == 0)
    expand_idx: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor | None
    num_slots: int
    global_bs: int
    num_tokens: int


def dispatch(hidden: torch.Tensor, slots: torch.Tensor, num_slots: int, slots_per_rank: int, comm: Mc2Comm,
             token_bound: int) -> EPDispatched:
    """``hidden`` [T, H], physical ``slots`` [T, K] -> this rank's rows [A, H] by local slot (rows past
    ``tokens_per_slot.sum()`` are unspecified), ``tokens_per_slot`` [slots_per_rank] int64."""
    num_tokens, top_k = slots.shape
    if num_tokens > token_bound:
        raise ValueError(f"ep_dispatch: {num_tokens} tokens on rank {comm.rank} exceed the agreed bound of "
                         f"{token_bound} a rank (ep_max_tokens_per_rank) that sized MC2's global_bs; the other "
                         "ranks wait for this one until the group's timeout")
    if num_tokens == 0:  # BS must be > 0: one zero row to this rank's own slots first
        x = hidden.new_zeros(1, hidden.shape[1])
        first = comm.rank * slots_per_rank
        ids = ((first + torch.arange(top_k, device=hidden.device)) % num_slots).view(1, top_k).to(torch.int32)
    else:
        x, ids = hidden, slots.to(torch.int32)
    global_bs = token_bound * comm.world
    expand_x, _scales, expand_idx, counts, ep_recv_counts, tp_recv_counts, _expand_scales = (
        runtime.load().npu_moe_distribute_dispatch(
            x, ids, comm.name, comm.world, comm.rank, num_slots,
            global_bs=global_bs,
            expert_token_nums_type=1,  # counts per local slot, not prefix sums
        ))
    state = Mc2State(comm=comm, expert_ids=ids, expand_idx=expand_idx, ep_recv_counts=ep_recv_counts,
                     tp_recv_counts=tp_recv_counts, num_slots=num_slots, global_bs=global_bs, num_tokens=num_tokens)
    return EPDispatched(expand_x, counts.to(torch.int64), state)


def combine(expert_out: torch.Tensor, state: Mc2State, weights: torch.Tensor) -> torch.Tensor:
    """``expert_out`` [A, H] in the dispatch's row order -> [T, H]: each token's K rows weighted by ``weights``
    [T, K] (fp32 scales; the op returns ``expert_out``'s dtype)."""
    scales = weights.float() if state.num_tokens else weights.new_zeros(state.expert_ids.shape, dtype=torch.float32)
    comm = state.comm
    out = runtime.load().npu_moe_distribute_combine(
        expert_out, state.expert_ids, state.expand_idx, state.ep_recv_counts, scales, comm.name, comm.world,
        comm.rank, state.num_slots,
        tp_send_counts=state.tp_recv_counts,
        global_bs=state.global_bs,
    )
    return out[: state.num_tokens]
