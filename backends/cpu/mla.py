"""Multi-head latent attention (MLA) reference ops over the paged latent cache.

The cache holds, per token, ``c_kv ‖ k_rope`` ([L + R] values): the normalised latent (which is both the
absorbed key and the value) and the rotated shared rope key. Queries are absorbed into the latent space
(``q_latent = q_nope @ W_UK``), so attention never materialises per-head keys or values; the per-head values
come back in :func:`mla_epilogue` through ``W_UV``.
"""

from __future__ import annotations

import torch

from deepinfer_npu.hal.types import MLAWeights, RopeLike
from deepinfer_npu.model_executor.quantization.kv_fp8 import FP8_KV_DTYPE, pack_fp8_latents, unpack_fp8_latents

from .linear import linear
from .norm import rms_norm
from .rope import rope as apply_rope


def mla_prolog(
    hidden: torch.Tensor,
    w: MLAWeights,
    positions: torch.Tensor,
    rope: RopeLike,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` [T, D] -> ``(q_latent [T, H, L], q_rope [T, H, R])``; writes ``[T, L+R]`` latents into
    ``kv_cache`` [num_blocks, block_size, L+R] at ``slot_mapping`` [T] (negative = padding, skipped)."""
    num_tokens = hidden.shape[0]
    nope, rdim, lrank = w.qk_nope_head_dim, w.qk_rope_head_dim, w.kv_lora_rank

    if w.q_proj is not None:
        q = linear(hidden, w.q_proj)
    else:
        q = linear(rms_norm(linear(hidden, w.q_a_proj, w.q_a_bias), w.q_a_layernorm, w.norm_eps), w.q_b_proj)
    q = q.view(num_tokens, w.num_heads, nope + rdim)
    q_nope, q_pe = q.split([nope, rdim], dim=-1)
    # Absorb W_UK: (q_nope · W_UK c) == (q_nope W_UK) · c, so scores can be taken against the latent directly.
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w.w_uk)
    q_rope = apply_rope(q_pe, positions, rope.cos_sin_cache, rope.interleaved)

    kv = linear(hidden, w.kv_a_proj, w.kv_a_bias)
    c_kv, k_pe = kv.split([lrank, rdim], dim=-1)
    c_kv = rms_norm(c_kv, w.kv_a_layernorm, w.norm_eps)
    k_pe = apply_rope(k_pe.unsqueeze(1), positions, rope.cos_sin_cache, rope.interleaved).squeeze(1)
    write_kv_cache(kv_cache, torch.cat((c_kv, k_pe), dim=-1), slot_mapping, lrank)
    return q_latent, q_rope


def write_kv_cache(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_lora_rank: int | None = None) -> None:
    """Scatter ``latents`` [T, L+R] into ``kv_cache`` [num_blocks, block_size, L+R] at ``slot_mapping``
    [T]. A uint8 cache holds packed FP8 rows (``kv_cache_dtype="fp8"``; ``kv_lora_rank`` = L is then needed)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    if kv_cache.dtype == FP8_KV_DTYPE:
        if kv_lora_rank is None:
            raise ValueError("writing a packed FP8 latent cache needs kv_lora_rank")
        flat[slot_mapping[valid]] = pack_fp8_latents(latents[valid], kv_lora_rank)
        return
    flat[slot_mapping[valid]] = latents[valid].to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seqlen_k: int,
              split: tuple[int, int] | None = None) -> torch.Tensor:
    """The first ``seqlen_k`` cache rows [seqlen_k, L+R] of one request, following its ``block_table``
    [nb]; rows of a packed FP8 cache come back dequantized to fp32 (``split`` = (L, R) is then needed)."""
    block_size = kv_cache.shape[1]
    num_blocks = -(-seqlen_k // block_size)
    blocks = kv_cache[block_table[:num_blocks].long()]  # [nb, block_size, L+R]
    rows = blocks.reshape(-1, kv_cache.shape[-1])[:seqlen_k]
    if kv_cache.dtype == FP8_KV_DTYPE:
        if split is None:
            raise ValueError("reading a packed FP8 latent cache needs the (kv_lora_rank, rope_dim) split")
        return unpack_fp8_latents(rows, *split)
    return rows


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
    host=None,
    max_seqlen_q: int | None = None,
    is_prefill: bool | None = None,
) -> torch.Tensor:
    """Causal absorbed attention per request over its paged cache -> ``out_latent`` [T, H, L] (q's dtype).
    ``max_seqlen_q`` (the HAL's host query-length bound) and ``is_prefill`` are not needed here: the loop reads
    each request's length.

    Query j of request b has position ``seqlens_k[b] - seqlens_q[b] + j`` and sees cache positions <= it.
    Scores and softmax are computed in fp32. One loop iteration per request (the oracle favours clarity).
    ``host`` (``HostLengths``): when its lengths are exact (every prefill step), the loop takes them instead of
    reading the device tensors, so a device backend can run this arithmetic without host-device syncs.
    """
    lrank = q_latent.shape[-1]
    out = torch.zeros_like(q_latent)
    num_reqs = block_tables.shape[0]
    on_host = host is not None and host.seqlens_k_exact and len(host.seqlens_q) == num_reqs
    host_start = 0
    for b in range(num_reqs):
        if on_host:
            q_len, k_len, start = host.seqlens_q[b], host.seqlens_k[b], host_start
            host_start += q_len
        else:
            q_len, k_len = int(seqlens_q[b]), int(seqlens_k[b])
        if q_len == 0:
            continue
        if not on_host:
            start = int(cu_seqlens_q[b])
        kv = gather_kv(kv_cache, block_tables[b], k_len, (lrank, q_rope.shape[-1])).float()  # [k_len, L+R]
        c_kv, k_pe = kv[:, :lrank], kv[:, lrank:]
        ql = q_latent[start : start + q_len].float()  # [q_len, H, L]
        qr = q_rope[start : start + q_len].float()  # [q_len, H, R]
        scores = (
            torch.einsum("qhl,kl->hqk", ql, c_kv) + torch.einsum("qhr,kr->hqk", qr, k_pe)
        ) * softmax_scale
        q_pos = torch.arange(k_len - q_len, k_len, device=scores.device)
        k_pos = torch.arange(k_len, device=scores.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,kl->qhl", probs, c_kv).to(out.dtype)
    return out


def mla_epilogue(out_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """``out_latent`` [T, H, L] -> values ``out_latent @ W_UV^T`` [T, H, V] -> ``o_proj`` -> [T, D]."""
    values = torch.einsum("thl,hvl->thv", out_latent, w.w_uv)
    return linear(values.reshape(values.shape[0], -1), w.o_proj, w.o_bias)
