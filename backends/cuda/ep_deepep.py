"""Expert-parallel dispatch / combine on DeepEP's normal (high-throughput) kernels, where the user built ``deep_ep``.

DeepEP sends each token once to every rank that owns one of its experts (not once per (token, choice)), with its
top-k expert ids made local to that rank (-1: an expert elsewhere) and its router weights. On the expert's rank the
rows are then expanded to (token, local choice) and sorted by local slot with the kernel set's own ``moe_dispatch``
(the -1 choices into a sink slot past the real ones, cut off by the count DeepEP returns on the host). The combine
weights each received token's local outputs in fp32 with the kernel set's ``moe_combine`` and DeepEP adds the
ranks' partial sums on the token's own rank (DeepEP's combine adds without weights).

Where it serves: bf16, an EP world size DeepEP has a configuration for, and a step the engine did not declare as a
decode step (``ep_decode_path``): DeepEP's normal mode returns its receive counts to the host, so decode steps keep
the fixed-capacity all-to-all, which is capturable. Elsewhere the reference's variable splits. The result is the
reference's up to one more bf16 rounding (each rank's partial sum is rounded before DeepEP adds them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_npu.hal.types import EPDispatched
from deepinfer_npu.vendor import deep_ep

# the EP world sizes DeepEP's Buffer.get_dispatch_config / get_combine_config hold a configuration for
DEEPEP_WORLD_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)


@dataclass
class DeepEPState:
    """What the combine needs: the DeepEP buffer and its dispatch result, the local sort of its (token, choice)
    rows, the weights of the local choices (0 for the sink) and the real rows' count."""

    buffer: deep_ep.ExpertDispatch
    dispatched: deep_ep.Dispatched
    local: object  # the kernel set's DispatchState of the expansion
    local_weights: torch.Tensor  # [received tokens, k] fp32
    num_rows: int  # real (token, local choice) rows: the host count DeepEP returned


class DeepEPNormalMode:
    """Kernel-set mixin (first in the bases): ``ep_dispatch`` / ``ep_combine`` on DeepEP where
    :meth:`deep_ep_reason` allows, else the next class's path (fixed capacity for declared decode steps, variable
    splits otherwise)."""

    def deep_ep_reason(self, hidden, slots, placement, group, weights) -> str | None:
        """Why this dispatch does not take DeepEP, or None: from host facts every rank shares (the choice is a
        collective's), given the same ``deep_ep`` build on every rank."""
        if self.ep_capacity(slots.shape[1]) is not None:
            return "a declared decode step: the fixed-capacity all-to-all (capturable)"
        status = self.__dict__.get("_deep_ep_status")
        if status is None:  # probed once per kernel set (an absent module's import is searched for each time)
            status = self.__dict__["_deep_ep_status"] = deep_ep.probe()
        if not status.available:
            return status.reason
        if weights is None:
            return "the router weights were not passed to the dispatch"
        if hidden.dtype != torch.bfloat16:
            return f"{hidden.dtype}: DeepEP's normal dispatch moves bf16"
        world = group.size() if group is not None else torch.distributed.get_world_size()
        if world not in DEEPEP_WORLD_SIZES:
            return f"EP world size {world}: DeepEP has configurations for {DEEPEP_WORLD_SIZES}"
        return None

    def _deep_ep_buffer(self, group, num_slots: int, hidden: torch.Tensor) -> deep_ep.ExpertDispatch:
        """One DeepEP buffer per (group, expert slots, row bytes), made at the first dispatch (a collective: every
        rank reaches it in the same layer)."""
        buffers = self.__dict__.setdefault("_deep_ep_buffers", {})
        key = (id(group), num_slots, hidden.shape[1] * hidden.element_size())
        entry = buffers.get(key)
        if entry is None or entry[0] is not group:
            entry = buffers[key] = (group, deep_ep.ExpertDispatch(group, num_slots, key[2]))
        return entry[1]

    def ep_dispatch(self, hidden, slots, placement, group, weights=None) -> EPDispatched:
        if self.deep_ep_reason(hidden, slots, placement, group, weights) is not None:
            return super().ep_dispatch(hidden, slots, placement, group, weights)
        spr = placement.slots_per_rank
        buffer = self._deep_ep_buffer(group, placement.num_slots, hidden)
        d = buffer.dispatch(hidden, slots, weights)
        ids = d.ids.long()
        local = ids >= 0
        sink_ids = torch.where(local, ids, torch.full_like(ids, spr)).to(torch.int32)
        rows, counts, state = self.moe_dispatch(d.hidden, sink_ids, spr + 1)  # the sink slot sorts last
        num_rows = int(sum(d.tokens_per_expert))  # DeepEP's host list: no extra read
        local_weights = torch.where(local, d.weights.float(), torch.zeros_like(d.weights, dtype=torch.float32))
        return EPDispatched(rows[:num_rows], counts[:spr], DeepEPState(buffer, d, state, local_weights,
                                                                            num_rows))

    def ep_combine(self, expert_out, dispatched: EPDispatched, weights, group) -> torch.Tensor:
        st = dispatched.state
        if not isinstance(st, DeepEPState):
            return super().ep_combine(expert_out, dispatched, weights, group)
        full = expert_out.new_zeros((st.local_weights.numel(), expert_out.shape[1]))  # sink rows: zero
        full[: st.num_rows] = expert_out
        partial = self.moe_combine(full, st.local, st.local_weights)  # [received tokens, D], fp32 sums
        return st.buffer.combine(partial, st.dispatched)
