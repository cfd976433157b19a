"""Expert-parallel dispatch and combine at a fixed capacity: no host read, one shape per step size (graph-capturable).

The algorithm of DeepEP's low-latency mode and Ascend's MC2, in readable torch: every rank reserves ``capacity`` rows
for each destination rank, so the all-to-all has EQUAL splits known before the step and no count exchange is read
on the host (the reference, ``backends/cpu/ep_comm.py``, sizes a variable-split all-to-all from host counts: one
sync per MoE layer and step).

Dispatch. Each flat (token, choice) row ``a`` goes to rank ``dest = slot // slots_per_rank`` at position ``pos`` =
the number of earlier rows (in (token, choice) order) with the same destination: a cumsum over a one-hot of the
destination, computed on the device. The send buffer ``[world, capacity, D]`` (padding rows zero) and a
``[world, capacity]`` int32 buffer of local slot ids (padding = ``slots_per_rank``, a "sink" slot past the real
ones) travel in one ``all_to_all_single`` each. The receiver stable-sorts its ``world * capacity`` rows by local
slot: real rows come slot by slot in (source rank, token, choice) order, exactly as the reference's ``moe_dispatch``
of its receive buffer orders them, and the padding rows come last. ``tokens_per_slot`` is a ``scatter_add_`` of
ones over the slot ids (the sink's count dropped). So ``rows[:tokens_per_slot.sum()]`` equals the reference's rows
and the expert MLP receives trailing padding rows past its counts (every grouped MLP leaves rows past the counts
untouched: see docs/design_notes.md).

Combine. The expert outputs go back to the receive layout (``index_copy_`` by the sort order), travel back with
the same equal splits, and each sender gathers ONLY its real rows (``send_index``), so whatever the expert MLP left
in padding rows (garbage, NaN) is never read; each token's k outputs are reduced with the router weights in fp32 in
the reference's order, so the result is bit-identical to ``ep_combine``'s for the same expert outputs.

``capacity`` is a host int that every rank of the group passes identically (the equal splits must match); a
rank's rows never exceed ``T * k`` per destination (every row to one rank), so the step's agreed token count times
k is always enough. The bytes moved are ``world * capacity * D`` a rank in each direction, against the reference's
``T * k * D``: the price of needing no host read, paid where a step is latency-bound (decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .expert_placement import ExpertPlacement


@dataclass(frozen=True)
class FixedCapacityHandle:
    """What ``ep_combine_fixed`` needs: where each of this rank's rows was sent and where each received row sits."""

    send_index: torch.Tensor  # [T*k] int64: flat (token, choice) row -> its row in the [world*capacity] send buffer
    recv_order: torch.Tensor  # [world*capacity] int64: row i of the slot-sorted rows is receive position recv_order[i]
    capacity: int  # rows reserved per destination rank (the same on every rank)
    num_tokens: int
    top_k: int


def check_capacity(capacity: int, num_tokens: int, top_k: int) -> None:
    """Raise a ``ValueError`` naming the numbers when ``capacity`` rows per destination cannot hold ``T * k`` rows."""
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"ep_dispatch_fixed: capacity must be a host int, got {type(capacity).__name__}")
    if capacity < num_tokens * top_k:
        raise ValueError(f"ep_dispatch_fixed: capacity={capacity} rows per destination rank is too small for "
                         f"T={num_tokens} tokens x k={top_k} choices: a rank may send all its rows to one rank, so "
                         f"capacity must be >= T*k = {num_tokens * top_k} (use the step's agreed token count times k, "
                         "the same on every rank)")


def _world(group: dist.ProcessGroup | None, placement: ExpertPlacement) -> int:
    world = dist.get_world_size(group)
    if world != placement.ep_size:
        raise ValueError(f"the EP group has {world} ranks but the expert placement is for {placement.ep_size}")
    return world


