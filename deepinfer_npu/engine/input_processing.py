"""Input processing for the engine: prompt validation/tokenization and the per-row request data of a step."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.sampling import min_tokens_banned_ids
from deepinfer_npu.worker.step_io import StepPlan, StepRequests

_DROPPED_PARAMS = SamplingParams(temperature=0.0)  # rows of requests that finished while scheduled


def tokenize_prompt(request_id: str, prompt, tokenizer, vocab_size: int, model_dir) -> tuple[str | None, list[int]]:
    """Validate a prompt (text, ``{'prompt_token_ids': [...]}`` / ``{'prompt': text}`` or ids) -> (text, ids)."""
    text: str | None = None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif "prompt" in prompt:
            text = prompt["prompt"]
            ids = None
        else:
            raise ValueError(f"request {request_id!r}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        ids = prompt
    else:
        raise ValueError(f"request {request_id!r}: unsupported prompt type {type(prompt).__name__}")
    if ids is None:
        if tokenizer is None:
            raise ValueError(
                f"request {request_id!r}: model directory {model_dir} has no tokenizer.json; "
                "pass token ids as {'prompt_token_ids': [...]}"
            )
        if not text:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        ids = tokenizer.encode(text)
    for pos, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
            raise ValueError(
                f"request {request_id!r}: token id {tok!r} at position {pos} is not an integer"
            )
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"request {request_id!r}: the prompt is empty (no tokens)")
    for pos, tok in enumerate(ids):
        if not 0 <= tok < vocab_size:
            raise ValueError(
                f"request {request_id!r}: token id {tok} at position {pos} is out of the vocabulary "
                f"[0, {vocab_size})"
            )
    return text, ids


def build_step_requests(plan: StepPlan, requests_by_seq: dict, nextn: int, max_model_len: int,
                        eos_ids: list[int]) -> StepRequests:
    """Per-row request data for the worker (params, seeds, bans, prompt lengths, next prompt tokens)."""
    n = plan.num_seqs
    params, seeds, ban_ids = [], [], []
    prompt_lens = np.zeros(n, dtype=np.int64)
    min_tokens = np.zeros(n, dtype=np.int64)
    next_tokens = np.full(n, -1, dtype=np.int64)
    caps = np.zeros(n, dtype=np.int64)
    max_lp = None
    fork_seeds: list[list[int]] = [[] for _ in range(n)]
    prompt_lp = np.full(n, -1, dtype=np.int64)
    uses_penalties = False
    rebuild: list[tuple[int, list[int], list[int]]] = []
    grammars: list = [None] * n
    k = nextn
    for i, seq_id in enumerate(plan.seq_ids.tolist()):
        req = requests_by_seq.get(seq_id)
        if req is None:  # finished or aborted while scheduled: its outputs are dropped
            params.append(_DROPPED_PARAMS)
            seeds.append(0)
            ban_ids.append([])
            continue
        p = req.params
        params.append(p)
        seeds.append(req.seed)
        prompt_lens[i] = len(req.prompt_token_ids)
        min_tokens[i] = p.min_tokens
        ban_ids.append(min_tokens_banned_ids(p, 0, eos_ids) if p.min_tokens > 0 else [])
        if p.logprobs is not None:
            max_lp = p.logprobs if max_lp is None else max(max_lp, p.logprobs)
        uses_penalties = uses_penalties or p.uses_penalties
        grammars[i] = req.grammar
        if plan.is_prefill:
            if plan.is_last_chunk[i] and req.fork_seeds:
                fork_seeds[i] = list(req.fork_seeds)
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt_token_ids):
                prompt_lp[i] = p.prompt_logprobs
        elif req.rebuild_penalties:  # a fork's first step: its counts from the host's lists
            rebuild.append((i, req.prompt_token_ids, req.output_token_ids[:-1]))
            req.rebuild_penalties = False
        if plan.is_prefill and not plan.is_last_chunk[i]:
            all_tokens = req.prompt_token_ids + req.output_token_ids
            next_tokens[i] = all_tokens[int(plan.seqlens_k[i])]
        if not plan.is_prefill and k:
            # Most drafts the device may give this row when it re-splits (varlen under ZOS): all k when the
            # row is far from max_model_len / max_tokens even if every in-flight draft was accepted (the
            # scheduler then reserved k + 1 slots), otherwise the CPU's own choice, which fits its reservation.
            k1 = k + 1
            far = len(req.prompt_token_ids) + req.num_output_tokens + 2 * k1 <= max_model_len
            if p.max_tokens is not None:
                far = far and req.num_output_tokens + 2 * k1 <= p.max_tokens
            caps[i] = k if far else int(plan.seqlens_q[i]) - 1
    return StepRequests(params=params, seeds=seeds, prompt_lens=prompt_lens, min_tokens=min_tokens,
                        ban_ids=ban_ids, next_tokens=next_tokens, draft_caps=caps, max_num_logprobs=max_lp,
                        fork_seeds=fork_seeds, prompt_logprobs=prompt_lp, uses_penalties=uses_penalties,
                        penalty_rebuild=rebuild, grammars=grammars if any(g is not None for g in grammars) else None)
