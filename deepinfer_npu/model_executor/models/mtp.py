"""DeepSeek-V3 multi-token prediction (MTP / "nextn") layers and the drafter-facing wrapper.

Each MTP layer ``model.layers.{num_hidden_layers + i}`` is a decoder layer plus ``enorm``, ``hnorm``,
``eh_proj`` and a ``shared_head`` (``norm`` + ``head``), and optionally its own ``embed_tokens``. It predicts
token t+2 from token t+1's embedding and the main model's final hidden state at t (as vLLM's DeepSeek MTP
does; the previous hidden is the main model's normed output).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet

from ..attention_metadata import AttentionMetadata
from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding
from ..model_config import DeepseekModelConfig
from .decoder_layer import DeepseekDecoderLayer


class SharedHead(nn.Module):
    def __init__(self, cfg: DeepseekModelConfig, kernels: KernelSet, *, dtype, device) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, dtype=dtype, device=device)
        self.head = LMHead(cfg.hidden_size, cfg.vocab_size, kernels, dtype=dtype, device=device)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """One MTP depth: ``eh_proj([enorm(embed(ids)) ‖ hnorm(prev_hidden)])`` through a decoder layer."""

    def __init__(
        self,
        cfg: DeepseekModelConfig,
        layer_idx: int,
        rope: RotaryEmbedding,
        kernels: KernelSet,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(cfg, layer_idx, rope, kernels, dtype=dtype, device=device)
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, **kw)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, **kw)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, kernels, **kw)
        self.shared_head = SharedHead(cfg, kernels, **kw)

    def predict(
        self,
        input_ids: torch.Tensor,
        previous_hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``input_ids`` [T] (tokens t+1), ``previous_hidden`` [T, D] (hidden at t) -> hidden [T, D] before
        ``shared_head.norm`` (feed it back as ``previous_hidden`` to chain drafts)."""
        embeds = self.enorm(self.embed_tokens(input_ids))
        hidden = self.eh_proj(torch.cat((embeds, self.hnorm(previous_hidden)), dim=-1))
        hidden, residual = super().forward(positions, hidden, None, attn, kv_cache)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [N, D] from :meth:`predict` -> logits [N, V] fp32."""
        return self.shared_head.head(self.shared_head.norm(hidden))


class DeepseekMTP:
    """Drafter-facing view of a model's MTP layers (the parameters belong to the model)."""

    def __init__(self, layers: list[DeepseekMTPLayer]) -> None:
        self.layers = layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        previous_hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        depth: int = 0,
    ) -> torch.Tensor:
        """Run MTP layer ``depth`` (see :meth:`DeepseekMTPLayer.predict`) with that layer's ``kv_cache``."""
        return self.layers[depth].predict(input_ids, previous_hidden, positions, attn, kv_cache)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Logits [N, V] fp32 of MTP layer ``depth`` for ``hidden`` returned by :meth:`forward`."""
        return self.layers[depth].compute_logits(hidden)
