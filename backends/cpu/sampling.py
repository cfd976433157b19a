"""Reference sampler (plain torch): greedy, temperature, top-k, top-p, seeded Gumbel-max, logprobs.

``spec_verify`` builds on its pieces (the top-k / top-p mask, logprobs) and, for a row without drafts, draws exactly
what :func:`sample` draws; :func:`sample` is the oracle the sampling tests compare against.

For a random row with temperature ``T``:

1. ``z = logits / T`` (after ``min_tokens`` bans set some logits to ``-inf``, and the logit bias and penalties
   of ``logits_processors.py`` were applied), then ``min_p`` removes unlikely tokens of ``softmax(z)``;
2. top-k keeps the ``k`` largest ``z`` (ties: lower token id first, via a stable descending sort);
3. top-p, on the softmax of the kept ``z``, keeps the shortest prefix of that order whose mass reaches ``p``
   (a token is kept iff the mass strictly before it is ``< p``; the top token is always kept);
4. the token is ``argmax(z_kept + g)`` with Gumbel noise ``g = -log(-log(u))``, ``u`` from the hash RNG keyed
   by the row's ``(seed, offset)`` — an exact sample from ``softmax(z)`` restricted to the kept tokens.

Greedy rows take ``argmax(logits)`` (lowest id on ties; after bans, bias and penalties). Logprobs are those of
the raw distribution ``log_softmax(logits)`` (temperature 1, unfiltered, before bans and the processors), as vLLM
returns by default.
Every step is a pure function of the inputs, so other backends can be tested against this one bit for bit
(up to the last ulp of ``log``).
"""

from __future__ import annotations

import torch

from deepinfer_npu.sampling.metadata import LogprobsTensors, SamplerOutput, SamplingTensors
from deepinfer_npu.sampling.rng import STREAM_SAMPLE, hash_uniform

from .logits_processors import apply_post_temperature, apply_pre_temperature

# The op's types are re-exported here: ``SamplingTensors`` in, ``SamplerOutput`` out.
__all__ = [
    "sample",
    "top_k_top_p_mask",
    "gumbel_noise",
    "compute_logprobs",
    "SamplingTensors",
    "SamplerOutput",
    "LogprobsTensors",
]


def top_k_top_p_mask(
    scaled_logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    apply_top_k: bool = True,
    apply_top_p: bool = True,
) -> torch.Tensor:
    """Boolean ``[B, V]`` mask of the tokens kept by top-k then top-p.

    Args:
        scaled_logits: float32 ``[B, V]`` temperature-scaled logits.
        top_k: int64 ``[B]``, 0 = disabled.
        top_p: float32 ``[B]``, 1 = disabled.
        apply_top_k / apply_top_p: host flags to skip a filter no row uses.
    """
    b, v = scaled_logits.shape
    sorted_vals, sorted_idx = torch.sort(scaled_logits, dim=-1, descending=True, stable=True)
    pos = torch.arange(v, device=scaled_logits.device)
    keep_sorted = torch.ones((b, v), dtype=torch.bool, device=scaled_logits.device)
    if apply_top_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
        keep_sorted &= pos[None, :] < k[:, None]
    if apply_top_p:
        probs = torch.softmax(sorted_vals.masked_fill(~keep_sorted, float("-inf")), dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        keep_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep_p[:, 0] = True
        keep_sorted &= keep_p
    return torch.zeros_like(keep_sorted).scatter_(1, sorted_idx, keep_sorted)


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, V]`` from the hash RNG (stream ``STREAM_SAMPLE``)."""
    u = hash_uniform(seeds, offsets, vocab_size, stream=STREAM_SAMPLE, dtype=torch.float32)
    return -torch.log(-torch.log(u))


def compute_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, n: int) -> LogprobsTensors:
    """Top-``n`` and sampled-token logprobs from ``raw_logprobs`` ``[B, V]`` (see
    :class:`LogprobsTensors`)."""
    sampled = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
    rank = (raw_logprobs >= sampled[:, None]).sum(dim=-1).to(torch.int64)
    if n > 0:
        vals, ids = torch.sort(raw_logprobs, dim=-1, descending=True, stable=True)
        top_lp, top_ids = vals[:, :n], ids[:, :n]
    else:
        top_lp = raw_logprobs.new_zeros((raw_logprobs.shape[0], 0))
        top_ids = token_ids.new_zeros((raw_logprobs.shape[0], 0))
    return LogprobsTensors(
        top_ids=top_ids.to(torch.int64), top_logprobs=top_lp, sampled_logprob=sampled, sampled_rank=rank
    )


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[B, V]`` (see the module docstring)."""
    if logits.dim() != 2 or logits.shape[0] != t.num_rows:
        raise ValueError(f"logits must be [B, V] with B = {t.num_rows} rows, got {tuple(logits.shape)}")
    logits = logits.float()
    v = logits.shape[1]
    if logits.shape[0] == 0:  # a step with nothing to sample (e.g. only non-final prefill chunks)
        return SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64, device=logits.device), logprobs=None)

    raw_logprobs = torch.log_softmax(logits, dim=-1) if t.max_num_logprobs is not None else None

    if t.banned_rows is not None and t.banned_token_ids is not None:
        logits = logits.clone()
        logits[t.banned_rows, t.banned_token_ids] = float("-inf")
    if t.needs_processing:
        logits = apply_pre_temperature(logits, t)

    greedy_ids = logits.argmax(dim=-1) if not t.all_random else None
    if t.all_greedy:
        assert greedy_ids is not None
        token_ids = greedy_ids
    else:
        scaled = apply_post_temperature(logits / t.temperature[:, None], t)
        if t.need_top_k or t.need_top_p:
            keep = top_k_top_p_mask(scaled, t.top_k, t.top_p, t.need_top_k, t.need_top_p)
            scaled = scaled.masked_fill(~keep, float("-inf"))
        random_ids = (scaled + gumbel_noise(t.seeds, t.offsets, v)).argmax(dim=-1)
        token_ids = random_ids if greedy_ids is None else torch.where(t.is_greedy, greedy_ids, random_ids)
    token_ids = token_ids.to(torch.int64)

    logprobs = None
    if raw_logprobs is not None:
        assert t.max_num_logprobs is not None
        logprobs = compute_logprobs(raw_logprobs, token_ids, t.max_num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
