"""Worker: the single entry of every step, in the seed's four phases (§4.2, §6.2).

``execute_model_step`` always does:

1. launch the forward of step N (no waiting);
2. post-process step N-1 if it was deferred — the only place that waits (on N-1's sample-end event);
3. launch sampling / draft verification and drafting of step N;
4. post-process N at once for prefill steps or with zero-overhead scheduling (ZOS) off; a ZOS decode step is kept
   and post-processed by the next call, so the CPU schedules N+1 while the device still runs N.

Under ZOS the scheduler plans N+1 before N's results are known. Everything a row needs from N lives in per-slot
device buffers (``SlotState``): the row's first input token, its drafts and their confidences, and the
``seqlens_k`` correction; ``zos_fixup`` corrects the lengths and re-splits the drafts on the device. The launch
path runs under ``backend.forbid_sync()``. The CPU backend runs the identical code, only without overlap, so ZOS on
and off produce identical tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from deepinfer_npu.hal.graph_runner import GraphRunner
from deepinfer_npu.sampling import SamplingTensors
from deepinfer_npu.sampling.prompt_logprobs import prompt_logprobs
from deepinfer_npu.spec.drafter import DraftContext, Drafter
from deepinfer_npu.worker import grammar_mask, penalty_state
from deepinfer_npu.worker.decode_graphs import DecodeGraphs
from deepinfer_npu.worker.device_transfers import DeviceTransfers
from deepinfer_npu.worker.forward_launch import ForwardLaunch
from deepinfer_npu.worker.kernel_warmup import build_kernel_warmup_plan
from deepinfer_npu.worker.model_runner import ModelRunner
from deepinfer_npu.worker.slot_state import SlotState
from deepinfer_npu.worker.step_io import DeviceStepState, StepPlan, StepRequests, StepResult
from deepinfer_npu.worker.step_readback import StepReadback

logger = logging.getLogger(__name__)


DUMMY_SEQ_ID = -1  # the padding sequence of a dummy step (no request has it)


class Worker(ForwardLaunch, StepReadback, DeviceTransfers):
    def __init__(self, runner: ModelRunner, backend, zero_overhead_scheduling: bool, num_state_slots: int,
                 drafter: Drafter | None = None, varlen: bool = False) -> None:
        self.runner = runner
        self.backend = backend
        self.kernels = backend.kernels
        self.device = runner.device
        self.zos = zero_overhead_scheduling
        self.drafter = drafter
        self.k = drafter.num_speculative_tokens if drafter is not None else 0
        self.varlen = varlen and drafter is not None
        self.slots = SlotState(num_state_slots, self.k, self.device)
        self.prev: DeviceStepState | None = None  # deferred ZOS decode step awaiting post-processing
        # Called with the results of each step that has a constrained row as soon as they are post-processed, before
        # the next sampling is launched (the engine advances structured-output grammars there).
        self.result_listener = None
        self._decode_sampling_cache: tuple | None = None  # _decode_sampling_inputs' last batch
        self.graphs = self._build_graphs()  # the decode-graph plumbing; nothing captured yet
        # Every kernel variant the steps can reach, compiled now: before any capture, and before the first step
        # (which a stall of seconds per TileLang configuration would otherwise land in). None: kernel_warmup off.
        self.kernel_warmup: str | None = self._warm_up_kernels()
        if self.graphs is not None and self.runner.config.graph_capture == "startup":
            self._capture_graphs()
        self.graph_steps = 0  # decode steps run from a captured graph
        # Set to a list to time steps on the device: each launched step appends ``(is_prefill, start, end)``
        # timing events, start before its first device op, end with its sample-end event (benchmarks/bench_zos.py).
        self.step_events: list | None = None

    def _build_graphs(self) -> DecodeGraphs | None:
        """``EngineConfig.enable_graphs`` and a backend graph runner -> the decode-graph plumbing, else None."""
        cfg = self.runner.config
        requested = getattr(cfg, "enable_graphs", False)
        if requested is None:  # auto: the backend's default
            requested = bool(getattr(self.backend, "graphs_by_default", False))
            explicit = False
        else:
            explicit = True
        if not requested:
            return None
        if getattr(cfg, "quantization", None) is not None:  # the quantized ops' reference fallbacks read host counts
            (logger.warning if explicit else logger.info)(
                "decode graphs are off with quantization=%r until its device kernels exist", cfg.quantization)
            return None
        if self.drafter is not None:  # the drafter's propose gets graphs of its own (asked first: its own pool)
            draft_runner = self.backend.graph_runner()
            if isinstance(draft_runner, GraphRunner) and self.drafter.enable_graphs(draft_runner, cfg.max_num_seqs):
                logger.info("drafter %s: propose replayed from graphs", self.drafter.name)
        graph_runner = self.backend.graph_runner()
        if not isinstance(graph_runner, GraphRunner):
            if explicit:
                logger.warning("enable_graphs: backend %s has no graph runner for the worker; decode runs eagerly",
                               self.backend.name)
            return None
        max_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (self.k + 1))
        capture = self.drafter.capture_layer_ids if self.drafter is not None else None
        hook = None
        if self.drafter is not None and getattr(self.backend, "drafter_hook_in_graphs", False):
            hook = self.drafter.main_forward_hook_in_graph()
        return DecodeGraphs(self.runner, graph_runner, self.k, max_tokens, capture, extra_width=2 * self.k,
                            drafter_hook=hook)

    def _capture_graphs(self) -> None:
        """``graph_capture="startup"``: capture every decode graph (and the drafter's propose graphs) now."""
        self.graphs.capture_all()
        propose_graphs = getattr(self.drafter, "propose_graphs", None)
        if propose_graphs is not None:
            propose_graphs.capture_all()

    def _warm_up_kernels(self) -> str | None:
        """``KernelSet.warmup`` once, with the shapes this engine's steps can have (``EngineConfig.kernel_warmup``);
        -> its summary (the CUDA kernel set logs its own progress), None when turned off."""
        if not self.runner.config.kernel_warmup:
            return None
        varlen = self.varlen and self.zos and self.backend.supports_device_resplit  # as _launch_forward's re-split
        try:
            plan = build_kernel_warmup_plan(self.runner, k=self.k, varlen=varlen, drafter=self.drafter,
                                            graphs=self.graphs)
        except Exception as e:  # noqa: BLE001 - an unusual model layout must not stop start-up: kernels compile lazily
            logger.warning("kernel warm-up skipped: building its plan failed: %s: %s", type(e).__name__, e)
            return f"skipped: building the plan failed: {type(e).__name__}: {e}"
        summary = self.kernels.warmup(plan)
        logger.debug("kernel warm-up: %s", summary)
        return summary

    @property
    def has_pending_step(self) -> bool:
        return self.prev is not None

    def execute_model_step(self, plan: StepPlan, reqs: StepRequests) -> list[StepResult]:
        results: list[StepResult] = []
        t0 = time.perf_counter()
        with self.backend.forbid_sync():  # 1. launch forward N
            step = self._launch_forward(plan, reqs)
        t1 = time.perf_counter()
        if self.prev is not None:  # 2. post-process N-1 (waits on its sample-end event only)
            results.append(self._post_process(self.prev))
            self.prev = None
        t2 = time.perf_counter()
        with self.backend.forbid_sync():  # 3. launch sampling / verification + drafting of N
            self._launch_sample(step, reqs)
        t3 = time.perf_counter()
        step.t_forward_ms, step.t_sample_ms = (t1 - t0) * 1e3, (t3 - t2) * 1e3
        if plan.is_prefill or not self.zos:  # 4. post-process now, or keep N for the next call
            results.append(self._post_process(step))
        else:
            self.prev = step
        return results

    def execute_dummy_step(self, is_prefill: bool, reqs: StepRequests) -> list[StepResult]:
        """One padding row through the whole step (forward, sampling, drafting): an expert-parallel rank with
        nothing scheduled runs it so that its MoE collectives pair with the other ranks' real step. The row
        writes only the reserved block 0 and the dummy state slot 0; its result is dropped by the engine."""
        return self.execute_model_step(dummy_plan(is_prefill), reqs)

    def flush(self) -> list[StepResult]:
        """Post-process a deferred step when no further step is launched."""
        if self.prev is None:
            return []
        state, self.prev = self.prev, None
        return [self._post_process(state)]

    # ---------------------------------------------------------------- phase 3
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
        plan, attn = step.plan, step.attn
        step.uses_grammar = reqs.grammars is not None
        n = plan.num_seqs
        positions = attn.positions
        if plan.is_prefill:
            prompt_lens = self._dev(reqs.prompt_lens)
            rows = np.nonzero(plan.is_last_chunk)[0]
            ends = np.cumsum(plan.seqlens_q.astype(np.int64)) - 1
            anchor = self._dev(ends[rows])
            row_idx = self._dev(rows)
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
                ban = grammar_mask.merge(ban, grammar_mask.prefill_banned(
                    reqs.grammars, sample_rows, self.runner.model_config.vocab_size, self._dev))
            vo = self.kernels.spec_verify(logits, torch.full((m,), -1, dtype=torch.int64, device=self.device),
                                          torch.arange(m, device=self.device),
                                          torch.zeros(m, dtype=torch.int64, device=self.device), m, 1, t, ban)
            sampled = vo.emitted[: len(rows), 0]
            if fork_rows:
                step.fork_rows, step.fork_tokens = fork_rows, vo.emitted[len(rows):, 0]
            emitted = torch.full((n, 1), -1, dtype=torch.int64, device=self.device)
            emitted[row_idx, 0] = sampled
            step.emitted, step.num_emitted = emitted, self._dev(plan.is_last_chunk.astype(np.int64))
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
        else:
            row, j = step.row_of_token, step.j_of_token
            t, prompt_len_of_token, planned = self._decode_sampling_inputs(step, reqs)
            t.offsets = positions + 1 - prompt_len_of_token
            ban = self._ban_mask(reqs, row, t.offsets, np.arange(n))
            max_q = max(self.k + 1, 1)
            if reqs.grammars is not None:
                ban = grammar_mask.merge(ban, grammar_mask.decode_banned(
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
        self.slots.last_token.index_copy_(0, bonus_slots, bonus)
        if self.drafter is not None:
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
        self._copy_results_to_host(step)
        event = self.backend.create_event(enable_timing=step.start_event is not None or step.fwd_events is not None)
        event.record()
        step.sample_end_event = event
        if step.start_event is not None and self.step_events is not None:
            self.step_events.append((plan.is_prefill, step.start_event, event))
        # Free what post-processing does not need (activations can be large).
        step.hidden = step.captured = step.logits = None

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


def dummy_plan(is_prefill: bool) -> StepPlan:
    """A one-token step for the padding sequence ``DUMMY_SEQ_ID`` on block 0 and state slot 0."""
    one = np.ones(1, dtype=np.int32)
    empty = np.zeros((0, 2), dtype=np.int32)
    return StepPlan(step_id=-1, is_prefill=is_prefill, seq_ids=np.full(1, DUMMY_SEQ_ID, dtype=np.int64),
                    seqlens_q=one, seqlens_k=one.copy(), is_last_chunk=np.ones(1, dtype=np.bool_),
                    input_ids=np.zeros(1, dtype=np.int32), block_tables=np.zeros((1, 1), dtype=np.int32),
                    state_slots=np.zeros(1, dtype=np.int32), clone_blocks=empty, clone_states=empty.copy(),
                    zero_states=np.zeros(0, dtype=np.int32))