def ep_dispatch_fixed(hidden: torch.Tensor, slots: torch.Tensor, placement: ExpertPlacement,
                      group: dist.ProcessGroup | None, capacity: int
                      ) -> tuple[torch.Tensor, torch.Tensor, FixedCapacityHandle]:
    """``hidden`` [T, D] (T may be 0), physical ``slots`` [T, k] -> ``(rows [world*capacity, D] sorted by local slot
    with the padding rows last, tokens_per_slot [slots_per_rank] int64 (real rows only), handle)``. A collective:
    every rank of ``group`` calls it with the same ``capacity``."""
    world = _world(group, placement)
    num_tokens, top_k = slots.shape
    if hidden.shape[0] != num_tokens:
        raise ValueError(f"ep_dispatch_fixed: hidden has {hidden.shape[0]} rows but slots has {num_tokens}")
    check_capacity(capacity, num_tokens, top_k)
    dim, device, per_rank = hidden.shape[1], hidden.device, placement.slots_per_rank

    flat = slots.reshape(-1).long()
    dest = flat // per_rank
    # rank of each row among this rank's rows to the same destination, in (token, choice) order
    to_rank = (dest.unsqueeze(1) == torch.arange(world, device=device)).long()  # [T*k, world] one-hot
    pos = to_rank.cumsum(0).gather(1, dest.unsqueeze(1)).squeeze(1) - 1
    send_index = dest * capacity + pos

    rows_per_choice = hidden.unsqueeze(1).expand(num_tokens, top_k, dim).reshape(num_tokens * top_k, dim)
    send_rows = hidden.new_zeros(world * capacity, dim).index_copy_(0, send_index, rows_per_choice)
    send_slot = torch.full((world * capacity,), per_rank, dtype=torch.int32, device=device)
    send_slot.index_copy_(0, send_index, (flat - dest * per_rank).to(torch.int32))

    recv_rows, recv_slot = torch.empty_like(send_rows), torch.empty_like(send_slot)
    dist.all_to_all_single(recv_rows, send_rows, group=group)  # equal splits: capacity rows per rank
    dist.all_to_all_single(recv_slot, send_slot, group=group)

    # stable: within a slot, rows keep (source rank, token, choice) order, as the reference's moe_dispatch; the
    # padding's sink slot (= per_rank) sorts last
    recv_order = torch.argsort(recv_slot, stable=True)
    rows = recv_rows.index_select(0, recv_order)
    recv_slot = recv_slot.long()
    counts = torch.zeros(per_rank + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, recv_slot, torch.ones_like(recv_slot))
    handle = FixedCapacityHandle(send_index=send_index, recv_order=recv_order, capacity=capacity,
                                 num_tokens=num_tokens, top_k=top_k)
    return rows, counts[:per_rank], handle


def ep_combine_fixed(expert_out: torch.Tensor, handle: FixedCapacityHandle, weights: torch.Tensor,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Expert outputs [world*capacity, D] in ``ep_dispatch_fixed``'s row order (padding rows may hold anything) ->
    [T, D] in ``expert_out``'s dtype, each token's k rows weighted by ``weights`` [T, k] and summed in fp32 in the
    reference ``ep_combine``'s order. A collective, like the dispatch."""
    world = dist.get_world_size(group)
    if expert_out.shape[0] != world * handle.capacity:
        raise ValueError(f"ep_combine_fixed: expert_out has {expert_out.shape[0]} rows; the dispatch gave "
                         f"world*capacity = {world}*{handle.capacity} = {world * handle.capacity}")
    num_tokens, top_k, dim = handle.num_tokens, handle.top_k, expert_out.shape[1]
    recv_layout = torch.empty_like(expert_out).index_copy_(0, handle.recv_order, expert_out)
    back = torch.empty_like(recv_layout)
    dist.all_to_all_single(back, recv_layout, group=group)
    # only the positions this rank filled: padding rows (whatever the MLP made of them) are never read
    mine = back.index_select(0, handle.send_index).float()
    per_token = mine.view(num_tokens, top_k, dim)  # also for 0 tokens
    return (per_token * weights.float().unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)
