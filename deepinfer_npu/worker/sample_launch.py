"""Phase 3 of a step: sampling (prefill) or draft verification (decode), then the drafting of the next step.

Both paths run ``spec_verify`` (a prefill samples one token per prompt that ends, plus the first tokens of the
completions 1..n-1 of ``n > 1`` requests) with the per-token sampling tensors, the ``min_tokens`` ban mask, the
structured-output masks and the penalty counts. The speculative bookkeeping lives in the per-slot state
(``SlotState``): each row's last token (the bonus token), the ``seqlens_k`` correction the next step's
``zos_fixup`` applies, and the drafts with their confidences that the drafter proposes from the step's hidden states.

A mixin of ``Worker``: it reads the worker's ``runner``, ``device``, ``kernels``, ``slots``, ``drafter``, ``k``,
``backend`` and ``step_events``, and uses the ``DeviceTransfers`` / ``StepReadback`` methods.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from deepinfer_npu.sampling import SamplingTensors
from deepinfer_npu.sampling.prompt_logprobs import prompt_logprobs
from deepinfer_npu.spec.drafter import DraftContext
from deepinfer_npu.structured_output import step_masks
from deepinfer_npu.worker import penalty_state
from deepinfer_npu.worker.step_io import DeviceStepState, StepPlan, StepRequests


class SampleLaunch:
    """``_launch_sample``: sampling or verification, then drafting, queued behind the forward."""

    def _row_tensors(self, reqs: StepRequests, rows: np.ndarray) -> SamplingTensors:
        params = [reqs.params[i] for i in rows]
        seeds = [reqs.seeds[i] for i in rows]
        return SamplingTensors.from_params(params, seeds, [0] * len(params),
                                           vocab_size=self.runner.model_config.vocab_size, device=self.device)

    def _ban_mask(self, reqs: StepRequests, rows_of_token: torch.Tensor, offsets: torch.Tensor,
                  rows: np.ndarray) -> torch.Tensor | None:
        """``[N, V]`` mask of EOS/stop ids banned while fewer than ``min_tokens`` tokens were generated."""
        sel = [i for i in rows if reqs.min_tokens[i] > 0 and reqs.ban_ids[i]]
        if not sel:
            return None
        width = max(len(reqs.ban_ids[i]) for i in rows)
        ids = np.full((len(rows), max(width, 1)), -1, dtype=np.int64)
        for r, i in enumerate(rows):
            ids[r, : len(reqs.ban_ids[i])] = reqs.ban_ids[i]
        vocab = self.runner.model_config.vocab_size
        ids[(ids < 0) | (ids >= vocab)] = -1  # ids outside the vocabulary cannot be sampled anyway
        ban = self._dev(ids).index_select(0, rows_of_token)
        active = offsets < self._dev(reqs.min_tokens[rows]).index_select(0, rows_of_token)
        valid = (ban >= 0) & active[:, None]
        mask = torch.zeros(ban.shape[0], vocab, dtype=torch.bool, device=self.device)
        return mask.scatter_(1, ban.clamp(min=0), valid)

    def _decode_sampling_inputs(self, step: DeviceStepState,
                                reqs: StepRequests) -> tuple[SamplingTensors, torch.Tensor, torch.Tensor]:
        """A decode step's per-token sampling tensors (offsets still to set), each token's prompt length and the
        plan's q lengths (int64), on the device. Reused from the previous decode step when the batch is the same
        (rows, their params and seeds, prompt lengths, q lengths) and the tokens' rows follow the plan (no device
        re-split): steady decode then skips ~35 small host ops (pinned copies and gathers) a step, which at
        batch 1 are a large part of the host's time per step. The cache keeps the params objects alive, so their
        ids in the key cannot be reused by other objects."""
        plan = step.plan
        key = None
        if step.attn.host is not None:  # host-known q lengths: the token -> row map is a function of the key
            key = (plan.seq_ids.tobytes(), plan.seqlens_q.tobytes(), tuple(map(id, reqs.params)),
                   tuple(reqs.seeds), reqs.prompt_lens.tobytes())  # max_num_logprobs follows from the params
        cached = self._decode_sampling_cache
        if key is not None and cached is not None and cached[0] == key:
            _key, _params, t, prompt_len_of_token, planned = cached
        else:
            row = step.row_of_token
            t = self._row_tensors(reqs, np.arange(plan.num_seqs)).select_rows(row)
            t.max_num_logprobs = reqs.max_num_logprobs
            prompt_len_of_token = self._dev(reqs.prompt_lens).index_select(0, row)
            planned = self._dev(plan.seqlens_q.astype(np.int64))
            self._decode_sampling_cache = (None if key is None else
                                           (key, list(reqs.params), t, prompt_len_of_token, planned))
        return replace(t), prompt_len_of_token, planned  # a shallow copy: the caller sets its offsets

    def _launch_sample(self, step: DeviceStepState, reqs: StepRequests) -> None:
        plan = step.plan
        step.uses_grammar = reqs.grammars is not None
        if plan.is_prefill:
            anchor, target, bonus, bonus_slots = self._launch_prefill_sample(step, reqs)
        else:
            anchor, target, bonus, bonus_slots = self._launch_decode_verify(step, reqs)
        self.slots.last_token.index_copy_(0, bonus_slots, bonus)
        if self.drafter is not None:
            self._launch_drafting(step, reqs, anchor, target, bonus, bonus_slots)
        self._copy_results_to_host(step)
        event = self.backend.create_event(enable_timing=step.start_event is not None or step.fwd_events is not None)
        event.record()
        step.sample_end_event = event
        if step.start_event is not None and self.step_events is not None:
            self.step_events.append((plan.is_prefill, step.start_event, event))
        # Free what post-processing does not need (activations can be large).
        step.hidden = step.captured = step.logits = None

    def _launch_prefill_sample(self, step: DeviceStepState, reqs: StepRequests) -> tuple:
        """One sample per prompt that ends in the step (and the first tokens of its forked completions); the
        prompt logprobs of the chunk. -> (anchor rows, each token's next token, sampled tokens, their slots)."""
        plan, positions = step.plan, step.attn.positions
        n = plan.num_seqs
        rows = np.nonzero(plan.is_last_chunk)[0]
        ends = np.cumsum(plan.seqlens_q.astype(np.int64)) - 1
        prompt_lens, anchor, row_idx, num_emitted = self._dev_many([
            (reqs.prompt_lens, torch.int64), (ends[rows], torch.int64), (rows, torch.int64),
            (plan.is_last_chunk, torch.int64)])
        if reqs.uses_penalties and self.slots.has_penalties:  # prompt tokens and recomputed outputs
            slot_of_token = step.slots.index_select(0, step.row_of_token)
            is_prompt = positions < prompt_lens.index_select(0, step.row_of_token)
            penalty_state.record_prefill(self.slots, slot_of_token, is_prompt, step.input_ids)
        src, seeds, fork_rows = _prefill_samples(reqs, rows)
        m = len(src)
        sample_rows = rows[np.asarray(src, dtype=np.int64)] if m else rows
        t = SamplingTensors.from_params([reqs.params[i] for i in sample_rows], seeds, [0] * m,
                                        vocab_size=self.runner.model_config.vocab_size, device=self.device)
        offsets = positions.index_select(0, anchor) + 1 - prompt_lens.index_select(0, row_idx)
        logits, src_idx = step.logits, torch.arange(len(rows), device=self.device)
        if m > len(rows):
            src_idx = self._dev(np.asarray(src, dtype=np.int64))
            logits, offsets = logits.index_select(0, src_idx), offsets.index_select(0, src_idx)
        t.offsets = offsets
        t.max_num_logprobs = reqs.max_num_logprobs
        if t.need_penalties:
            t.output_counts, t.prompt_mask = penalty_state.row_counts(
                self.slots, step.slots.index_select(0, self._dev(sample_rows)))
        ban = self._ban_mask(reqs, src_idx, t.offsets, rows)
        if reqs.grammars is not None:
            ban = step_masks.merge(ban, step_masks.prefill_banned(
                reqs.grammars, sample_rows, self.runner.model_config.vocab_size, self._dev))
        vo = self.kernels.spec_verify(logits, torch.full((m,), -1, dtype=torch.int64, device=self.device),
                                      torch.arange(m, device=self.device),
                                      torch.zeros(m, dtype=torch.int64, device=self.device), m, 1, t, ban)
        sampled = vo.emitted[: len(rows), 0]
        if fork_rows:
            step.fork_rows, step.fork_tokens = fork_rows, vo.emitted[len(rows):, 0]
        emitted = torch.full((n, 1), -1, dtype=torch.int64, device=self.device)
        emitted[row_idx, 0] = sampled
        step.emitted, step.num_emitted = emitted, num_emitted
        lp_rows = torch.full((n, 1), -1, dtype=torch.int64, device=self.device)
        lp_rows[row_idx, 0] = torch.arange(len(rows), device=self.device)
        step.logprob_rows, step.logprobs = lp_rows, vo.logprobs
        # The token after each input token: the next prompt token, or the sample at the prompt's end.
        ids = step.input_ids
        target = torch.cat([ids[1:], ids.new_zeros(1)])
        chunk_ends = self._dev(ends)
        target[chunk_ends] = self._dev(reqs.next_tokens)
        target[anchor] = sampled
        self._launch_prompt_logprobs(step, reqs, target)
        bonus, bonus_slots = sampled, step.slots.index_select(0, row_idx)
        self.slots.correction.index_fill_(0, bonus_slots, 0)
        step.proposing_rows = rows
        return anchor, target, bonus, bonus_slots

    def _launch_decode_verify(self, step: DeviceStepState, reqs: StepRequests) -> tuple:
        """Verify each row's drafts and emit its accepted tokens plus one; record the ``seqlens_k`` correction the
        next step applies. -> (anchor rows, target tokens, bonus tokens, their slots)."""
        plan, attn = step.plan, step.attn
        n = plan.num_seqs
        positions = attn.positions
        row, j = step.row_of_token, step.j_of_token
        t, prompt_len_of_token, planned = self._decode_sampling_inputs(step, reqs)
        t.offsets = positions + 1 - prompt_len_of_token
        ban = self._ban_mask(reqs, row, t.offsets, np.arange(n))
        max_q = max(self.k + 1, 1)
        if reqs.grammars is not None:
            ban = step_masks.merge(ban, step_masks.decode_banned(
                reqs.grammars, n, max_q, row, j, step.draft_next, self.runner.model_config.vocab_size,
                self._dev))
        if t.need_penalties:
            if reqs.penalty_rebuild:
                self._rebuild_penalty_rows(plan, reqs)
            slot_of_token = step.slots.index_select(0, row)
            t.output_counts, t.prompt_mask = penalty_state.decode_counts(
                self.slots, slot_of_token, row, j, step.input_ids, n, max_q)
        vo = self.kernels.spec_verify(step.logits, step.draft_next, row, j, n, max_q, t, ban)
        if t.need_penalties:
            penalty_state.record_decode(self.slots, slot_of_token, j, vo.accepted.index_select(0, row),
                                        step.input_ids)
        cu = attn.cu_seqlens_q.to(torch.int64)
        anchor = cu[:-1] + vo.accepted
        bonus = vo.emitted.gather(1, vo.accepted[:, None]).squeeze(1)
        target = vo.target_tokens
        bonus_slots = step.slots
        # The scheduler's optimistic lengths assume its own plan's drafts were all accepted (not a device
        # re-split's), so the correction is taken against the plan (``planned``: its q lengths).
        self.slots.correction.index_copy_(0, bonus_slots, planned - 1 - vo.accepted)
        step.emitted, step.num_emitted, step.accepted = vo.emitted, vo.num_emitted, vo.accepted
        if vo.logprobs is not None:  # the rows of each request's logprobs (read only with logprobs)
            qmax = vo.emitted.shape[1]
            step.logprob_rows = cu[:-1, None] + torch.arange(qmax, device=self.device)[None, :]
        step.logprobs = vo.logprobs
        step.proposing_rows = np.arange(n)
        return anchor, target, bonus, bonus_slots

    def _launch_drafting(self, step: DeviceStepState, reqs: StepRequests, anchor: torch.Tensor,
                         target: torch.Tensor, bonus: torch.Tensor, bonus_slots: torch.Tensor) -> None:
        """The drafter proposes the next step's drafts from this step's hidden states; they wait in the slots."""
        attn, positions = step.attn, step.attn.positions
        ctx = DraftContext(attn=attn, hidden=step.hidden, target_tokens=target, anchor_rows=anchor,
                           bonus_tokens=bonus, bonus_positions=positions.index_select(0, anchor) + 1,
                           slots=bonus_slots, captured=step.captured, host_rows=step.proposing_rows)
        drafts, probs = self.drafter.propose(ctx)
        if reqs.grammars is not None:  # the host fills the next step's masks along these drafts
            step.proposals = drafts
        if drafts.shape[0]:
            self.slots.drafts.index_copy_(0, bonus_slots, drafts)
            self.slots.draft_probs.index_copy_(0, bonus_slots, probs.float())
        step.draft_probs = probs

    def _rebuild_penalty_rows(self, plan: StepPlan, reqs: StepRequests) -> None:
        """Forked rows' penalty counts from the host's token lists (the parent's slot may have moved on)."""
        slots = plan.state_slots.astype(np.int64)
        rows = [r for r, _, _ in reqs.penalty_rebuild]
        p_slots = np.concatenate([np.full(len(p), slots[r], np.int64) for r, p, _ in reqs.penalty_rebuild])
        p_ids = np.concatenate([np.asarray(p, np.int64) for _, p, _ in reqs.penalty_rebuild])
        o_slots = np.concatenate([np.full(len(o), slots[r], np.int64) for r, _, o in reqs.penalty_rebuild])
        o_ids = np.concatenate([np.asarray(o, np.int64) for _, _, o in reqs.penalty_rebuild])
        penalty_state.rebuild(self.slots, *self._dev_many([(slots[rows], torch.int64), (p_slots, torch.int64),
                                                           (p_ids, torch.int64), (o_slots, torch.int64),
                                                           (o_ids, torch.int64)]))

    def _launch_prompt_logprobs(self, step: DeviceStepState, reqs: StepRequests, target: torch.Tensor) -> None:
        """Prefill rows with ``prompt_logprobs``: the logprobs of each prompt token this chunk predicts (every
        chunk token's next token, except the sample after the prompt's last token)."""
        if reqs.prompt_logprobs is None:
            return
        plan = step.plan
        wanted = np.nonzero(reqs.prompt_logprobs >= 0)[0]
        if not wanted.size:
            return
        starts = plan.row_starts
        counts = plan.seqlens_q.astype(np.int64)[wanted] - plan.is_last_chunk[wanted].astype(np.int64)
        index = np.concatenate([np.arange(starts[i], starts[i] + c) for i, c in zip(wanted, counts)])
        step.prompt_lp_rows = [(int(i), int(c)) for i, c in zip(wanted, counts)]
        rows = self._dev(index)
        step.prompt_lp = prompt_logprobs(lambda r: self.runner.logits(step.hidden, r), rows,
                                         target.index_select(0, rows), int(reqs.prompt_logprobs.max()))


def _prefill_samples(reqs: StepRequests, rows: np.ndarray) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """A prefill's sampled rows: one per prompt that ends in the step (``rows``), then the first tokens of the
    completions 1..n-1 of ``n > 1`` requests. -> (index into ``rows`` per sample, seed per sample,
    ``(plan row, number of extra samples)`` per forking row)."""
    src, seeds, fork_rows = list(range(len(rows))), [reqs.seeds[i] for i in rows], []
    for r, i in enumerate(rows):
        extra = reqs.fork_seeds[i] if reqs.fork_seeds is not None else ()
        if extra:
            fork_rows.append((int(i), len(extra)))
            src += [r] * len(extra)
            seeds += list(extra)
    return src, seeds, fork_rows
