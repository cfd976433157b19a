"""Moving expert weights to a new placement: local rows copied in place, the others sent between ranks.

Every rank computes the same list of moves from the old and the new placement (both known everywhere), so the
split sizes of the exchange need no count exchange: one ``all_to_all_single`` per weight tensor over the device
group (gloo / NCCL / HCCL), skipped when no row of the layer crosses ranks. A new slot takes its expert from this
rank when the rank already holds it; else from a rank that holds it, the holders taken in turn so no single rank
sends every copy of a hot expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer_npu.distributed.expert_placement import ExpertPlacement


@dataclass(frozen=True)
class Move:
    src_rank: int
    src_row: int  # row in the source rank's stacked weights (old placement)
    dst_rank: int
    dst_row: int  # row in the destination rank's stacked weights (new placement)


def plan_moves(old: ExpertPlacement, new: ExpertPlacement) -> list[Move]:
    """The rows to fill on every rank, in (destination rank, row) order; a row whose expert is unchanged is not
    listed."""
    if (old.num_logical, old.ep_size, old.num_slots) != (new.num_logical, new.ep_size, new.num_slots):
        raise ValueError("placements differ in experts, ranks or slots; a move keeps all three")
    holders: dict[int, list[tuple[int, int]]] = {}
    for rank in range(old.ep_size):
        for row, expert in enumerate(old.local_experts(rank)):
            holders.setdefault(expert, []).append((rank, row))
    turn: dict[int, int] = {}
    moves = []
    for rank in range(new.ep_size):
        before = old.local_experts(rank)
        for row, expert in enumerate(new.local_experts(rank)):
            if before[row] == expert:
                continue
            if expert in before:
                moves.append(Move(rank, before.index(expert), rank, row))
                continue
            options = holders[expert]
            src_rank, src_row = options[turn.get(expert, 0) % len(options)]
            turn[expert] = turn.get(expert, 0) + 1
            moves.append(Move(src_rank, src_row, rank, row))
    return moves


def apply_moves(tensors: list[torch.Tensor], moves: list[Move], rank: int, world: int,
                group: dist.ProcessGroup | None) -> None:
    """Rewrite this rank's rows of each stacked tensor ([slots_per_rank, ...]) in place; every source row is
    read before any row is written. Collective: every rank of ``group`` calls it with the same ``moves``."""
    mine = [m for m in moves if m.dst_rank == rank]
    remote = any(m.src_rank != m.dst_rank for m in moves)  # the same on every rank: all join the exchange
    sends = [m for m in moves if m.src_rank == rank and m.dst_rank != rank]  # (dst rank, dst row) order
    recvs = sorted((m for m in mine if m.src_rank != rank), key=lambda m: (m.src_rank, m.dst_row))
    send_splits = [sum(1 for m in sends if m.dst_rank == r) for r in range(world)]
    recv_splits = [sum(1 for m in recvs if m.src_rank == r) for r in range(world)]
    for weights in tensors:
        if weights.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            weights = weights.view(torch.uint8)  # gloo has no fp8 type; the bytes travel as they are
        device = weights.device
        rows = {}
        local = [m for m in mine if m.src_rank == rank]
        if local:
            src = torch.tensor([m.src_row for m in local], device=device)
            rows.update(zip((m.dst_row for m in local), weights.index_select(0, src)))
        if remote:
            send = weights.index_select(0, torch.tensor([m.src_row for m in sends], dtype=torch.int64,
                                                        device=device))
            recv = weights.new_empty((len(recvs), *weights.shape[1:]))
            dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                   group=group)
            rows.update(zip((m.dst_row for m in recvs), recv))
        if rows:
            dst = torch.tensor(list(rows), dtype=torch.int64, device=device)
            weights.index_copy_(0, dst, torch.stack(list(rows.values())))


def align(old: ExpertPlacement, slots: list[int], ranks_per_node: int) -> list[int]:
    """``slots`` (a new slot -> expert list) with each node's per-rank slot lists handed to that node's ranks, and
    each list's order, chosen to keep as many experts where they already are: the same per-rank loads, fewer
    moves. Greedy: the (new list, rank) pair sharing the most experts first."""
    per_rank = old.slots_per_rank
    lists = [slots[r * per_rank:(r + 1) * per_rank] for r in range(old.ep_size)]
    out: list[list[int]] = [[] for _ in range(old.ep_size)]
    for first in range(0, old.ep_size, ranks_per_node):
        ranks = range(first, first + ranks_per_node)
        pairs = sorted(((-_shared(lists[i], old.local_experts(r)), i, r) for i in ranks for r in ranks))
        taken_lists, taken_ranks = set(), set()
        for _, i, r in pairs:
            if i in taken_lists or r in taken_ranks:
                continue
            taken_lists.add(i)
            taken_ranks.add(r)
            out[r] = _keep_rows(old.local_experts(r), lists[i])
    return [e for rank in out for e in rank]


def _shared(a: list[int], b: list[int]) -> int:
    rest = list(b)
    n = 0
    for e in a:
        if e in rest:
            rest.remove(e)
            n += 1
    return n


def _keep_rows(before: list[int], experts: list[int]) -> list[int]:
    """``experts`` ordered so that an expert already in a row stays in that row."""
    rest = sorted(experts)
    rows: list[int | None] = [None] * len(before)
    for row, e in enumerate(before):
        if e in rest:
            rest.remove(e)
            rows[row] = e
    return [e if e is not None else rest.pop(0) for e in rows]
