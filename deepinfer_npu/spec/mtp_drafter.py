"""MTP drafter: DeepSeek-V3's ``nextn`` module chained for ``k`` drafts (confidence = the draft's probability).

Cache convention: the MTP entry at position ``p`` is computed from ``(hidden_p, embed(token_{p+1}))`` and predicts
``token_{p+2}``. After each main step a *catch-up* forward over the step's tokens (same positions and metadata as
the main forward, inputs ``(hidden_j, embed(target_tokens_j))``) writes the MTP cache for every position; the row's
hidden at its anchor (the token before the golden one) gives draft 1; drafts 2..k chain one token per row at the
following positions. Entries written for rejected or chained positions sit at positions the next catch-up rewrites
before anything reads them.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_npu.model_executor.attention_metadata import HostLengths
from deepinfer_npu.model_executor.device_metadata import build_device_metadata, pad_block_tables

from .drafter import DraftContext, Drafter


class MtpDrafter(Drafter):
    name = "mtp"

    def __init__(self, model, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_speculative_tokens)
        self.mtp = model.mtp
        if self.mtp is None:
            raise ValueError(
                "speculative_method='mtp' needs MTP (nextn) layers, but the checkpoint has none "
                "(config.json num_nextn_predict_layers = 0 or no weights for model.layers.{num_hidden_layers})"
            )
        cfg = model.config
        kv_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(num_blocks, block_size, kv_dim, dtype=dtype, device=device)
            for _ in range(self.mtp.num_layers)
        ]

    def _depth(self, m: int) -> int:
        # Chained drafts reuse the first MTP layer (and its cache), as DeepSeek-V3 ships one nextn layer.
        return 0

    def catch_up(self, ctx: DraftContext) -> torch.Tensor:
        """MTP forward over every token of the step; returns the MTP hidden states [T, D]."""
        return self.mtp(ctx.target_tokens, ctx.hidden, ctx.attn.positions, ctx.attn, self.kv_caches[0], depth=0)

    def propose(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        h_all = self.catch_up(ctx)
        k = self.num_speculative_tokens
        b = ctx.anchor_rows.shape[0]
        drafts = torch.zeros(b, k, dtype=torch.int64, device=h_all.device)
        conf = torch.zeros(b, k, dtype=torch.float32, device=h_all.device)
        if b == 0:
            return drafts, conf
        h = h_all.index_select(0, ctx.anchor_rows)
        row_of_anchor = torch.searchsorted(ctx.attn.cu_seqlens_q.to(torch.int64), ctx.anchor_rows, right=True) - 1
        tables = ctx.attn.block_tables.index_select(0, row_of_anchor)
        tables = pad_block_tables(tables, ctx.attn.max_seqlen_k + k + 1, self.block_size)
        ones = torch.ones(b, dtype=torch.int32, device=h.device)
        main_host = ctx.attn.host
        host_k = None
        if main_host is not None and ctx.host_rows is not None:
            host_k = np.asarray(main_host.seqlens_k, dtype=np.int64)[ctx.host_rows]
        for m in range(k):
            probs = torch.softmax(self.mtp.compute_logits(h, depth=self._depth(m)), dim=-1)
            p, tok = probs.max(dim=-1)
            drafts[:, m] = tok
            conf[:, m] = p
            if m + 1 == k:
                break
            # Chain: MTP entry at position bonus_pos + m from (h, embed(draft_{m+1})).
            pos = ctx.bonus_positions + m
            # Host bounds for kernels that take host lengths: the chain's key length is bonus_pos + m + 1, at most
            # the main step's (bound on the) context length + m + 1.
            host = None
            if host_k is not None:
                bound = tuple(int(x) + m + 1 for x in host_k)
                host = HostLengths((1,) * b, bound, False, 1, max(bound) if bound else 0,
                                   max_kv_shortfall=(main_host.max_kv_shortfall or 0) + k + 1)
            attn, _, _ = build_device_metadata(ones, (pos + 1).to(torch.int32), tables, self.block_size, b,
                                               1, ctx.attn.max_seqlen_k + k + 1, False, host)
            h = self.mtp(tok, h, attn.positions, attn, self.kv_caches[self._depth(m + 1)],
                         depth=self._depth(m + 1))
        return drafts, conf
