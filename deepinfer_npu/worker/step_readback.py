"""Phases 2 and 4 of a step: the results' host copies, queued behind the step's work, and their reading into a
``StepResult`` once the step's sample-end event completes (the only wait of a step).

A mixin of ``Worker``: it reads ``self.result_listener`` (called for steps with a constrained row, before the next
sampling is launched) and ``self.step_watchdog`` (``step_watchdog.py``: a wait that never ends exits the process).
"""

from __future__ import annotations

import time

import numpy as np

from deepinfer_npu.worker.step_io import DeviceStepState, StepResult


class StepReadback:
    """``_copy_results_to_host`` at launch, ``_post_process`` once the step has ended."""

    def _copy_results_to_host(self, step: DeviceStepState) -> None:
        """Queue the copies of everything post-processing reads (before the step's end event is recorded)."""
        h = self._to_host
        step.host = {"emitted": h(step.emitted), "num_emitted": h(step.num_emitted)}
        if not step.plan.is_prefill:
            step.host.update(seqlens_q=h(step.seqlens_q), accepted=h(step.accepted))
        if step.logprobs is not None:
            lp = step.logprobs
            step.host.update(logprob_rows=h(step.logprob_rows), sampled_logprob=h(lp.sampled_logprob),
                             sampled_rank=h(lp.sampled_rank), top_ids=h(lp.top_ids), top_logprobs=h(lp.top_logprobs))
        if step.draft_probs is not None:
            step.host["draft_probs"] = h(step.draft_probs)
        if step.proposals is not None:
            step.host["proposals"] = h(step.proposals)
        if step.fork_tokens is not None:
            step.host["fork_tokens"] = h(step.fork_tokens)
        if step.prompt_lp is not None:
            lp = step.prompt_lp
            step.host.update(plp_logprob=h(lp.sampled_logprob), plp_rank=h(lp.sampled_rank),
                             plp_top_ids=h(lp.top_ids), plp_top_logprobs=h(lp.top_logprobs))

    def _post_process(self, step: DeviceStepState) -> StepResult:
        t_wait = time.perf_counter()
        plan = step.plan
        with self.step_watchdog.waiting(lambda: f"{'prefill' if plan.is_prefill else 'decode'} step {plan.step_id} "
                                        f"({plan.num_tokens} tokens, {plan.num_seqs} sequences)"):
            step.sample_end_event.synchronize()  # this step's results (and their host copies) are complete
        host_wait_ms = (time.perf_counter() - t_wait) * 1e3
        host = step.host
        if step.fwd_events is not None:  # device times (the events are complete): forward, then sampling + drafting
            step.model_ms = step.fwd_events[0].elapsed_time(step.fwd_events[1])
            step.t_sample_ms = step.fwd_events[1].elapsed_time(step.sample_end_event)
        emitted = host["emitted"].numpy()
        counts = host["num_emitted"].numpy()
        token_ids = [emitted[i, : counts[i]].tolist() for i in range(plan.num_seqs)]
        logprobs: list = [None] * plan.num_seqs
        if step.logprobs is not None:
            rows = host["logprob_rows"].numpy()
            sampled, rank = host["sampled_logprob"].tolist(), host["sampled_rank"].tolist()
            top_ids, top_lps = host["top_ids"].tolist(), host["top_logprobs"].tolist()
            logprobs = [
                [(sampled[r], rank[r], top_ids[r], top_lps[r]) for r in rows[i, : counts[i]]]
                for i in range(plan.num_seqs)
            ]
        result = StepResult(step_id=plan.step_id, is_prefill=plan.is_prefill, seq_ids=plan.seq_ids,
                            token_ids=token_ids, logprobs=logprobs, num_tokens=plan.num_tokens,
                            forward_ms=step.t_forward_ms, sample_ms=step.t_sample_ms, model_ms=step.model_ms,
                            host_wait_ms=host_wait_ms)
        if not plan.is_prefill:
            result.num_drafts = host["seqlens_q"].numpy().astype(np.int64) - 1
            result.planned_drafts = plan.seqlens_q.astype(np.int64) - 1
            result.num_accepted = host["accepted"].numpy()
        if step.fork_rows:  # the first tokens of completions 1..n-1 (sampled after the main rows)
            tokens = host["fork_tokens"].tolist()
            lp_row = int((plan.is_last_chunk).sum())
            pos = 0
            for row, count in step.fork_rows:
                entries = []
                for tok in tokens[pos:pos + count]:
                    entry = None
                    if step.logprobs is not None:
                        entry = (sampled[lp_row], rank[lp_row], top_ids[lp_row], top_lps[lp_row])
                    entries.append((tok, entry))
                    pos += 1
                    lp_row += 1
                result.fork_tokens[row] = entries
        if step.prompt_lp is not None:
            lps, ranks = host["plp_logprob"].tolist(), host["plp_rank"].tolist()
            p_ids, p_lps = host["plp_top_ids"].tolist(), host["plp_top_logprobs"].tolist()
            pos = 0
            for row, count in step.prompt_lp_rows:
                result.prompt_logprobs[row] = [(lps[r], ranks[r], p_ids[r], p_lps[r])
                                               for r in range(pos, pos + count)]
                pos += count
        if step.draft_probs is not None:
            result.draft_probs = host["draft_probs"].float().numpy()
            result.proposing_rows = step.proposing_rows
        if "proposals" in host:
            result.proposals = host["proposals"].numpy()
            result.proposing_rows = step.proposing_rows
        step.host = None
        if step.uses_grammar and self.result_listener is not None:
            self.result_listener(result)
        return result
