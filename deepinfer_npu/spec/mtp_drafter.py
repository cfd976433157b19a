"""MTP drafter: DeepSeek-V3's ``nextn`` module chained for ``k`` drafts (confidence = the draft's probability).

Cache convention: the MTP entry at position ``p`` is computed from ``(hidden_p, embed(token_{p+1}))`` and predicts
``token_{p+2}``. After each main step a *catch-up* forward over the step's tokens (same positions and metadata as
the main forward, inputs ``(hidden_j, embed(target_tokens_j))``) writes the MTP cache for every position; the row's
hidden at its anchor (the token before the golden one) gives draft 1; drafts 2..k chain one token per row at the
following positions. Entries written for rejected or chained positions sit at positions the next catch-up rewrites
before anything reads them.

Graphs: the catch-up runs on the main step's metadata (any token count) and stays eager; the chain (k logits and
k - 1 one-token MTP forwards per row) is row-independent and sync-free, so with a graph runner that needs no host
lengths (CUDA) it is replayed per padded row count (``ProposeGraphs``) on block tables padded to a fixed width
(``chain_graph_width``). Padding rows (zero hidden state, block-0 tables) write only the padding block, at
position k - 1 on: a real row whose chain runs past its allocated blocks writes block 0 too, at slots 0 .. k - 2
(its positions start a fresh block), so the padding rows' slots k - 1 .. 2k - 3 stay clear of them while
2k - 2 <= block_size. (Two real rows past their blocks in one step still share those slots, as in the eager
chain: their later drafts can lose acceptance, never correctness.)
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_npu.model_executor.attention_metadata import HostLengths
from deepinfer_npu.model_executor.device_metadata import build_device_metadata, pad_block_tables

from .drafter import DraftContext, Drafter


def chain_graph_width(max_model_len: int, k: int, block_size: int) -> int:
    """Block-table width of the chain graphs: keys up to max_model_len + 2k (a device re-split's optimistic
    lengths) + k + 1 (the chain's own positions), as ``pad_block_tables`` would widen the eager chain's tables;
    and at least the decode graphs' width (``DecodeGraphs``: ceil((max_model_len + 2k) / block_size) + 1), whose
    tables a graph-replayed step hands the drafter (a wider table falls back to the eager chain)."""
    decode_graph_width = -(-(max_model_len + 2 * k) // block_size) + 1
    return max((max_model_len + 3 * k + 1) // block_size + 1, decode_graph_width)


class MtpDrafter(Drafter):
    name = "mtp"

    def __init__(self, model, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, max_model_len: int | None = None,
                 cache_layout: tuple[int, torch.dtype] | None = None) -> None:
        super().__init__(num_speculative_tokens)
        self.max_model_len = max_model_len  # None: no chain graphs (their table width is unknown)
        self.dtype, self.device = dtype, device
        self.propose_graphs = None  # ProposeGraphs of the chain once enable_graphs accepted a runner
        self.mtp = model.mtp
        if self.mtp is None:
            raise ValueError(
                "speculative_method='mtp' needs MTP (nextn) layers, but the checkpoint has none "
                "(config.json num_nextn_predict_layers = 0 or no weights for model.layers.{num_hidden_layers})"
            )
        cfg = model.config
        self.hidden_size = cfg.hidden_size
        # the main caches' row layout (model dtype, or packed FP8 rows): (row width, element dtype)
        kv_dim, cache_dtype = cache_layout or (cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype)
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(num_blocks, block_size, kv_dim, dtype=cache_dtype, device=device)
            for _ in range(self.mtp.num_layers)
        ]

    def _depth(self, m: int) -> int:
        # Chained drafts reuse the first MTP layer (and its cache), as DeepSeek-V3 ships one nextn layer.
        return 0

    def catch_up(self, ctx: DraftContext) -> torch.Tensor:
        """MTP forward over every token of the step; returns the MTP hidden states [T, D]."""
        return self.mtp(ctx.target_tokens, ctx.hidden, ctx.attn.positions, ctx.attn, self.kv_caches[0], depth=0)

    def enable_graphs(self, runner, max_rows: int) -> bool:
        """Replay the draft chain from graphs (module docstring) when the runner bakes no host lengths into its
        kernels (the chain's graphs have none to give) and the table width is known."""
        from deepinfer_npu.hal.graph_runner import GraphRunner

        from .propose_graphs import ProposeGraphs

        if self.max_model_len is None or type(runner).set_step_host_lengths is not GraphRunner.set_step_host_lengths:
            return False
        if any(getattr(m, "ep", None) is not None for layer in self.mtp.layers for m in layer.modules()):
            # an expert-parallel MoE in the chain: its graphs would be captured per this rank's own row count, which
            # the other ranks do not share; the chain stays eager inside the step's declared size
            return False
        width = chain_graph_width(self.max_model_len, self.num_speculative_tokens, self.block_size)
        k = self.num_speculative_tokens
        inputs = {"hidden": ((self.hidden_size,), self.dtype), "positions": ((), torch.int64, k - 1),
                  "tables": ((width,), torch.int32)}
        self.propose_graphs = ProposeGraphs(self._graph_chain, runner, max_rows, self.device, inputs=inputs)
        return True

    def _graph_chain(self, hidden: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor):
        """The chain on static buffers (captured): tables already at the graph width, no host lengths."""
        max_k = tables.shape[1] * self.block_size
        return self._chain(hidden, positions, tables, max_k, None, None)

    def propose(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        h_all = self.catch_up(ctx)
        k = self.num_speculative_tokens
        b = ctx.anchor_rows.shape[0]
        if b == 0:
            return (torch.zeros(0, k, dtype=torch.int64, device=h_all.device),
                    torch.zeros(0, k, dtype=torch.float32, device=h_all.device))
        h = h_all.index_select(0, ctx.anchor_rows)
        row_of_anchor = torch.searchsorted(ctx.attn.cu_seqlens_q.to(torch.int64), ctx.anchor_rows, right=True) - 1
        tables = ctx.attn.block_tables.index_select(0, row_of_anchor)
        if self.propose_graphs is not None:
            out = self.propose_graphs.run(h, ctx.bonus_positions, tables.to(torch.int32))
            if out is not None:
                return out
        tables = pad_block_tables(tables, ctx.attn.max_seqlen_k + k + 1, self.block_size)
        main_host = ctx.attn.host
        host_k = None
        if main_host is not None and ctx.host_rows is not None:
            host_k = np.asarray(main_host.seqlens_k, dtype=np.int64)[ctx.host_rows]
        return self._chain(h, ctx.bonus_positions, tables, ctx.attn.max_seqlen_k + k + 1, host_k,
                           main_host.max_kv_shortfall if main_host is not None else None)

    def _chain(self, h: torch.Tensor, bonus_positions: torch.Tensor, tables: torch.Tensor, max_k: int,
               host_k: np.ndarray | None, shortfall: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts 1..k from the anchors' MTP hidden states ``h`` [B, D]; ``tables`` [B, W] wide enough for the
        chain's positions; ``host_k``: the main step's host key lengths of these rows (host bounds), or None."""
        k = self.num_speculative_tokens
        b = h.shape[0]
        drafts = torch.zeros(b, k, dtype=torch.int64, device=h.device)
        conf = torch.zeros(b, k, dtype=torch.float32, device=h.device)
        ones = torch.ones(b, dtype=torch.int32, device=h.device)
        for m in range(k):
            probs = torch.softmax(self.mtp.compute_logits(h, depth=self._depth(m)), dim=-1)
            p, tok = probs.max(dim=-1)
            drafts[:, m] = tok
            conf[:, m] = p
            if m + 1 == k:
                break
            # Chain: MTP entry at position bonus_pos + m from (h, embed(draft_{m+1})).
            pos = bonus_positions + m
            # Host bounds for kernels that take host lengths: the chain's key length is bonus_pos + m + 1, at most
            # the main step's (bound on the) context length + m + 1.
            host = None
            if host_k is not None:
                bound = tuple(int(x) + m + 1 for x in host_k)
                host = HostLengths((1,) * b, bound, False, 1, max(bound) if bound else 0,
                                   max_kv_shortfall=(shortfall or 0) + k + 1)
            attn, _, _ = build_device_metadata(ones, (pos + 1).to(torch.int32), tables, self.block_size, b,
                                               1, max_k, False, host)
            h = self.mtp(tok, h, attn.positions, attn, self.kv_caches[self._depth(m + 1)],
                         depth=self._depth(m + 1))
        return drafts, conf
