"""Where each routed expert goes: DeepSeek's hierarchical EPLB policy, written from its published description.

Inputs: the load of every logical expert in every MoE layer (``weight`` [L, E], tokens routed over a window), the
number of physical expert slots ``S`` (``E`` plus the redundant ones), the nodes and the devices (EP ranks).
Output: ``phy2log`` [L, S] int64, the logical expert held by each physical slot; device ``d`` owns slots
``[d * S/ranks, (d + 1) * S/ranks)``.

Hierarchical policy (expert groups divide over the nodes; keeps a token's group-limited routing on few nodes):
1. pack the expert groups onto the nodes, each node the same number of groups, evening the nodes' loads;
2. inside each node, give its ``S / nodes`` slots to its experts: one each, then each extra slot to the expert
   with the largest load per replica (a replica serves an equal share of its expert's tokens);
3. pack each node's replicas onto its devices, each device the same number of slots, evening their loads.
Packing is greedy (heaviest first into the lightest pack with room) followed by pairwise swaps that lower the
heaviest pack, a refinement over the published greedy step.
When the groups do not divide over the nodes the global policy runs instead: one group, one node (replicate over
all slots, pack onto all devices).

A pure function of its inputs. The result is never less balanced than the same packing without replicas (extra
slots then holding a second copy of an expert beside itself, which changes no device's load): the policy returns
that when its replicated plan would be worse on the given load.
"""

from __future__ import annotations

import torch


def num_redundant_experts(num_logical: int, ep_size: int, floor: int) -> int:
    """The smallest count ``>= floor`` that makes ``num_logical + count`` divisible by ``ep_size``."""
    if num_logical < 1 or ep_size < 1 or floor < 0:
        raise ValueError(f"need num_logical >= 1, ep_size >= 1, floor >= 0; got {num_logical}, {ep_size}, {floor}")
    return floor + (-(num_logical + floor)) % ep_size


def balanced_packing(weight: torch.Tensor, num_packs: int) -> torch.Tensor:
    """``weight`` [L, N] -> ``pack`` [L, N] int64: each item's pack, ``N / num_packs`` items a pack.

    Heaviest item first into the lightest pack that still has room (ties: the lower pack index), per layer; then
    pairwise swaps out of the heaviest pack while one lowers it (``_refine``: never raises the heaviest pack)."""
    num_layers, num_items = weight.shape
    if num_items % num_packs:
        raise ValueError(f"{num_items} items do not divide into {num_packs} equal packs")
    per_pack = num_items // num_packs
    pack = torch.empty(num_layers, num_items, dtype=torch.int64)
    w = weight.double()
    for layer in range(num_layers):
        row = w[layer].tolist()
        loads = [0.0] * num_packs
        members: list[list[int]] = [[] for _ in range(num_packs)]
        # stable order: equal weights keep their index order, so the result is deterministic
        for item in torch.argsort(-w[layer], stable=True).tolist():
            best = min((p for p in range(num_packs) if len(members[p]) < per_pack), key=lambda p: (loads[p], p))
            members[best].append(item)
            loads[best] += row[item]
        _refine(row, members, loads)
        for p, items in enumerate(members):
            pack[layer, items] = p
    return pack


def _refine(weight: list[float], members: list[list[int]], loads: list[float], max_rounds: int = 64) -> None:
    """Swap an item of the heaviest pack with a lighter item of another pack while the swap leaves both packs
    below the heaviest one's load (the best such swap each round)."""
    for _ in range(max_rounds):
        heavy = max(range(len(loads)), key=lambda p: (loads[p], -p))
        best = None  # (resulting max of the two packs, heavy item index, other pack, other item index)
        for other in range(len(loads)):
            if other == heavy:
                continue
            for i, a in enumerate(members[heavy]):
                for j, b in enumerate(members[other]):
                    delta = weight[a] - weight[b]
                    if delta <= 0:
                        continue
                    worst = max(loads[heavy] - delta, loads[other] + delta)
                    if worst < loads[heavy] - 1e-12 * max(1.0, loads[heavy]) and (best is None or worst < best[0]):
                        best = (worst, i, other, j)
        if best is None:
            return
        _, i, other, j = best
        a, b = members[heavy][i], members[other][j]
        members[heavy][i], members[other][j] = b, a
        delta = weight[a] - weight[b]
        loads[heavy] -= delta
        loads[other] += delta


