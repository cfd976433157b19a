"""Plain data passed between the engine, the worker and the model runner for one step.

The scheduler's ``ScheduleOutput`` arrays are views over C++ buffers that the next ``schedule()`` overwrites, so
``StepPlan.from_schedule`` copies what the step needs the moment it is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StepPlan:
    """One scheduled step, owned by Python (copied out of the scheduler's buffers)."""

    step_id: int
    is_prefill: bool
    seq_ids: np.ndarray  # int64 [n]
    seqlens_q: np.ndarray  # int32 [n]
    seqlens_k: np.ndarray  # int32 [n]
    is_last_chunk: np.ndarray  # bool [n]
    input_ids: np.ndarray  # int32 [num_tokens]; -1 = comes from the device (previous step's output)
    block_tables: np.ndarray  # int32 [n, max_blocks]
    state_slots: np.ndarray  # int32 [n]
    clone_blocks: np.ndarray  # int32 [c, 2]
    clone_states: np.ndarray  # int32 [c, 2]
    zero_states: np.ndarray  # int32 [z]

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def row_starts(self) -> np.ndarray:
        q = self.seqlens_q.astype(np.int64)
        return np.cumsum(q) - q

    @classmethod
    def from_schedule(cls, step_id: int, out, is_prefill: bool) -> StepPlan:
        def own(name: str, dtype) -> np.ndarray:
            return np.array(getattr(out, name), dtype=dtype, copy=True)

        return cls(
            step_id=step_id,
            is_prefill=is_prefill,
            seq_ids=own("seq_ids", np.int64),
            seqlens_q=own("seqlens_q", np.int32),
            seqlens_k=own("seqlens_k", np.int32),
            is_last_chunk=own("is_last_chunk", np.bool_),
            input_ids=own("input_ids", np.int32),
            block_tables=own("block_tables", np.int32),
            state_slots=own("state_slots", np.int32),
            clone_blocks=own("clone_blocks", np.int32).reshape(-1, 2),
            clone_states=own("clone_states", np.int32).reshape(-1, 2),
            zero_states=own("zero_states", np.int32).reshape(-1),
        )


@dataclass
class StepRequests:
    """Per-row request data the engine adds to a plan (host values).

    ``params``/``seeds``/``prompt_lens`` per row (``prompt_lens`` = the original prompt length, so the output
    position of a sampled token is ``position + 1 - prompt_len``); ``min_tokens`` and ``ban_ids`` (EOS and stop
    ids banned while fewer than ``min_tokens`` tokens were generated); ``next_tokens`` (prefill: the prompt token
    after the chunk, -1 when the chunk ends the prompt); ``draft_caps`` (decode: most drafts a row may verify).
    Sampling controls: ``fork_seeds`` (prefill: per row the seeds of completions ``1..n-1`` sampled at the prompt's
    end, empty for most rows); ``prompt_logprobs`` (prefill: per row ``k`` or -1); ``uses_penalties`` (some row
    has a penalty: the worker keeps its device counts); ``penalty_rebuild`` (decode: ``(row, prompt ids, output
    ids before the last)`` of forked rows whose counts are rebuilt from the host lists). Structured output:
    ``grammars`` (per row the request's ``RequestGrammar`` or None; None when no row is constrained).
    """

    params: list
    seeds: list[int]
    prompt_lens: np.ndarray
    min_tokens: np.ndarray
    ban_ids: list[list[int]]
    next_tokens: np.ndarray
    draft_caps: np.ndarray
    max_num_logprobs: int | None = None
    fork_seeds: list[list[int]] | None = None
    prompt_logprobs: np.ndarray | None = None
    uses_penalties: bool = False
    penalty_rebuild: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    grammars: list | None = None


@dataclass
class StepResult:
    """Host-side results of one finished step, ready for the engine's post-processing.

    ``token_ids[i]`` holds the tokens emitted for ``seq_ids[i]`` (empty for a prefill chunk that does not finish
    its prompt). ``logprobs[i]`` is a list (one entry per emitted token) of ``(sampled_logprob, sampled_rank,
    top_ids, top_logprobs)`` or None. Decode steps also report per row the drafts verified and accepted, and the
    confidences of the drafts proposed for the next step (``draft_probs``, rows that proposed). Prefill steps
    may carry ``fork_tokens`` (row -> ``[(token, logprob entry or None)]``: the first tokens of completions
    ``1..n-1``) and ``prompt_logprobs`` (row -> one logprob entry per prompt token predicted in the chunk).
    """

    step_id: int
    is_prefill: bool
    seq_ids: np.ndarray
    token_ids: list[list[int]]
    logprobs: list[list[tuple] | None] = field(default_factory=list)
    num_drafts: np.ndarray | None = None
    planned_drafts: np.ndarray | None = None  # the scheduler's split (before a device re-split)
    num_accepted: np.ndarray | None = None
    draft_probs: np.ndarray | None = None
    proposing_rows: np.ndarray | None = None
    proposals: np.ndarray | None = None  # structured output: the drafts proposed for the next step [rows, k]
    fork_tokens: dict[int, list[tuple]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[tuple]] = field(default_factory=dict)
    num_tokens: int = 0
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    model_ms: float = 0.0
    # host time blocked on this step's end event: the host waits on the device (~ the step minus the host's own
    # work) when the device bounds the loop, ~0 when the host does
    host_wait_ms: float = 0.0


@dataclass
class DeviceStepState:
    """What a launched step leaves on the device for its post-processing."""

    plan: StepPlan
    emitted: torch.Tensor | None = None  # int64 [B, Qmax]
    num_emitted: torch.Tensor | None = None  # int64 [B]
    seqlens_q: torch.Tensor | None = None  # int32 [B] after device fixups
    accepted: torch.Tensor | None = None
    logprobs: object | None = None  # LogprobsTensors per logits row
    logprob_rows: torch.Tensor | None = None  # int64 [B, Qmax] logits row of each emitted token
    draft_probs: torch.Tensor | None = None
    proposing_rows: np.ndarray | None = None
    proposals: torch.Tensor | None = None  # structured output: drafts proposed for the next step
    uses_grammar: bool = False  # a row is constrained: its results go to the result listener
    fork_rows: list[tuple[int, int]] | None = None  # (row, number of extra first samples) of the prefill
    fork_tokens: torch.Tensor | None = None  # int64 [E] the extra first samples, in fork_rows order
    fork_logprobs: object | None = None  # LogprobsTensors of the extra samples
    prompt_lp_rows: list[tuple[int, int]] | None = None  # (row, number of prompt positions) in prompt_lp order
    prompt_lp: object | None = None  # LogprobsTensors per predicted prompt token
    sample_end_event: object | None = None
    host: dict | None = None  # host copies of the results, filled asynchronously before sample_end_event
    start_event: object | None = None  # timing event before the step's first device op (Worker.step_events)
    fwd_events: tuple | None = None  # timing events around the forward (varlen on a device): device model_ms
    t_forward_ms: float = 0.0
    t_sample_ms: float = 0.0
    model_ms: float = 0.0
    # kept between the forward and the sampling launch
    attn: object | None = None
    row_of_token: torch.Tensor | None = None
    j_of_token: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    captured: object | None = None
    logits: torch.Tensor | None = None
    draft_next: torch.Tensor | None = None
    slots: torch.Tensor | None = None
