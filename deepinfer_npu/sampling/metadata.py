"""Batched sampling inputs (:class:`SamplingTensors`) and outputs (:class:`SamplerOutput`) of the sampler
(``spec_verify`` and the reference ``sample`` it reduces to without drafts).

One *row* is one token to sample: a request in a normal decode step, or one verified position of a request in
a speculative step. Each row carries its request's seed and its ``offset`` = the output position of the token
being sampled (0 for the first generated token), which keys the hash RNG (:mod:`deepinfer_npu.sampling.rng`).

Everything the sampler branches on at the Python level (``all_greedy``, ``need_top_k``...) is computed on the
host when the tensors are built, so sampling never reads device memory back (no host-device sync).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from deepinfer_npu.hal.host_to_device import to_device
from deepinfer_npu.sampling.rng import seed_to_int64

if TYPE_CHECKING:  # avoid an import cycle with deepinfer_npu.engine
    from deepinfer_npu.engine.sampling_params import SamplingParams

__all__ = ["SamplingTensors", "SamplerOutput", "LogprobsTensors", "min_tokens_banned_ids"]


def min_tokens_banned_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Iterable[int] = ()
) -> list[int]:
    """Token ids a row must not sample yet because of ``min_tokens`` (as vLLM's min-tokens logits processor).

    ``num_output_tokens`` counts the tokens generated before the one being sampled. Returns EOS ids (unless
    ``ignore_eos``) and ``stop_token_ids`` while fewer than ``min_tokens`` are generated, else ``[]``.
    """
    if num_output_tokens >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned.update(int(t) for t in eos_token_ids)
    return sorted(banned)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors (``B`` rows).

    Attributes:
        temperature: float32 [B]; 1.0 on greedy rows (never 0).
        top_k: int64 [B]; 0 = disabled.
        top_p: float32 [B]; 1.0 = disabled.
        is_greedy: bool [B].
        seeds: int64 [B] (the request seed as two's-complement int64).
        offsets: int64 [B]; output position of the token being sampled.
        max_num_logprobs: ``None`` = no logprobs; ``n >= 0`` = return the top-``n`` plus the sampled token's.
        banned_rows / banned_token_ids: int64 [K] pairs ``(row, token)`` whose logit is set to ``-inf`` before
            sampling (``min_tokens``); ``None`` when there are none.
        all_greedy / all_random / need_top_k / need_top_p: host-side flags for fast paths.
        presence_penalty / frequency_penalty / repetition_penalty: float32 [B] when some row uses a penalty
            (``need_penalties``), else None; ``output_counts`` int32 [B, V] (tokens this completion generated
            before the sampled one) and ``prompt_mask`` bool [B, V] (tokens of its prompt) are set by the worker
            from its device state.
        min_p: float32 [B] when some random row uses it (``need_min_p``), else None.
        logit_bias: float32 [B, V] dense biases when some row has a ``logit_bias``, else None.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    is_greedy: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor
    max_num_logprobs: int | None = None
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    all_greedy: bool = False
    all_random: bool = False
    need_top_k: bool = False
    need_top_p: bool = False
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None

    @property
    def need_penalties(self) -> bool:
        return self.presence_penalty is not None

    @property
    def need_min_p(self) -> bool:
        return self.min_p is not None

    @property
    def needs_processing(self) -> bool:
        """Some row uses a penalty, ``min_p`` or ``logit_bias`` (the processors of
        ``backends/cpu/logits_processors.py`` run); False keeps the plain sampling path."""
        return self.presence_penalty is not None or self.min_p is not None or self.logit_bias is not None

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        offsets: Sequence[int],
        *,
        vocab_size: int | None = None,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Build the tensors for ``B`` rows.

        Args:
            params: one :class:`SamplingParams` per row (a request with drafts repeats its params).
            seeds: one seed per row; every row must have one — requests without ``params.seed`` get a
                seed from the engine's generator at add time (see
                :func:`deepinfer_npu.sampling.new_request_seed`).
            offsets: per row, the output position of the token being sampled.
            vocab_size: when given, ``top_k >= vocab_size`` is treated as disabled.
            banned_token_ids: optional per-row lists of token ids to exclude (see
                :func:`min_tokens_banned_ids`).
            device: where the tensors live.
        """
        b = len(params)
        if len(seeds) != b or len(offsets) != b:
            raise ValueError(
                f"need one seed and one offset per row: {b} params, {len(seeds)} seeds, "
                f"{len(offsets)} offsets"
            )
        if banned_token_ids is not None and len(banned_token_ids) != b:
            raise ValueError(
                f"banned_token_ids needs one list per row: {b} rows, {len(banned_token_ids)} lists"
            )

        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        greedy: list[bool] = []
        max_lp: int | None = None
        for p in params:
            g = p.is_greedy
            greedy.append(g)
            temperature.append(1.0 if g else p.temperature)
            k = 0 if g else p.top_k
            if vocab_size is not None and k >= vocab_size:
                k = 0
            top_k.append(k)
            top_p.append(1.0 if g else p.top_p)
            if p.logprobs is not None:
                max_lp = p.logprobs if max_lp is None else max(max_lp, p.logprobs)

        ban_rows: list[int] = []
        ban_ids: list[int] = []
        if banned_token_ids is not None:
            for row, ids in enumerate(banned_token_ids):
                for t in ids:
                    if vocab_size is None or 0 <= int(t) < vocab_size:
                        ban_rows.append(row)
                        ban_ids.append(int(t))

        # every host list of the rows goes to the device in one copy (hal/host_to_device.py)
        host: dict[str, tuple[list, torch.dtype]] = {
            "temperature": (temperature, torch.float32), "top_k": (top_k, torch.int64),
            "top_p": (top_p, torch.float32), "is_greedy": (greedy, torch.bool),
            "seeds": ([seed_to_int64(int(s)) for s in seeds], torch.int64),
            "offsets": ([int(o) for o in offsets], torch.int64)}
        if ban_rows:
            host["banned_rows"], host["banned_token_ids"] = (ban_rows, torch.int64), (ban_ids, torch.int64)
        random_rows = [not g for g in greedy]
        if any(p.uses_penalties for p in params):
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
                host[name] = ([getattr(p, name) for p in params], torch.float32)
        if any(p.min_p > 0.0 for p, r in zip(params, random_rows) if r):
            host["min_p"] = ([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32)
        has_bias = any(p.logit_bias for p in params)
        if has_bias:
            if vocab_size is None:
                raise ValueError("logit_bias needs vocab_size")
            b_rows, b_ids, b_vals = [], [], []
            for row, p in enumerate(params):
                for tid, v in (p.logit_bias or {}).items():
                    if 0 <= tid < vocab_size:
                        b_rows.append(row)
                        b_ids.append(tid)
                        b_vals.append(v)
            host.update(bias_rows=(b_rows, torch.int64), bias_ids=(b_ids, torch.int64),
                        bias_vals=(b_vals, torch.float32))
        dev = dict(zip(host, to_device(list(host.values()), device)))
        if has_bias:
            bias = torch.zeros(b, vocab_size, dtype=torch.float32, device=device)
            bias.index_put_((dev.pop("bias_rows"), dev.pop("bias_ids")), dev.pop("bias_vals"))
            dev["logit_bias"] = bias
        return cls(
            max_num_logprobs=max_lp,
            all_greedy=all(greedy),
            all_random=all(random_rows),
            need_top_k=any(k > 0 for k, r in zip(top_k, random_rows) if r),
            need_top_p=any(p < 1.0 for p, r in zip(top_p, random_rows) if r),
            **dev,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SamplingTensors:
        """A copy with every tensor moved to ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def select_rows(self, index: torch.Tensor) -> SamplingTensors:
        """Per-row tensors gathered by ``index`` (``index[r]`` = source row of new row ``r``): per-request rows
        -> per-token rows of a speculative step, or a row repeated for the ``n`` first samples of a request."""
        moved = {
            f.name: getattr(self, f.name).index_select(0, index)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor) and f.name not in ("banned_rows", "banned_token_ids")
        }
        if self.banned_rows is not None:
            raise ValueError("select_rows: banned_rows pairs cannot be re-indexed; pass a ban mask instead")
        return replace(self, **moved)


@dataclass
class LogprobsTensors:
    """Logprobs of the raw model distribution (temperature 1, before top-k/top-p and bans), like vLLM's
    default.

    Attributes:
        top_ids: int64 [B, n] the ``n`` most likely tokens (ties: lower id first).
        top_logprobs: float32 [B, n].
        sampled_logprob: float32 [B] logprob of the sampled token.
        sampled_rank: int64 [B] rank of the sampled token = number of tokens with logprob >= its own
            (1 = top).
    """

    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    sampled_logprob: torch.Tensor
    sampled_rank: torch.Tensor


@dataclass
class SamplerOutput:
    """Result of ``sample``: ``token_ids`` int64 [B], plus :class:`LogprobsTensors` when requested."""

    token_ids: torch.Tensor
    logprobs: LogprobsTensors | None = None