def replicate(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [L, N] -> ``(slot_item [L, num_slots], count [L, N])``: every item once, then each extra slot to
    the item with the largest load per replica (ties: the lower index)."""
    num_layers, num_items = weight.shape
    if num_slots < num_items:
        raise ValueError(f"{num_slots} slots cannot hold {num_items} experts")
    slot_item = torch.empty(num_layers, num_slots, dtype=torch.int64)
    slot_item[:, :num_items] = torch.arange(num_items)
    count = torch.ones(num_layers, num_items, dtype=torch.int64)
    w = weight.double()
    for slot in range(num_items, num_slots):
        hottest = torch.argmax(w / count, dim=-1)  # first maximum on ties
        slot_item[:, slot] = hottest
        count[torch.arange(num_layers), hottest] += 1
    return slot_item, count


def _hierarchical(weight: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int,
                  num_devices: int) -> torch.Tensor:
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    slots_per_node = num_slots // num_nodes
    devices_per_node = num_devices // num_nodes

    # 1. groups onto nodes. node_order [L, E]: the logical experts listed node by node (the node's groups in
    # increasing group index, each group's experts in order)
    group_node = balanced_packing(weight.view(num_layers, num_groups, group_size).sum(-1), num_nodes)
    group_rank = group_node * num_groups + torch.arange(num_groups)  # sort key: node first, then group index
    group_order = torch.argsort(group_rank, dim=-1)  # [L, G]
    node_order = (group_order.unsqueeze(-1) * group_size + torch.arange(group_size)).flatten(1)  # [L, E]
    node_weight = weight.gather(1, node_order).view(num_layers * num_nodes, -1)  # [L * nodes, E / nodes]

    # 2. replicas inside each node
    slot_item, count = replicate(node_weight, slots_per_node)  # [L * nodes, S / nodes]
    replica_load = node_weight.double().gather(1, slot_item) / count.gather(1, slot_item)

    # 3. the node's replicas onto its devices; inside a device, slots ordered by item (then replica) index
    device = balanced_packing(replica_load, devices_per_node)  # [L * nodes, S / nodes]
    key = (device * slots_per_node + slot_item) * slots_per_node + torch.arange(slots_per_node)
    placed = slot_item.gather(1, torch.argsort(key, dim=-1))  # node-local item per slot, device by device
    node_offset = (torch.arange(num_layers * num_nodes) % num_nodes).unsqueeze(1) * (num_logical // num_nodes)
    return node_order.gather(1, (placed + node_offset).view(num_layers, -1))


def device_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_devices: int) -> torch.Tensor:
    """``[L, num_devices]`` float64: each device's share of the load when an expert's tokens split evenly over
    its replicas."""
    num_layers, num_logical = weight.shape
    count = torch.zeros(num_layers, num_logical, dtype=torch.float64)
    count.scatter_add_(1, phy2log, torch.ones_like(phy2log, dtype=torch.float64))
    per_slot = weight.double().gather(1, phy2log) / count.gather(1, phy2log)
    return per_slot.view(num_layers, num_devices, -1).sum(-1)


def rebalance_experts(weight: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int,
                      num_devices: int) -> torch.Tensor:
    """``weight`` [L, E] (non-negative loads) -> ``phy2log`` [L, num_slots] int64 (see the module docstring)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {tuple(weight.shape)}")
    if bool((weight < 0).any()):
        raise ValueError("expert loads must be non-negative")
    num_layers, num_logical = weight.shape
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes), ("num_devices", num_devices)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_slots < num_logical or num_slots % num_devices:
        raise ValueError(f"num_slots={num_slots} must be >= the {num_logical} experts and divisible by "
                         f"num_devices={num_devices}")
    if num_devices % num_nodes:
        raise ValueError(f"num_devices={num_devices} is not divisible by num_nodes={num_nodes}")
    weight = weight.double().cpu()
    hierarchical = num_logical % num_groups == 0 and num_groups % num_nodes == 0
    if hierarchical:
        plan = _hierarchical(weight, num_slots, num_groups, num_nodes, num_devices)
    else:  # the global policy
        plan = _hierarchical(weight, num_slots, 1, 1, num_devices)
    if num_logical % num_devices:
        return plan  # no placement without replicas exists to compare with
    baseline = _without_replicas(weight, num_slots, num_groups if hierarchical else 1,
                                 num_nodes if hierarchical else 1, num_devices)
    worse = device_loads(weight, plan, num_devices).amax(-1) > device_loads(weight, baseline, num_devices).amax(-1)
    return torch.where(worse.unsqueeze(1), baseline, plan)


def _without_replicas(weight: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int,
                      num_devices: int) -> torch.Tensor:
    """The same policy with one slot per expert; each device's extra slots repeat its own first expert."""
    num_layers, num_logical = weight.shape
    single = _hierarchical(weight, num_logical, num_groups, num_nodes, num_devices).view(num_layers, num_devices, -1)
    extra = num_slots // num_devices - single.shape[-1]
    pad = single[:, :, :1].expand(-1, -1, extra)
    return torch.cat((single, pad), dim=-1).reshape(num_layers, num_slots)
