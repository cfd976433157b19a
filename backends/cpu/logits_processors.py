"""Reference logits processors (plain torch): logit bias, repetition / frequency / presence penalties, min-p.

The sampler (``spec_verify``, and ``sample`` which it reduces to) applies them in vLLM V1's order:

1. ``min_tokens`` bans and ``logit_bias`` (they can change the argmax);
2. penalties (:func:`apply_penalties`), on the float32 logits before temperature — so they shape greedy rows
   too;
3. temperature, then ``min_p`` (:func:`apply_min_p`, random rows only: it never changes the argmax), then
   top-k / top-p.

Logprobs stay those of the raw model distribution (vLLM's default ``logprobs_mode``): the processors run after
them. Rows with the neutral values (bias 0, penalties 0 / 0 / 1, ``min_p`` 0) come out bit-identical, so a
batch mixing rows with and without processors samples the plain rows exactly as a batch without them. CUDA
and Ascend call these same functions on their tensors (torch ops, no host synchronisation).
"""

from __future__ import annotations

import torch

from deepinfer_npu.sampling.metadata import SamplingTensors

__all__ = ["apply_penalties", "apply_min_p", "apply_pre_temperature", "apply_post_temperature"]


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's / HF's penalties on float32 ``logits [B, V]``.

    ``output_counts [B, V]``: how often each token was generated (before the one being sampled);
    ``prompt_mask [B, V]``: tokens of the prompt; ``presence / frequency / repetition [B]``.

    * repetition: a token seen in the prompt or the output has ``logit / r`` when ``logit > 0``, else
      ``logit * r`` (HF's ``RepetitionPenaltyLogitsProcessor``);
    * frequency / presence: ``logit -= frequency * count + presence * (count > 0)`` (OpenAI's definition).
    """
    counts = output_counts.to(logits.dtype)
    generated = output_counts > 0
    rep = torch.where(generated | prompt_mask, repetition[:, None], torch.ones_like(repetition)[:, None])
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * generated.to(logits.dtype)


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Remove tokens whose probability under ``softmax(scaled)`` is below ``min_p * max probability``
    (``scaled [B, V]``: temperature-scaled logits; ``min_p [B]``, 0 = off). The top token always stays."""
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return scaled.masked_fill(probs < threshold, float("-inf"))


def apply_pre_temperature(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Steps 1-2 of the module docstring (bias, then penalties) on float32 ``logits [B, V]`` (bans applied);
    returns ``logits`` itself when no row uses them."""
    if t.logit_bias is not None:
        logits = logits + t.logit_bias
    if t.need_penalties:
        if t.output_counts is None or t.prompt_mask is None:
            raise ValueError("penalties need output_counts and prompt_mask (set by the worker)")
        assert t.frequency_penalty is not None and t.repetition_penalty is not None
        logits = apply_penalties(logits, t.output_counts, t.prompt_mask, t.presence_penalty,
                                 t.frequency_penalty, t.repetition_penalty)
    return logits


def apply_post_temperature(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Step 3's ``min_p`` on temperature-scaled logits; ``scaled`` itself when no row uses it."""
    if t.min_p is None:
        return scaled
    return apply_min_p(scaled, t.min_p)
