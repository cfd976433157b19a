"""Plain torch references for the sampling controls on the reference model: the model's logits over a whole token
sequence (one prefill, no incremental state), and greedy decoding with the controls written out from their
definitions (vLLM / OpenAI / HF) instead of through the engine's processors."""

from __future__ import annotations

import torch

from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.model_executor import build_attention_metadata
from deepinfer_npu.model_executor.kv_cache import allocate_kv_caches


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[len(ids), V]`` of one sequence through a fresh paged cache."""
    block = 64
    blocks = -(-len(ids) // block)
    caches = allocate_kv_caches(model.config, blocks + 1, block, torch.float32)
    attn = build_attention_metadata([len(ids)], [len(ids)], [list(range(1, blocks + 1))], block)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), attn.positions, attn, caches)).float()


def controlled_logits(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One position's logits ``[V]`` after logit bias and the penalties, token by token from the definitions."""
    x = logits.clone()
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    seen = set(prompt) | set(output)
    for tok in seen:
        if p.repetition_penalty != 1.0:
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(output):
        x[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return x


def greedy_reference(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """``p.max_tokens`` greedy tokens, each from a full forward of prompt + output so far."""
    output: list[int] = []
    for _ in range(p.max_tokens):
        logits = full_logits(model, prompt + output)[-1]
        output.append(int(controlled_logits(logits, prompt, output, p).argmax()))
    return output
