"""The engine's step loop: admit compiled requests, schedule, launch on the worker, apply the results.

Under zero-overhead scheduling the worker keeps a decode step in flight, so the results applied by a step are
usually the previous step's; a step with nothing scheduled flushes the kept one. With a step group (data-parallel
ranks with expert-parallel MoE) the ranks vote on the step kind first, and a rank with nothing scheduled runs a
dummy step while another has work, so the collectives inside the model pair up (``distributed/step_vote.py``); a
decode step declares the agreed token count rounded up to a decode graph size, the graph every rank replays.

A mixin of ``LLMEngine``: it reads the engine's ``scheduler``, ``worker``, ``lock``, ``_router``, ``stats`` and
request tables, and hands results to ``OutputProcessing``.
"""

from __future__ import annotations

import threading
import time

from deepinfer_npu import _core
from deepinfer_npu.distributed.ep_decode_path import agreed_ep_tokens
from deepinfer_npu.distributed.step_vote import agree_decode_size, confirm_step, vote_prefill
from deepinfer_npu.engine.input_processing import build_step_requests
from deepinfer_npu.engine.outputs import RequestOutput
from deepinfer_npu.worker.decode_graphs import ep_decode_tokens
from deepinfer_npu.worker.step_io import StepPlan, StepRequests, StepResult
from deepinfer_npu.worker.worker import DUMMY_SEQ_ID, dummy_plan


class StepLoop:
    """``step`` / ``step_for_sinks``: one scheduled step and its outputs, alone or in lockstep with other ranks."""

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the outputs of requests added without an output sink that
        progressed or finished (also those produced by steps other threads ran since the last call)."""
        with self.lock:
            return self._router.route(self._step(), for_step_caller=True)

    def step_for_sinks(self) -> None:
        """Run one step for callers waiting on output sinks (``LLM.generate``): sink outputs go to their sinks,
        the outputs of sink-less requests are kept for the next ``step()``."""
        with self.lock:
            self._router.route(self._step(), for_step_caller=False)

    def attach_step_group(self, group) -> None:
        """Run every step in lockstep with the other data-parallel ranks of ``group`` (a gloo CPU group): the
        two-round vote decides the step kind for all, and a rank with nothing scheduled runs a dummy step so the
        expert-parallel collectives inside the model pair up (``distributed/step_vote.py``)."""
        self._step_group = group

    def _step(self) -> list[RequestOutput]:
        if self._step_group is not None:
            return self._step_lockstep()
        if threading.get_ident() != self._stepping_thread:
            self._bind_device_to_thread()
        t0 = time.perf_counter()
        self._admit_compiled()
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.scheduler.num_running == 0:
            # nothing runs: a burst arriving now prefills at once, its attempt points counted from here
            self.scheduler.restart_attempt_points()
        vote = self.scheduler.prefill_vote()
        out = self.scheduler.schedule(vote != 0)
        outputs += self._finished_by_scheduler(out.finished)
        if vote != 0 and out.kind == _core.StepKind.PREFILL and out.num_seqs == 0:
            # Round two of the vote on one rank: nothing could be prefilled, run decode instead.
            out = self.scheduler.schedule(False)
            outputs += self._finished_by_scheduler(out.finished)
        if out.num_seqs == 0:
            results = self.worker.flush()
        else:
            results = self._run_plan(StepPlan.from_schedule(self._step_id, out, out.kind == _core.StepKind.PREFILL))
        outputs += self._apply_results(results)
        self.stats["step_ms"] += (time.perf_counter() - t0) * 1e3
        return outputs

    def _step_lockstep(self) -> list[RequestOutput]:
        if threading.get_ident() != self._stepping_thread:
            self._bind_device_to_thread()
        group = self._step_group
        t0 = time.perf_counter()
        self._admit_compiled()
        outputs, self._pending_outputs = self._pending_outputs, []
        round_one = vote_prefill(self.scheduler.prefill_vote(), self.scheduler.num_running == 0, group)
        if round_one.group_idle:  # every rank restarts together: the attempt points stay aligned across ranks
            self.scheduler.restart_attempt_points()
        prefill = round_one.prefill
        out = self.scheduler.schedule(prefill)
        outputs += self._finished_by_scheduler(out.finished)
        agreed = confirm_step(prefill, out.num_seqs if prefill else 0, out.num_tokens, group)
        if prefill and not agreed.prefill:  # round two: no rank could prefill; every rank decodes instead
            prefill = False
            out = self.scheduler.schedule(False)
            outputs += self._finished_by_scheduler(out.finished)
            step_tokens = agree_decode_size(out.num_tokens, group)
        else:
            step_tokens = agreed.max_num_tokens
        any_work = step_tokens > 0
        self.last_step_had_work = any_work
        # a decode step's MoE forwards (main model, drafter, a dummy row) never exceed the group's largest step,
        # rounded up to its decode graph's size (every rank replays that graph or runs eagerly inside the same
        # declaration): the kernel set may size a fixed-capacity expert all-to-all from it
        # (distributed/ep_decode_path.py, worker/decode_graphs.py)
        with agreed_ep_tokens(None if prefill or not any_work else self._ep_decode_tokens(step_tokens)):
            if out.num_seqs:
                results = self._run_plan(StepPlan.from_schedule(self._step_id, out, prefill))
            elif any_work:
                results = self.worker.execute_dummy_step(prefill, self._step_requests(dummy_plan(prefill)))
            else:
                results = self.worker.flush()
        outputs += self._apply_results([r for r in results if not _is_dummy(r)])
        self.stats["step_ms"] += (time.perf_counter() - t0) * 1e3
        return outputs

    def _ep_decode_tokens(self, step_tokens: int) -> int:
        """The token count a decode step declares to the expert-parallel kernels: the group's agreed count rounded
        up to a decode graph size (the same on every rank: the sizes come from the shared configuration)."""
        graphs = self.worker.graphs
        return ep_decode_tokens(step_tokens, graphs.sizes if graphs is not None else None)

    def _run_plan(self, plan: StepPlan) -> list[StepResult]:
        self._step_id += 1
        results = self.worker.execute_model_step(plan, self._step_requests(plan))
        self.stats["num_steps"] += 1
        self.stats["prefill_steps" if plan.is_prefill else "decode_steps"] += 1
        if plan.is_prefill:
            self.stats["prompt_tokens"] += plan.num_tokens
        return results

    def _bind_device_to_thread(self) -> None:
        """The current device is per thread (CUDA, NPU): a step run by another thread than the one that built
        the engine selects the engine's device first."""
        self._stepping_thread = threading.get_ident()
        if self.backend.device_type == "cpu":
            return
        import torch

        module = getattr(torch, self.backend.device_type, None)
        if module is not None and hasattr(module, "set_device"):
            module.set_device(self.backend.device_index)

    def _step_requests(self, plan: StepPlan) -> StepRequests:
        return build_step_requests(plan, self._by_seq, self.config.nextn, self.max_model_len, self._eos_ids)


def _is_dummy(result: StepResult) -> bool:
    return result.seq_ids.size == 1 and int(result.seq_ids[0]) == DUMMY_SEQ_ID
