"""CPU implementation of ``torch_npu.npu_fused_infer_attention_score`` in the mode the backend uses (MLA:
``query_rope``/``key_rope``, PagedAttention, TND queries), from its documentation.

Doc: Ascend/pytorch docs torch_npu-npu_fused_infer_attention_score.md (hiascend Pytorch/700 ptaoplist_001232):
query TND [T, N, D]; key/value paged [block_num, N_kv, block_size, D] with ``block_table`` [B, max_blocks] int32
(second dim >= the blocks of the longest ``actual_seq_lengths_kv``); ``actual_seq_lengths`` in TND = cumulative
query ends per request (non-decreasing; its length is the batch); ``actual_seq_lengths_kv`` = key lengths.
Mask rules, as documented for this mode (query D=512 with query_rope: "Q_S等于1时只支持sparse=0且不传mask，Q_S大于1
时只支持sparse=3且传入mask"; TND: "sparse模式仅支持sparse=0且不传mask，或sparse=3且传入mask"):
* sparse_mode=0 without ``atten_mask``: no masking, every query sees all ``actual_seq_lengths_kv`` keys;
* sparse_mode=3 ("rightDownCausal", the lower triangle anchored at the bottom-right corner): query i of a
  request with q queries and k keys sees keys <= k - q + i; ``atten_mask`` must be the optimised 2048x2048 mask,
  shape (S, S), (1, S, S) or (1, 1, S, S) with S = 2048, dtype bool/int8/uint8, 1 = not computed, i.e. the strict
  upper triangle;
* any other mask / mode (a custom per-request mask included) is outside the documented contract and raises.
MLA mode limits each request to 1..16 queries; returns (attention_out, softmax_lse). Other modes raise: the
emulation only vouches for what it implements.
"""

from __future__ import annotations

import torch

from .contract import check, record

MAX_Q_MLA = 16

_STRICT_UPPER: dict[torch.device, torch.Tensor] = {}


