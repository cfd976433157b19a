"""Where each routed expert lives in an expert-parallel group: the logical -> physical expert map.

The routed experts of a MoE layer (logical experts, as the router numbers them) are placed on physical slots;
rank ``r`` of an EP group of ``ep_size`` owns slots ``[r * slots_per_rank, (r + 1) * slots_per_rank)``. By default
the placement is contiguous, one slot per expert; a load balancer may rewrite it and add replicas of hot experts
(more slots than experts). A token routed to a logical expert with several replicas goes to one of them, chosen
deterministically by the token's index plus an offset (the rank and the step: see ``RouteTable``), so the same
batch always takes the same path. ``RouteTable`` keeps a placement's replica table on the device, built once per
placement, so routing is two gathers with no host work or transfer per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    num_logical: int
    ep_size: int
    slot_to_logical: tuple[int, ...]  # physical slot -> logical expert; len = ep_size * slots_per_rank

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        if len(self.slot_to_logical) % self.ep_size:
            raise ValueError(f"{len(self.slot_to_logical)} physical expert slots do not divide evenly over "
                             f"ep_size={self.ep_size} ranks")
        bad = [e for e in self.slot_to_logical if not 0 <= e < self.num_logical]
        if bad:
            raise ValueError(f"placement names logical experts {bad[:4]} outside [0, {self.num_logical})")
        missing = sorted(set(range(self.num_logical)) - set(self.slot_to_logical))
        if missing:
            raise ValueError(f"logical experts {missing[:8]} have no physical slot")

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Rank ``r`` holds experts ``[r * E / ep, (r + 1) * E / ep)``."""
        if num_experts % ep_size:
            raise ValueError(f"n_routed_experts={num_experts} is not divisible by the expert-parallel size "
                             f"{ep_size}; pick an EP size that divides it")
        return cls(num_logical=num_experts, ep_size=ep_size, slot_to_logical=tuple(range(num_experts)))

    @property
    def num_slots(self) -> int:
        return len(self.slot_to_logical)

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    def local_experts(self, rank: int) -> list[int]:
        """The logical experts whose weights rank ``rank`` holds, in slot order (its stacked expert tensors)."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank {rank} is outside the EP group of size {self.ep_size}")
        n = self.slots_per_rank
        return list(self.slot_to_logical[rank * n:(rank + 1) * n])

    def replica_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots [E, R] int64, padded with -1; counts [E] int64)``: the physical replicas of each expert."""
        replicas: list[list[int]] = [[] for _ in range(self.num_logical)]
        for slot, expert in enumerate(self.slot_to_logical):
            replicas[expert].append(slot)
        width = max(len(r) for r in replicas)
        table = torch.full((self.num_logical, width), -1, dtype=torch.int64)
        for expert, slots in enumerate(replicas):
            table[expert, :len(slots)] = torch.tensor(slots, dtype=torch.int64)
        return table, torch.tensor([len(r) for r in replicas], dtype=torch.int64)

    def route(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Logical expert ids [T, k] -> physical slots [T, k]; replica = (token index + offset) mod the replica
        count. Builds the table on each call: layers that route every step keep a ``RouteTable``."""
        return RouteTable(self, ids.device).route(ids, offset)


class RouteTable:
    """A placement's replica table on the device: ``slots`` [E, R] (padded with -1) and ``counts`` [E]."""

    def __init__(self, placement: ExpertPlacement, device: torch.device | str) -> None:
        table, counts = placement.replica_table()
        self.placement = placement
        self.slots = table.to(device)
        self.counts = counts.to(device)

    def route(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Logical expert ids [T, k] -> physical slots [T, k]; replica = (token index + ``offset``) mod the
        expert's replica count. Device ops only (``offset`` is a host integer)."""
        logical = ids.long()
        token = torch.arange(offset, offset + ids.shape[0], device=ids.device).unsqueeze(1)
        replica = token % self.counts[logical]
        return self.slots[logical, replica]
