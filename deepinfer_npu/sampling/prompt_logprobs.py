"""Prompt logprobs (``SamplingParams.prompt_logprobs``): for each prompt token after the first, its logprob and
rank under the model's raw distribution at the previous position, plus the top-``k`` there — vLLM's
``RequestOutput.prompt_logprobs``. Computed on the device from the prefill's hidden states in slices, so a long
prompt never materialises all its ``[tokens, vocab]`` logits at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_npu.sampling.metadata import LogprobsTensors

#: Positions per slice of logits (bounds the temporary ``[slice, vocab]`` float32 tensors).
SLICE = 256


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], token_rows: torch.Tensor,
                    targets: torch.Tensor, k: int) -> LogprobsTensors:
    """``logits_of(rows)`` -> fp32 logits ``[len(rows), V]`` of hidden rows ``rows``; ``token_rows [P]`` the rows
    whose next token is a prompt token, ``targets [P]`` that token; ``k`` the top entries per position.
    Ranks count the tokens with a logprob >= the target's (1 = most likely), as the sampler's logprobs."""
    parts = []
    for start in range(0, token_rows.shape[0], SLICE):
        rows = token_rows[start:start + SLICE]
        tgt = targets[start:start + SLICE]
        lp = torch.log_softmax(logits_of(rows).float(), dim=-1)
        chosen = lp.gather(1, tgt[:, None]).squeeze(1)
        rank = (lp >= chosen[:, None]).sum(dim=-1).to(torch.int64)
        if k > 0:
            vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
            top_lp, top_ids = vals[:, :k], ids[:, :k].to(torch.int64)
        else:
            top_lp = lp.new_zeros((lp.shape[0], 0))
            top_ids = tgt.new_zeros((lp.shape[0], 0), dtype=torch.int64)
        parts.append((top_ids, top_lp, chosen, rank))
    if not parts:
        empty = targets.new_zeros((0, max(k, 0)), dtype=torch.int64)
        return LogprobsTensors(empty, empty.float(), targets.new_zeros(0, dtype=torch.float32),
                               targets.new_zeros(0, dtype=torch.int64))
    return LogprobsTensors(*(torch.cat([p[i] for p in parts]) for i in range(4)))
