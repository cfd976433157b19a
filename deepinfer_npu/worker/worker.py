"""Worker: the single entry of every step, in the seed's four phases (§4.2, §6.2).

``execute_model_step`` always does:

1. launch the forward of step N (no waiting);
2. post-process step N-1 if it was deferred — the only place that waits (on N-1's sample-end event);
3. launch the sampling of step N;
4. post-process N at once for prefill steps or with zero-overhead scheduling (ZOS) off; a ZOS decode step is kept
   and post-processed by the next call, so the CPU schedules N+1 while the device still runs N.

Under ZOS the scheduler plans N+1 before N's tokens are known: rows whose input token is ``-1`` take it from N's
sampled tokens on the device (``prev_remap`` gives each row's row in N). The CPU backend runs the identical code
path, only without overlap, so ZOS on and off must produce identical tokens.
"""

from __future__ import annotations

import time

import torch

from deepinfer_npu.worker.model_runner import ModelRunner
from deepinfer_npu.worker.step_io import DeviceStepState, StepPlan, StepResult


class Worker:
    def __init__(self, runner: ModelRunner, backend, zero_overhead_scheduling: bool) -> None:
        self.runner = runner
        self.backend = backend
        self.zos = zero_overhead_scheduling
        self.prev: DeviceStepState | None = None  # deferred ZOS decode step awaiting post-processing
        self.step_times: list[tuple[float, float]] = []  # (forward_ms, sample_ms) per step, for stats

    @property
    def has_pending_step(self) -> bool:
        return self.prev is not None

    def execute_model_step(self, plan: StepPlan, sampling_tensors) -> list[StepResult]:
        results: list[StepResult] = []
        # 1. launch forward N
        t0 = time.perf_counter()
        with self.backend.forbid_sync():
            self.runner.apply_block_ops(plan)
            input_ids = self._input_ids(plan)
            ids, attn, sample_rows = self.runner.prepare(plan, input_ids)
            logits = self.runner.forward(ids, attn, sample_rows)
        t1 = time.perf_counter()
        # 2. post-process N-1 (waits on its sample-end event only)
        if self.prev is not None:
            results.append(self._post_process(self.prev))
            self.prev = None
        # 3. launch sample N
        t2 = time.perf_counter()
        with self.backend.forbid_sync():
            sampler_out = self.runner.sample(logits, sampling_tensors)
            event = self.backend.create_event()
            event.record()
        t3 = time.perf_counter()
        state = DeviceStepState(
            plan=plan,
            sample_rows=sample_rows,
            sampled_token_ids=sampler_out.token_ids,
            logprobs=sampler_out.logprobs,
            sample_end_event=event,
            t_forward_ms=(t1 - t0) * 1e3,
            t_sample_ms=(t3 - t2) * 1e3,
        )
        # 4. post-process now, or keep N for the next call
        if plan.is_prefill or not self.zos:
            results.append(self._post_process(state))
        else:
            self.prev = state
        return results

    def flush(self) -> list[StepResult]:
        """Post-process a deferred step when no further step is launched."""
        if self.prev is None:
            return []
        state, self.prev = self.prev, None
        return [self._post_process(state)]

    def discard_pending(self) -> None:
        self.prev = None

    # ---------------------------------------------------------------- internals
    def _input_ids(self, plan: StepPlan) -> torch.Tensor | None:
        """Host ids, with rows the CPU could not know (-1) gathered from the previous step's device outputs."""
        host = torch.from_numpy(plan.input_ids.astype("int64"))
        missing = host < 0
        if not bool(missing.any()):
            return None
        if self.prev is None or plan.prev_remap is None:
            raise RuntimeError(
                f"step {plan.step_id}: {int(missing.sum())} input ids must come from the previous step, "
                "but no previous step is in flight"
            )
        device = self.runner.device
        ids = host.to(device)
        remap = torch.from_numpy(plan.prev_remap.astype("int64")).to(device)
        starts = torch.from_numpy(
            (plan.seqlens_q.astype("int64").cumsum() - plan.seqlens_q.astype("int64"))
        ).to(device)
        # Without speculation the previous step samples exactly one token per row, in row order.
        prev_tokens = self.prev.sampled_token_ids.to(device)
        gathered = prev_tokens.index_select(0, remap.clamp(min=0))
        row_ids = ids.index_select(0, starts)
        row_ids = torch.where(row_ids < 0, gathered, row_ids)
        return ids.index_copy(0, starts, row_ids)

    def _post_process(self, state: DeviceStepState) -> StepResult:
        state.sample_end_event.synchronize()
        plan = state.plan
        sampled = state.sampled_token_ids.to("cpu").tolist()
        logprobs = state.logprobs
        lp_rows = None
        if logprobs is not None:
            lp_rows = [
                (float(logprobs.sampled_logprob[i]), int(logprobs.sampled_rank[i]),
                 logprobs.top_ids[i].tolist(), logprobs.top_logprobs[i].tolist())
                for i in range(len(sampled))
            ]
        token_ids: list[list[int]] = []
        per_seq_lp: list[list[tuple] | None] = []
        cursor = 0
        for i in range(plan.num_seqs):
            if plan.is_prefill and not plan.is_last_chunk[i]:
                token_ids.append([])
                per_seq_lp.append([] if lp_rows is not None else None)
                continue
            token_ids.append([sampled[cursor]])
            per_seq_lp.append([lp_rows[cursor]] if lp_rows is not None else None)
            cursor += 1
        self.step_times.append((state.t_forward_ms, state.t_sample_ms))
        return StepResult(
            step_id=plan.step_id,
            is_prefill=plan.is_prefill,
            seq_ids=plan.seq_ids,
            token_ids=token_ids,
            logprobs=per_seq_lp,
            forward_ms=state.t_forward_ms,
            sample_ms=state.t_sample_ms,
        )
