"""The DeepSeek decoder layer (MLA attention, then a dense or MoE MLP), shared by the main model and its MTP layers."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet

from ..attention_metadata import AttentionMetadata
from ..layers.mla import MLAAttention
from ..layers.mlp import DenseMLP
from ..layers.moe import DeepseekMoE
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding
from ..model_config import DeepseekModelConfig


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``+ mlp(norm(.))``; residual adds fused into the norms."""

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
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, **kw)
        self.self_attn = MLAAttention(cfg, rope, kernels, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, **kw)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = DeepseekMoE(cfg, kernels, **kw)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, kernels, quant=cfg.quant, **kw)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [T, D], ``residual`` [T, D] or None (first layer) -> ``(mlp_out, residual)``; the caller
        adds them (fused into the next norm)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, attn, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
