"""MLA on Ascend: composed prolog (native norms + rope + split-cache write) and the fused attention op.

Attention maps onto ``torch_npu.npu_fused_infer_attention_score`` in MLA mode — queries in the latent space
(TND layout, [T, N, L]) plus ``query_rope``; the paged caches as ``key``/``value`` (the latent is both) plus
``key_rope``; ``sparse_mode=3`` (causal aligned to the end of each request's keys) with the 2048x2048 mask it
requires. FIA takes at most 16 query tokens per request in this mode, so longer requests (prefill chunks,
many drafts) are split into pieces of <= 16 queries, each piece a pseudo-request whose key length ends at its
last query: causal attention of the whole request equals the union of its pieces.

Doc: Ascend/pytorch docs torch_npu-npu_fused_infer_attention_score.md (hiascend Pytorch/700 ptaoplist_001232);
usage: vllm_ascend/attention/mla_v1.py ``_forward_decode`` (SpecDecoding branch: TND, sparse_mode=3,
``actual_seq_lengths`` = cumulative query ends, ``actual_seq_lengths_kv`` = per-request key lengths).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_npu.hal import sync_guard
from deepinfer_npu.hal.types import MLAWeights, RopeLike

from . import kv_layout, runtime
from .ops_dense import rms_norm

#: sparse_mode=3 ("rightDownCausal") takes this fixed, compressed mask (doc: atten_mask 2048x2048, 1 =
# masked).
FIA_MASK_SIZE = 2048
#: Times a host length list was read inside ``forbid_sync()`` (see :func:`host_list`); tests read it.
HOST_READS_IN_LAUNCH_PATH = 0

_masks: dict[tuple[str, int | None], torch.Tensor] = {}


def _causal_mask(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _masks:
        _masks[key] = torch.triu(
            torch.ones(FIA_MASK_SIZE, FIA_MASK_SIZE, dtype=torch.bool, device=device), diagonal=1
        )
    return _masks[key]


def host_list(t: torch.Tensor, what: str) -> list[int]:
    """FIA takes ``actual_seq_lengths(_kv)`` as host int lists (SymInt[] in eager torch_npu). The HAL passes
    them as device tensors only, so reading them is a device->host sync. On an NPU inside ``forbid_sync()``
    that raises (the guard's job) until AttentionMetadata carries host copies (hand-off note, gap 1); under
    the CPU emulation the read is free, so we count it instead to keep the gap visible in tests."""
    global HOST_READS_IN_LAUNCH_PATH
    if sync_guard.sync_forbidden():
        if t.device.type != "cpu":
            sync_guard.check_sync_allowed(f"{what}.tolist() for npu_fused_infer_attention_score")
        HOST_READS_IN_LAUNCH_PATH += 1
    return [int(v) for v in t.tolist()]


def mla_prolog(
    hidden: torch.Tensor,
    w: MLAWeights,
    positions: torch.Tensor,
    rope: RopeLike,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_fn,
    split_cache: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HAL ``mla_prolog`` from native pieces: ``F.linear`` (aten matmul on the NPU), ``npu_rms_norm`` for
    q_a/kv_a norms, ``rope_fn`` (npu_interleave_rope / npu_rotary_mul or the reference), then the cache write
    into the split layout (``split_cache``) or the HAL layout.

    The single fused ``npu_mla_prolog_v2/_v3`` is not called: it needs FRACTAL_NZ weights (``npu_format_cast``
    at load; the HAL has no load hook yet), fixes He=7168/Hcq=1536/L=512/D=128/R=64, and writes k_rope in
    de-interleaved order while the HAL contract returns q_rope interleaved. Same for
    npu_kv_rmsnorm_rope_cache.
    Doc: torch_npu-npu_mla_prolog_v2.md, torch_npu-npu_kv_rmsnorm_rope_cache.md (Ascend/pytorch docs).
    """
    num_tokens = hidden.shape[0]
    nope, rdim, lrank = w.qk_nope_head_dim, w.qk_rope_head_dim, w.kv_lora_rank
    if w.q_proj is not None:
        q = F.linear(hidden, w.q_proj)
    else:
        q = F.linear(
            rms_norm(F.linear(hidden, w.q_a_proj, w.q_a_bias), w.q_a_layernorm, w.norm_eps), w.q_b_proj
        )
    q = q.view(num_tokens, w.num_heads, nope + rdim)
    q_nope, q_pe = q.split([nope, rdim], dim=-1)
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w.w_uk)  # W_UK absorption (aten bmm on the NPU)
    q_rope = rope_fn(q_pe, positions, rope.cos_sin_cache, rope.interleaved)

    kv = F.linear(hidden, w.kv_a_proj, w.kv_a_bias)
    c_kv, k_pe = kv.split([lrank, rdim], dim=-1)
    c_kv = rms_norm(c_kv.contiguous(), w.kv_a_layernorm, w.norm_eps)
    k_pe = rope_fn(k_pe.unsqueeze(1), positions, rope.cos_sin_cache, rope.interleaved).squeeze(1)
    if split_cache:
        kv_layout.write_split(kv_cache, c_kv, k_pe, slot_mapping)
    else:
        from deepinfer_npu.backends.cpu.mla import write_kv_cache

        write_kv_cache(kv_cache, torch.cat((c_kv, k_pe), dim=-1), slot_mapping)
    return q_latent, q_rope


