"""Expert-parallel dispatch and combine, the readable reference: ``all_to_all_single`` with variable splits.

``ep_dispatch`` sends each (token, choice) row to the rank that owns its physical expert slot and returns the rows
this rank must run, with their local expert index; ``ep_combine`` sends the expert outputs back and reduces each
token's ``k`` rows with the router weights in the same fp32 order as the single-device ``moe_combine``, so an EP
deployment gives the single-device result. The split sizes are host integers (one count exchange per dispatch):
on the reference path this is a host sync by construction. The kernel sets' ``ep_dispatch`` / ``ep_combine`` ops
(``CpuKernelSet``) wrap these with the local ``moe_dispatch`` / ``moe_combine``; a device backend overrides those
ops (NCCL with device-side counts, DeepEP, MC2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer_npu.hal.sync_guard import allow_sync

from deepinfer_npu.distributed.expert_placement import ExpertPlacement


@dataclass(frozen=True)
class EPDispatchHandle:
    """What ``ep_combine`` needs to bring the rows back: the send order and both sides' split sizes."""

    order: torch.Tensor  # [T*k] flat (token, choice) assignments sorted by destination rank
    send_counts: list[int]  # rows this rank sent to each rank
    recv_counts: list[int]  # rows this rank received from each rank
    num_tokens: int
    top_k: int


def _exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv


def ep_dispatch(hidden: torch.Tensor, slots: torch.Tensor, placement: ExpertPlacement,
                group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor, EPDispatchHandle]:
    """``hidden`` [T, D], physical ``slots`` [T, k] -> ``(rows [R, D], local_expert [R] int64, handle)``."""
    world = dist.get_world_size(group)
    if world != placement.ep_size:
        raise ValueError(f"the EP group has {world} ranks but the expert placement is for {placement.ep_size}")
    num_tokens, top_k = slots.shape
    flat = slots.reshape(-1).long()
    per_rank = placement.slots_per_rank
    dest = flat // per_rank
    order = torch.argsort(dest, stable=True)  # stable: a rank's rows keep their (token, choice) order
    send_counts_t = torch.bincount(dest, minlength=world)
    with allow_sync("expert-parallel dispatch: the all-to-all's split sizes on the host"):
        recv_counts_t = _exchange_counts(send_counts_t, group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()

    send_rows = hidden[order // top_k].contiguous()
    send_local = (flat[order] - dest[order] * per_rank).contiguous()
    rows = hidden.new_empty((sum(recv_counts), hidden.shape[1]))
    local_expert = send_local.new_empty((sum(recv_counts),))
    dist.all_to_all_single(rows, send_rows, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    dist.all_to_all_single(local_expert, send_local, output_split_sizes=recv_counts,
                           input_split_sizes=send_counts, group=group)
    handle = EPDispatchHandle(order=order, send_counts=send_counts, recv_counts=recv_counts,
                              num_tokens=num_tokens, top_k=top_k)
    return rows, local_expert, handle


def ep_combine(expert_out: torch.Tensor, handle: EPDispatchHandle, weights: torch.Tensor,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Expert outputs [R, D] in dispatch's receive order -> [T, D], weighted by ``weights`` [T, k] in fp32."""
    back = expert_out.new_empty((sum(handle.send_counts), expert_out.shape[1]))
    dist.all_to_all_single(back, expert_out.contiguous(), output_split_sizes=handle.send_counts,
                           input_split_sizes=handle.recv_counts, group=group)
    unsorted = torch.empty_like(back, dtype=torch.float32)
    unsorted[handle.order] = back.float()
    per_token = unsorted.view(handle.num_tokens, handle.top_k, back.shape[-1])  # also for 0 tokens
    return (per_token * weights.float().unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)
