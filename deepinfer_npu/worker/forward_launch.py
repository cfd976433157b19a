"""Phase 1 of a step: the block / state-slot operations the scheduler planned, then the launch of the forward.

A decode step's inputs come from the per-slot device state (``SlotState``): under zero-overhead scheduling the
scheduler planned the step before the previous one's tokens were known, so ``zos_fixup`` corrects the lengths (and,
with varlen, re-splits the drafts) on the device, and ``decode_inputs`` builds positions, cache slots and input ids
there. A decode forward replays a captured graph when one fits, else runs eagerly; under expert parallelism the graph
is the one of the step's declared (rank-agreed) size, whatever this rank's own batch (``decode_graphs.py``).

A mixin of ``Worker``: it reads the worker's ``runner``, ``backend``, ``kernels``, ``slots``, ``drafter``, ``graphs``
and ``k``, and returns the step's ``DeviceStepState``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from deepinfer_npu.distributed.ep_decode_path import current_agreed_ep_tokens
from deepinfer_npu.model_executor.attention_metadata import AttentionMetadata, HostLengths
from deepinfer_npu.model_executor.device_metadata import build_device_metadata
from deepinfer_npu.worker.step_io import DeviceStepState, StepPlan, StepRequests


class ForwardLaunch:
    """``_launch_forward``: the planned state operations, the step's device inputs and its forward."""

    def _apply_state_ops(self, plan: StepPlan) -> None:
        extra = self.drafter.kv_caches if self.drafter is not None and hasattr(self.drafter, "kv_caches") else None
        self.runner.apply_block_ops(plan, extra)
        if plan.zero_states.size:
            z = self._dev(plan.zero_states)
            self.slots.zero(z)
            if self.drafter is not None:
                self.drafter.zero_slots(z)
        if plan.clone_states.size:
            src, dst = self._dev(plan.clone_states[:, 0]), self._dev(plan.clone_states[:, 1])
            self.slots.clone(src, dst)
            if self.drafter is not None:
                self.drafter.clone_slots(src, dst)

    def _launch_forward(self, plan: StepPlan, reqs: StepRequests) -> DeviceStepState:
        start_event = None
        if self.step_events is not None:
            start_event = self.backend.create_event(enable_timing=True)
            start_event.record()
        self._apply_state_ops(plan)
        max_q, max_k = int(plan.seqlens_q.max()), int(plan.seqlens_k.max())
        host_ids = plan.input_ids.astype(np.int64)
        draft_next = None
        host = HostLengths(tuple(plan.seqlens_q.tolist()), tuple(plan.seqlens_k.tolist()), True, max_q, max_k)
        # the step's host inputs, all known here
        inputs = [(plan.seqlens_q, torch.int32), (plan.seqlens_k, torch.int32), (plan.block_tables, torch.int32),
                  (plan.state_slots, torch.int64)]
        if plan.is_prefill:
            sq, sk, tables, slots, ids = self._dev_many(inputs + [(host_ids, torch.int64)])
            attn, row, j = build_device_metadata(sq, sk, tables, self.runner.block_size, plan.num_tokens,
                                                 max_q, max_k, True, host)
        else:
            first_host = host_ids[plan.row_starts]
            optimistic_host = first_host < 0
            resplit = self.varlen and bool(optimistic_host.any()) and self.backend.supports_device_resplit
            inputs += [(optimistic_host, torch.bool), (first_host, torch.int64)]
            sq, sk, tables, slots, optimistic, first, *caps = self._dev_many(
                inputs + ([(reqs.draft_caps, torch.int64)] if resplit else []))
            sq, sk = self.kernels.zos_fixup(
                sq, sk, optimistic, slots, self.slots.correction,
                self.slots.draft_probs if resplit else None,
                caps[0] if resplit else None,
            )
            if resplit:  # a row may now verify up to k drafts (within its reservation); host q lengths unknown
                # The previous step may have been re-split to more drafts than planned: +k there, +k here.
                max_q, max_k, host = self.k + 1, max_k + 2 * self.k, None
            elif optimistic_host.any():  # exact query lengths; context lengths only as upper bounds, short by
                # at most the in-flight step's drafts (correction = planned drafts - accepted <= k)
                host = HostLengths(host.seqlens_q, host.seqlens_k, False, max_q, max_k, max_kv_shortfall=self.k)
            # one op (a kernel on CUDA): positions, cache slots, the tokens' rows and input ids from the slot state
            d = self.kernels.decode_inputs(sq, sk, tables, slots, first, self.slots.last_token,
                                           self.slots.drafts, self.runner.block_size, plan.num_tokens)
            attn = AttentionMetadata(seqlens_q=sq.to(torch.int32), seqlens_k=sk.to(torch.int32),
                                     cu_seqlens_q=d.cu_seqlens_q, block_tables=tables, slot_mapping=d.slot_mapping,
                                     positions=d.positions, max_seqlen_q=max_q, max_seqlen_k=max_k, is_prefill=False,
                                     host=host)
            row, j, ids, draft_next = d.row_of_token, d.j_of_token, d.input_ids, d.draft_next
        capture = self.drafter.capture_layer_ids if self.drafter is not None else None
        t_model = time.perf_counter()
        # Varlen's online estimators need the device time of the forward and of the sampling phase; on a device
        # the host clock only sees launches. Timing events around both, read after the step's end event.
        fwd_events = None
        if self.varlen and self.backend.device_type != "cpu":
            fwd_events = (self.backend.create_event(enable_timing=True), self.backend.create_event(enable_timing=True))
            fwd_events[0].record()
        size = None
        if self.graphs is not None and not plan.is_prefill:
            # under expert parallelism the graph of the step's declared size on every rank, whatever this rank's
            # own T (a dummy step's one row included): a graph bakes in its all-to-all capacity
            agreed = current_agreed_ep_tokens()
            tokens = plan.num_tokens if agreed is None else max(plan.num_tokens, agreed)
            size = self.graphs.pick(tokens, plan.block_tables.shape[1])
        hook_in_graph = size is not None and self.graphs.drafter_hook is not None
        slots_per_token = slots.index_select(0, row) if self.drafter is not None else None
        replayed = None
        if size is not None:
            replayed = (self.graphs.run(size, ids, attn, slots_per_token=slots_per_token) if hook_in_graph
                        else self.graphs.run(size, ids, attn))
        if replayed is not None:  # the captured decode forward (logits of every row included)
            hidden, captured, logits = replayed
            self.graph_steps += 1
        else:
            size, hook_in_graph = None, False  # eager (no graph for this step, or its capture failed)
            hidden, captured = self.runner.forward(ids, attn, capture)
        if self.drafter is not None and not hook_in_graph:  # else the graph did the drafter's capture
            self.drafter.on_main_forward(attn, captured, slots_per_token)
        if plan.is_prefill:
            ends = np.cumsum(plan.seqlens_q.astype(np.int64)) - 1
            logits = self.runner.logits(hidden, self._dev(ends[plan.is_last_chunk]))
        elif size is None:
            logits = self.runner.logits(hidden, None)
        model_ms = (time.perf_counter() - t_model) * 1e3  # host-timed: exact on CPU, launch time on devices
        if fwd_events is not None:
            fwd_events[1].record()
        step = DeviceStepState(model_ms=model_ms, plan=plan, attn=attn, row_of_token=row, j_of_token=j, input_ids=ids,
                               hidden=hidden, captured=captured, logits=logits, draft_next=draft_next,
                               slots=slots, seqlens_q=attn.seqlens_q)
        step.start_event = start_event
        step.fwd_events = fwd_events
        return step
