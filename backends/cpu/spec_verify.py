"""Reference ``spec_verify`` op: draft verification for a decode step (greedy and lossless rejection sampling).

A decode row ``i`` holds ``q_i = 1 + d_i`` tokens ``[last, draft_1 .. draft_d]``; the logits at its token ``j`` give
the target distribution ``p_j`` of the token *after* it. Per flat token ``r`` the caller passes the draft proposed
for the next position (``draft_next[r]``, -1 at a row's last token) and per-token sampling tensors.

* greedy rows: ``draft_{j+1}`` is accepted iff it equals ``argmax(p_j)``;
* random rows: drafts are one-hot proposals (the drafter's argmax), so the lossless rule is: accept
  ``draft_{j+1}`` iff ``u_j < p_j(draft_{j+1})`` (``u_j`` from the hash RNG, stream ``STREAM_ACCEPT``); at the first
  rejection emit a sample of ``p_j`` with the rejected token removed (stream ``STREAM_RESIDUAL``); when every draft
  is accepted the bonus is an ordinary sample of ``p_d`` (stream ``STREAM_SAMPLE``, exactly what ``sample`` draws).

``p_j`` is the temperature / top-k / top-p distribution of the ``sample`` op (with ``min_tokens`` bans, and the
logit bias, penalties and ``min_p`` of ``logits_processors.py``), so a row with no drafts reduces to ``sample``.
For penalties, the caller's ``t.output_counts`` row of token ``j`` already counts the drafts before ``j``
(the row's tokens are a continuation being verified), so every position is judged exactly as if decoded alone.
The output distribution of every emitted token equals the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_npu.sampling.metadata import LogprobsTensors, SamplingTensors
from deepinfer_npu.sampling.rng import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    hash_uniform,
    hash_uniform_cols,
)

from .logits_processors import apply_post_temperature, apply_pre_temperature
from .sampling import compute_logprobs, top_k_top_p_mask


@dataclass
class VerifyOutput:
    """``emitted [B, Qmax]`` (-1 padded), ``num_emitted [B]`` (= accepted + 1), ``accepted [B]``,
    ``target_tokens [T]`` (the token the target settles on after each input token: the draft where accepted,
    the emitted sample at the first rejection; meaningless past it), ``logprobs`` per flat token or None."""

    emitted: torch.Tensor
    num_emitted: torch.Tensor
    accepted: torch.Tensor
    target_tokens: torch.Tensor
    logprobs: LogprobsTensors | None = None


def _gumbel_argmax(scaled: torch.Tensor, t: SamplingTensors, stream: int) -> torch.Tensor:
    u = hash_uniform(t.seeds, t.offsets, scaled.shape[1], stream=stream, dtype=torch.float32)
    return (scaled - torch.log(-torch.log(u))).argmax(dim=-1)


def spec_verify(
    logits: torch.Tensor,
    draft_next: torch.Tensor,
    row_of_token: torch.Tensor,
    j_of_token: torch.Tensor,
    num_rows: int,
    max_q: int,
    t: SamplingTensors,
    ban_mask: torch.Tensor | None = None,
) -> VerifyOutput:
    """Verify every row's drafts. ``logits [T, V]``, ``draft_next / row_of_token / j_of_token [T]`` int64,
    ``t`` per flat token (offsets = output position of the token emitted after each input token),
    ``ban_mask [T, V]`` bool: tokens excluded from the target distribution (``min_tokens``), or None."""
    logits = logits.float()
    n_tok, vocab = logits.shape
    device = logits.device
    raw_logprobs = torch.log_softmax(logits, dim=-1) if t.max_num_logprobs is not None else None
    if ban_mask is not None:
        logits = logits.masked_fill(ban_mask, float("-inf"))
    if t.needs_processing:
        logits = apply_pre_temperature(logits, t)
    has_draft = draft_next >= 0
    safe_draft = draft_next.clamp(min=0)

    greedy_tok = logits.argmax(dim=-1)
    ok = greedy_tok == safe_draft
    bonus = greedy_tok
    residual = greedy_tok
    if not t.all_greedy:
        scaled = apply_post_temperature(logits / t.temperature[:, None], t)
        if t.need_top_k or t.need_top_p:
            keep = top_k_top_p_mask(scaled, t.top_k, t.top_p, t.need_top_k, t.need_top_p)
            scaled = scaled.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        p_draft = probs.gather(1, safe_draft[:, None]).squeeze(1)
        u = hash_uniform_cols(t.seeds, t.offsets, torch.zeros(1, dtype=torch.int64, device=device),
                              stream=STREAM_ACCEPT).squeeze(1)
        accept_random = u < p_draft
        sample_tok = _gumbel_argmax(scaled, t, STREAM_SAMPLE)
        without_draft = scaled.scatter(1, safe_draft[:, None], float("-inf"))
        residual_tok = _gumbel_argmax(without_draft, t, STREAM_RESIDUAL)
        ok = torch.where(t.is_greedy, ok, accept_random)
        bonus = torch.where(t.is_greedy, greedy_tok, sample_tok)
        residual = torch.where(t.is_greedy, greedy_tok, residual_tok)
    ok = ok & has_draft

    # accepted[i] = number of leading accepted drafts of row i (padded [B, max_q] view of the flat tokens).
    ok_pad = torch.zeros(num_rows, max_q, dtype=torch.int64, device=device)
    ok_pad[row_of_token, j_of_token] = ok.to(torch.int64)
    accepted = torch.cumprod(ok_pad, dim=1).sum(dim=1)
    acc_tok = accepted.index_select(0, row_of_token)
    # At j < a the draft stands; at j == a: a residual sample after a rejection, else the bonus sample.
    at_stop = torch.where(has_draft, residual, bonus)
    target_tokens = torch.where(j_of_token < acc_tok, safe_draft, at_stop)

    emitted = torch.full((num_rows, max_q), -1, dtype=torch.int64, device=device)
    # Every (row, j) pair is written once: the token where j <= accepted, -1 past it (no data-dependent shape,
    # so no host synchronisation on devices).
    live = j_of_token <= acc_tok
    emitted[row_of_token, j_of_token] = torch.where(live, target_tokens, torch.full_like(target_tokens, -1))
    logprobs = None
    if raw_logprobs is not None:
        assert t.max_num_logprobs is not None
        logprobs = compute_logprobs(raw_logprobs, target_tokens, t.max_num_logprobs)
    return VerifyOutput(emitted=emitted, num_emitted=accepted + 1, accepted=accepted,
                        target_tokens=target_tokens, logprobs=logprobs)
