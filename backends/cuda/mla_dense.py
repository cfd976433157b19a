"""Sync-free MLA decode attention in composed torch: the CUDA fallback for shapes the TileLang kernel does not
cover (e.g. the reference model's kv_lora 64 + rope 32), so those decode steps can be captured in a CUDA graph.

Every token gathers its request's whole block table (``[T, W * block_size, L + R]``, fp32) and masks keys past its
position; nothing is read on the host and every shape is fixed by the inputs' shapes (graph-safe). Rows with no
query tokens are skipped by construction; block-table padding (block 0) is masked. Same arithmetic as the CPU
reference (``backends/cpu/mla.py``: fp32 scores and softmax), vectorised over requests.
"""

from __future__ import annotations

import torch

from deepinfer_npu.model_executor.quantization.kv_fp8 import FP8_KV_DTYPE, fp8_latent_row_bytes, unpack_fp8_latents

#: above this many gathered bytes an eager step takes the reference instead (captured steps always come here)
MAX_GATHER_BYTES = 2 << 30


def gather_bytes(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor) -> int:
    """fp32 bytes of the gathered rows (L + R values a key; a packed FP8 row also unpacks to L + R)."""
    lrank, width = q_latent.shape[-1], kv_cache.shape[2]
    if kv_cache.dtype == FP8_KV_DTYPE:  # the packed row's bytes past the latents and their scales: 2 per RoPE value
        width = lrank + (width - fp8_latent_row_bytes(lrank, 0)) // 2
    return q_latent.shape[0] * block_tables.shape[1] * kv_cache.shape[1] * width * 4


def mla_attention_dense(q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q,
                        softmax_scale: float) -> torch.Tensor:
    """-> ``out_latent`` [T, H, L] (q's dtype). Query j of request b sits at ``seqlens_k[b] - seqlens_q[b] + j``
    and sees the cache positions <= it."""
    t, _h, lrank = q_latent.shape
    b, w = block_tables.shape
    dev = q_latent.device
    tok = torch.arange(t, device=dev)
    cu = cu_seqlens_q.to(torch.int64)
    row = torch.searchsorted(cu[1:].contiguous(), tok, right=True).clamp(max=max(b - 1, 0))
    q_pos = seqlens_k.to(torch.int64)[row] - seqlens_q.to(torch.int64)[row] + (tok - cu[row])
    kv = kv_cache[block_tables.to(torch.int64)].reshape(b, w * kv_cache.shape[1], -1)[row]  # [T, K, L+R]
    if kv_cache.dtype == FP8_KV_DTYPE:  # packed FP8 rows (kv_cache_dtype="fp8"): dequantised as the reference does
        kv = unpack_fp8_latents(kv, lrank, q_rope.shape[-1])
    kv = kv.float()
    c_kv, k_pe = kv[..., :lrank], kv[..., lrank:]
    scores = (torch.einsum("thl,tkl->thk", q_latent.float(), c_kv)
              + torch.einsum("thr,tkr->thk", q_rope.float(), k_pe)) * softmax_scale
    k_pos = torch.arange(kv.shape[1], device=dev)
    scores = scores.masked_fill((k_pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("thk,tkl->thl", probs, c_kv).to(q_latent.dtype)

