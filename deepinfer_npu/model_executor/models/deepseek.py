"""DeepSeek-V2 / V3 causal LMs over the HAL kernels (V3 adds MTP layers; see mtp.py).

Module and parameter names mirror the Hugging Face checkpoint (``model.layers.{i}.self_attn...``) so the
loader maps tensors by name; the few tensors stored differently (``kv_b_proj``, experts, dense gate/up) are
remapped by their layer's ``load_checkpoint_tensor``. MTP layers live at
``model.layers.{num_hidden_layers + i}`` as in DeepSeek's checkpoints; the main forward runs only the first
``num_hidden_layers``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepinfer_npu.hal.backend import Backend
from deepinfer_npu.hal.kernel_set import KernelSet

from ..attention_metadata import AttentionMetadata
from ..dummy_weights import init_dummy_weights
from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding
from ..model_config import DeepseekModelConfig
from .decoder_layer import DeepseekDecoderLayer
from .mtp import DeepseekMTP, DeepseekMTPLayer


class DeepseekModel(nn.Module):
    """Embedding, decoder layers (main layers then MTP layers) and the final norm."""

    def __init__(
        self, cfg: DeepseekModelConfig, kernels: KernelSet, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.rope = RotaryEmbedding.from_config(cfg, device)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, **kw)
        layers: list[nn.Module] = [
            DeepseekDecoderLayer(cfg, i, self.rope, kernels, **kw) for i in range(cfg.num_hidden_layers)
        ]
        layers += [
            DeepseekMTPLayer(cfg, cfg.num_hidden_layers + i, self.rope, kernels, **kw)
            for i in range(cfg.num_nextn_predict_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, **kw)


class DeepseekForCausalLM(nn.Module):
    """Shared implementation; ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` name the families."""

    def __init__(
        self,
        cfg: DeepseekModelConfig,
        backend: Backend,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.dtype = dtype
        device = backend.device
        self.model = DeepseekModel(cfg, backend.kernels, dtype=dtype, device=device)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, backend.kernels, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        capture_layer_ids: tuple[int, ...] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``input_ids`` [T], ``positions`` [T] -> final-normed hidden states [T, D].

        ``kv_caches[i]`` [num_blocks, block_size, L+R] belongs to main layer i; this step's latents are
        written there. With ``capture_layer_ids`` it returns ``(hidden, captured)`` where ``captured[i]`` is the
        residual stream after decoder layer ``i`` (transformers' ``hidden_states[i + 1]`` before any final norm),
        which the DFlash drafter consumes.
        """
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i in range(self.config.num_hidden_layers):
            hidden, residual = self.model.layers[i](positions, hidden, residual, attn, kv_caches[i])
            if capture_layer_ids and i in capture_layer_ids:
                captured[i] = hidden + residual
        hidden, _ = self.model.norm(hidden, residual)
        if capture_layer_ids is not None:
            return hidden, captured
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [N, D] (rows of ``forward``'s output) -> logits [N, V] fp32."""
        return self.lm_head(hidden)

    @property
    def num_kv_cache_layers(self) -> int:
        """Length of the ``kv_caches`` list ``forward`` takes (MTP layers get caches of their own)."""
        return self.config.num_hidden_layers

    def init_dummy_weights(self, seed: int = 0, portable: bool = False) -> None:
        """Seeded random weights (same as ``load_weights(model, load_format="dummy" | "dummy_portable")``)."""
        init_dummy_weights(self, seed, portable=portable)

    # ---- MTP -----------------------------------------------------------------------------------------------
    @property
    def mtp(self):
        """A :class:`~.mtp.DeepseekMTP` view of this model's MTP layers, or None when there are none."""
        n = self.config.num_hidden_layers
        mtp_layers = list(self.model.layers[n:])
        return DeepseekMTP(mtp_layers) if mtp_layers else None

    def drop_mtp_layers(self) -> None:
        """Remove the MTP layers (checkpoints saved by transformers declare them but carry no weights)."""
        n = self.config.num_hidden_layers
        self.model.layers = nn.ModuleList(list(self.model.layers[:n]))
        self.config.num_nextn_predict_layers = 0

    # ---- checkpoint hooks used by the loader ---------------------------------------------------------------
    def optional_checkpoint_tensors(self) -> set[str]:
        """Tensors a checkpoint may omit: each MTP layer's embedding and head default to the main model's."""
        n = self.config.num_hidden_layers
        names = set()
        for i in range(self.config.num_nextn_predict_layers):
            names |= {
                f"model.layers.{n + i}.embed_tokens.weight",
                f"model.layers.{n + i}.shared_head.head.weight",
            }
        return names

    def tie_missing(self, name: str) -> None:
        """Share the main model's tensor for an omitted optional one (see ``optional_checkpoint_tensors``)."""
        m = re.fullmatch(r"model\.layers\.(\d+)\.(embed_tokens|shared_head\.head)\.weight", name)
        if m is None:
            raise KeyError(name)
        layer = self.model.layers[int(m.group(1))]
        if m.group(2) == "embed_tokens":
            layer.embed_tokens.weight = self.model.embed_tokens.weight
        else:
            layer.shared_head.head.weight = self.lm_head.weight


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5 (softmax gating, greedy or group-limited greedy)."""


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V3 / R1 / V3.1 and V3-architecture models (sigmoid noaux_tc gating, MTP layers)."""
