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
    prev_remap: np.ndarray | None = None  # int32 [n]; decode: row in the previous decode step or -1

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_schedule(cls, step_id: int, out, is_prefill: bool) -> StepPlan:
        def own(name: str, dtype) -> np.ndarray:
            return np.array(getattr(out, name), dtype=dtype, copy=True)

        remap = getattr(out, "prev_remap", None)
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
            prev_remap=None if remap is None else np.array(remap, dtype=np.int32, copy=True),
        )


@dataclass
class StepResult:
    """Host-side results of one finished step, ready for the engine's post-processing.

    ``token_ids[i]`` holds the tokens emitted for ``seq_ids[i]`` (empty for a prefill chunk that does not finish
    its prompt). ``logprobs[i]`` is a list (one entry per emitted token) of ``(sampled_logprob, sampled_rank,
    top_ids, top_logprobs)`` or None when no logprobs were asked for.
    """

    step_id: int
    is_prefill: bool
    seq_ids: np.ndarray
    token_ids: list[list[int]]
    logprobs: list[list[tuple] | None] = field(default_factory=list)
    forward_ms: float = 0.0
    sample_ms: float = 0.0


@dataclass
class DeviceStepState:
    """What a launched step leaves on the device for its post-processing (and, under ZOS, for the next step)."""

    plan: StepPlan
    sample_rows: torch.Tensor | None = None  # int64 [num_sampled] rows of the flat token batch that are sampled
    sampled_token_ids: torch.Tensor | None = None  # int64 [num_sampled]
    logprobs: object | None = None
    sample_end_event: object | None = None
    t_forward_ms: float = 0.0
    t_sample_ms: float = 0.0