def split_requests(
    seqlens_q: list[int], seqlens_k: list[int], max_q: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Pieces of <= ``max_q`` queries: ``(cumulative query ends, key lengths, source request, query counts)``.

    Piece ``[s, e)`` of a request with ``q`` queries and ``k`` keys ends at position ``k - q + e - 1``, so its
    key length is ``k - q + e``; with causal masking aligned to the end of the keys (sparse_mode=3) each of
    its
    queries sees exactly what it sees in the whole request. Empty requests are dropped.
    """
    ends, kv, src, counts = [], [], [], []
    total = 0
    for b, (q, k) in enumerate(zip(seqlens_q, seqlens_k)):
        for s in range(0, q, max_q):
            e = min(q, s + max_q)
            total += e - s
            ends.append(total)
            kv.append(k - q + e)
            src.append(b)
            counts.append(e - s)
    return ends, kv, src, counts


def mla_attention_fia(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float,
    max_q_per_request: int,
) -> torch.Tensor:
    """HAL ``mla_attention`` through ``npu_fused_infer_attention_score`` over the split-layout cache."""
    num_tokens, num_heads, lrank = q_latent.shape
    rdim = q_rope.shape[-1]
    out = torch.zeros_like(q_latent)
    if num_tokens == 0:
        return out
    q_lens = host_list(seqlens_q, "seqlens_q")
    k_lens = host_list(seqlens_k, "seqlens_k")
    ends, kv_lens, src, _ = split_requests(q_lens, k_lens, max_q_per_request)
    if src == list(range(len(q_lens))):
        tables = block_tables
    else:
        tables = block_tables.index_select(0, torch.tensor(src, dtype=torch.long).to(block_tables.device))
    block_size = kv_cache.shape[1]
    k_nope, k_rope = kv_layout.split_views(kv_cache, lrank, rdim)
    nb = kv_cache.shape[0]
    # Key layout as vllm-ascend passes it: [num_blocks, num_kv_heads=1, block_size, D] (a view: N_kv is 1).
    key = k_nope.view(nb, 1, block_size, lrank)
    key_rope = k_rope.view(nb, 1, block_size, rdim)
    npu = runtime.load()
    attn, _lse = npu.npu_fused_infer_attention_score(
        q_latent[: ends[-1]].contiguous(),
        key,
        key,
        query_rope=q_rope[: ends[-1]].contiguous(),
        key_rope=key_rope,
        num_heads=num_heads,
        num_key_value_heads=1,
        input_layout="TND",
        atten_mask=_causal_mask(q_latent.device),
        sparse_mode=3,
        scale=softmax_scale,
        antiquant_mode=0,
        antiquant_scale=None,
        block_table=tables.to(torch.int32),
        block_size=block_size,
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=kv_lens,
    )
    out[: ends[-1]] = attn.to(out.dtype)
    return out


def mla_epilogue(out_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """``W_UV`` up-projection (aten bmm) then ``o_proj`` — plain matmuls, native on the NPU."""
    values = torch.einsum("thl,hvl->thv", out_latent, w.w_uv)
    return F.linear(values.reshape(values.shape[0], -1), w.o_proj, w.o_bias)