def _strict_upper(device: torch.device) -> torch.Tensor:
    """The documented 2048x2048 sparse_mode=3 mask (bool, 1 = masked), built once per device: every call compares
    its mask against it, and building it took a third of the emulated attention's time."""
    if device not in _STRICT_UPPER:
        _STRICT_UPPER[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), 1)
    return _STRICT_UPPER[device]


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift=None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: list[int] | None = None,
    actual_seq_lengths_kv: list[int] | None = None,
    block_table: torch.Tensor | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    antiquant_scale=None,
    softmax_lse_flag: bool = False,
    **unsupported,
) -> tuple[torch.Tensor, torch.Tensor]:
    record("npu_fused_infer_attention_score")
    check(not unsupported, f"FIA emulation: unsupported arguments {sorted(unsupported)}")
    check(input_layout == "TND", "FIA emulation implements input_layout='TND' only")
    check(query_rope is not None and key_rope is not None, "FIA emulation implements the MLA mode only")
    check(
        block_table is not None and block_table.dtype == torch.int32, "block_table must be int32 [B, blocks]"
    )
    check(query.dim() == 3 and query.shape[1] == num_heads, "query must be [T, num_heads, D]")
    check(query_rope.shape[:2] == query.shape[:2], "query_rope must be [T, num_heads, Dr]")
    check(query.is_contiguous() and query_rope.is_contiguous(), "FIA does not take non-contiguous queries")
    check(
        key.dim() == 4 and key.shape[1] == num_key_value_heads == 1, "key must be [blocks, 1, block_size, D]"
    )
    check(key.shape[2] == block_size and key_rope.shape[:3] == key.shape[:3], "key/key_rope block layout")
    check(value is key or torch.equal(value, key), "MLA mode: value is the latent key")
    check(key.dtype == query.dtype and key_rope.dtype == query.dtype, "query and cache dtypes must match")
    check(sparse_mode in (0, 3), "TND / MLA mode: sparse_mode 0 (no mask) or 3 (2048^2 mask) only")
    if sparse_mode == 0:
        check(atten_mask is None, "TND / MLA mode: sparse_mode=0 takes no atten_mask")
    else:
        check(atten_mask is not None, "sparse_mode=3 needs the optimised 2048x2048 atten_mask")
        check(
            tuple(atten_mask.shape) in ((2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)),
            f"sparse_mode=3 takes a (1,)(1,)2048x2048 mask, got {tuple(atten_mask.shape)}",
        )
        check(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), "atten_mask dtype bool/int8/uint8")
        m2 = atten_mask.reshape(2048, 2048).bool()
        check(
            bool(torch.equal(m2, _strict_upper(m2.device))),
            "sparse_mode=3 mask must be the strict upper triangle (1 = masked)",
        )
    ends, kv_lens = list(actual_seq_lengths or []), list(actual_seq_lengths_kv or [])
    check(all(isinstance(v, int) for v in ends + kv_lens), "actual_seq_lengths(_kv) are host int lists")
    check(
        len(ends) == len(kv_lens) == block_table.shape[0],
        "one length pair and one block-table row per request",
    )
    check(ends and ends[-1] == query.shape[0], "TND: the last cumulative query end is T")
    check(all(a <= b for a, b in zip([0, *ends], ends)), "TND: actual_seq_lengths must be non-decreasing")
    max_blocks = max(-(-k // block_size) for k in kv_lens)
    check(block_table.shape[1] >= max_blocks, "block_table narrower than the longest actual_seq_lengths_kv")
    used = torch.cat([block_table[b, : -(-k // block_size)] for b, k in enumerate(kv_lens)])
    check(bool((used >= 0).all()) and bool((used < key.shape[0]).all()), "block ids must index the cache")

    t, n, d = query.shape
    out = torch.zeros_like(query)
    lse = torch.full((t, n, 1), float("-inf"), dtype=torch.float32)
    k_flat = key.reshape(-1, block_size, d)  # [blocks, bs, D] (N_kv = 1)
    r_flat = key_rope.reshape(-1, block_size, key_rope.shape[-1])
    start = 0
    for b, (end, k_len) in enumerate(zip(ends, kv_lens)):
        q_len = end - start
        check(0 < q_len <= MAX_Q_MLA, f"MLA mode takes 1..{MAX_Q_MLA} queries per request, got {q_len}")
        check(q_len <= k_len, "each request needs at least as many keys as queries")
        check(sparse_mode == 3 or q_len == 1, "MLA mode: Q_S > 1 takes sparse_mode=3 with the mask only")
        nblk = -(-k_len // block_size)
        rows = block_table[b, :nblk].long()
        c = k_flat[rows].reshape(-1, d)[:k_len].float()
        kr = r_flat[rows].reshape(-1, r_flat.shape[-1])[:k_len].float()
        q = query[start:end].float()
        qr = query_rope[start:end].float()
        s = (torch.einsum("qhl,kl->hqk", q, c) + torch.einsum("qhr,kr->hqk", qr, kr)) * scale
        if sparse_mode == 3:  # rightDownCausal: query i sees keys <= k_len - q_len + i
            q_pos = torch.arange(k_len - q_len, k_len)
            s = s.masked_fill(torch.arange(k_len)[None, None, :] > q_pos[None, :, None], float("-inf"))
        lse[start:end] = torch.logsumexp(s, dim=-1).transpose(0, 1).unsqueeze(-1)
        out[start:end] = torch.einsum("hqk,kl->qhl", torch.softmax(s, dim=-1), c).to(out.dtype)
        start = end
    return out, lse


def npu_fused_infer_attention_score_out(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, workspace: torch.Tensor, out, **kwargs
):
    """``torch_npu.npu_fused_infer_attention_score.out(..., workspace=ws, out=[attention_out, softmax_lse])``: the
    same op writing into caller-owned outputs with a caller-owned workspace (the form NPU graphs capture). Doc
    example: torch_npu-npu-graph_task_group_begin.md; usage: vllm_ascend/attention/mla_v1.py (capturing branch).
    ``softmax_lse`` is written only with ``softmax_lse_flag=True``."""
    record("npu_fused_infer_attention_score.out")
    check(isinstance(workspace, torch.Tensor), "FIA .out: workspace from _npu_fused_infer_attention_score_get_max_"
          "workspace is required")
    check(isinstance(out, (list, tuple)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out),
          "FIA .out: out=[attention_out, softmax_lse]")
    check(out[0].shape == query.shape and out[0].dtype == query.dtype, "FIA .out: attention_out is query-shaped")
    attn, lse = npu_fused_infer_attention_score(query, key, value, **kwargs)
    out[0].copy_(attn)
    if kwargs.get("softmax_lse_flag", False):
        out[1].copy_(lse.to(out[1].dtype).reshape(out[1].shape))
    return out[0], out[1]


def npu_fused_infer_attention_score_get_max_workspace(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs
) -> torch.Tensor:
    """``torch_npu._npu_fused_infer_attention_score_get_max_workspace(query, key, value, **same kwargs)``: the
    workspace tensor the ``.out`` form takes (sized for the largest lengths, so task updates never outgrow it).
    The emulation checks the arguments against the op's contract and returns a placeholder workspace."""
    record("_npu_fused_infer_attention_score_get_max_workspace")
    npu_fused_infer_attention_score(query, key, value, **kwargs)  # same argument contract
    return torch.empty(64, dtype=torch.uint8, device=query.device)
