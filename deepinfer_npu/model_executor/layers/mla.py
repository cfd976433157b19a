"""Multi-head latent attention layer: ``mla_prolog`` -> ``mla_attention`` -> ``mla_epilogue``.

Parameter names follow the checkpoint (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``o_proj``). ``kv_b_proj`` [H*(N+V), L] is not kept: the loader
splits it into ``w_uk`` [H, N, L] and ``w_uv`` [H, V, L], the absorbed form every backend's ops consume.
Quantised (``cfg.quant``), the projections are FP8 or INT8 (``QuantLinear``) and run through ``mla_prolog_quant``
/ ``mla_epilogue_quant``; ``w_uk`` / ``w_uv`` stay in the model dtype (``kv_b_proj`` is dequantised at load).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet
from deepinfer_npu.hal.types import MLAWeights

from ..attention_metadata import AttentionMetadata
from ..model_config import DeepseekModelConfig
from .linear import QuantLinear, empty_param, make_linear
from .norm import RMSNorm
from .rope import RotaryEmbedding

# q_a_layernorm and kv_a_layernorm are built with RMSNorm's default eps in DeepSeek's and HF's code.
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    remapped_params = ("w_uk", "w_uv")

    def __init__(
        self,
        cfg: DeepseekModelConfig,
        rope: RotaryEmbedding,
        kernels: KernelSet,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.rope = rope
        self.num_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.softmax_scale = cfg.softmax_scale
        h, d, bias = cfg.num_attention_heads, cfg.hidden_size, cfg.attention_bias
        kw = dict(dtype=dtype, device=device)
        self.quant = cfg.quant
        lin = dict(kw, quant=cfg.quant)
        if cfg.q_lora_rank is None:
            self.q_proj = make_linear(d, h * cfg.qk_head_dim, kernels, **lin)
        else:
            self.q_a_proj = make_linear(d, cfg.q_lora_rank, kernels, bias=bias, **lin)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, kernels, **kw)
            self.q_b_proj = make_linear(cfg.q_lora_rank, h * cfg.qk_head_dim, kernels, **lin)
        self.kv_a_proj_with_mqa = make_linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, kernels, bias=bias, **lin)
        # The query's first projection and kv_a read the same input: their weights become row slices of one tensor
        # (MLAWeights.fused_a_proj), so a backend can run both as one GEMM (one launch at batch-1 decode). The
        # loader copies into the slices. A plain attribute: not a parameter, not in the checkpoint layout.
        # FP8 (block-scaled) projections share the same way, their scales too, where the first projection's rows
        # are whole 128-row blocks: the fused weight's block rows are then the two weights' block rows in turn.
        self.fused_a_proj: torch.Tensor | None = None
        self.fused_a_proj_scale: torch.Tensor | None = None
        first = self.q_proj if cfg.q_lora_rank is None else self.q_a_proj
        kv_a = self.kv_a_proj_with_mqa
        rows = first.weight.shape[0]
        if not bias and self.quant is None:
            (self.fused_a_proj,) = _share_rows(first, kv_a, "weight")
        elif not bias and self.quant.method == "fp8" and rows % self.quant.scheme.part_alignment == 0:
            self.fused_a_proj, self.fused_a_proj_scale = _share_rows(first, kv_a, "weight", first.scale_name)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, kernels, **kw)
        self.w_uk = empty_param(h, cfg.qk_nope_head_dim, cfg.kv_lora_rank, **kw)
        self.w_uv = empty_param(h, cfg.v_head_dim, cfg.kv_lora_rank, **kw)
        self.o_proj = make_linear(h * cfg.v_head_dim, d, kernels, bias=bias, **lin)

    def weights(self) -> MLAWeights:
        """The op-facing view of this layer's tensors (no copies)."""
        has_q_lora = hasattr(self, "q_a_proj")
        return MLAWeights(
            num_heads=self.num_heads,
            qk_nope_head_dim=self.nope_dim,
            qk_rope_head_dim=self.rope_dim,
            v_head_dim=self.v_head_dim,
            kv_lora_rank=self.kv_lora_rank,
            kv_a_proj=self.kv_a_proj_with_mqa.weight,
            kv_a_layernorm=self.kv_a_layernorm.weight,
            w_uk=self.w_uk,
            w_uv=self.w_uv,
            o_proj=self.o_proj.weight,
            q_proj=None if has_q_lora else self.q_proj.weight,
            q_a_proj=self.q_a_proj.weight if has_q_lora else None,
            q_a_layernorm=self.q_a_layernorm.weight if has_q_lora else None,
            q_b_proj=self.q_b_proj.weight if has_q_lora else None,
            q_a_bias=self.q_a_proj.bias if has_q_lora else None,
            kv_a_bias=self.kv_a_proj_with_mqa.bias,
            o_bias=self.o_proj.bias,
            norm_eps=LATENT_NORM_EPS,
            fused_a_proj=self._shared_fused_a_proj(),
        )

    def quant_scales(self) -> dict[str, torch.Tensor]:
        """Scales of the quantised projections, keyed by their ``MLAWeights`` field (``mla_prolog_quant``)."""
        mods = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_b_proj": "q_b_proj",
                "kv_a_proj": "kv_a_proj_with_mqa", "o_proj": "o_proj"}
        scales = {field: getattr(self, attr).scales for field, attr in mods.items()
                  if isinstance(getattr(self, attr, None), QuantLinear)}
        if self.fused_a_proj_scale is not None and self._shared_fused_a_proj() is not None:
            scales["fused_a_proj"] = self.fused_a_proj_scale
        return scales

    def _shared_fused_a_proj(self) -> torch.Tensor | None:
        """``fused_a_proj`` while the two weights (and FP8 scales) are still its row slices (else None: e.g. a
        weight replaced)."""
        fused = self.fused_a_proj
        if fused is None:
            return None
        first_mod = self.q_a_proj if hasattr(self, "q_a_proj") else self.q_proj
        if not _are_row_slices(fused, first_mod.weight, self.kv_a_proj_with_mqa.weight):
            return None
        if self.fused_a_proj_scale is not None and not _are_row_slices(
                self.fused_a_proj_scale, first_mod.scales, self.kv_a_proj_with_mqa.scales):
            return None
        return fused

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` [T, D] (input-normed) -> [T, D]; writes this step's latents into ``kv_cache``."""
        w = self.weights()
        k = self.kernels
        scales = self.quant_scales() if self.quant is not None else None
        if scales is None:
            return k.mla_forward(hidden, w, positions, self.rope, kv_cache, attn, self.softmax_scale)
        q_latent, q_rope = k.mla_prolog_quant(hidden, w, scales, positions, self.rope, kv_cache, attn.slot_mapping)
        out_latent = k.mla_attention(
            q_latent,
            q_rope,
            kv_cache,
            attn.block_tables,
            attn.seqlens_q,
            attn.seqlens_k,
            attn.cu_seqlens_q,
            self.softmax_scale,
            host=attn.host,
            max_seqlen_q=attn.max_seqlen_q,  # k + 1 after a device re-split (host None): keeps the decode kernel
            is_prefill=attn.is_prefill,
        )
        return k.mla_epilogue_quant(out_latent, w, scales)

    # ---- checkpoint mapping (see loader.py) ----------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        rows = self.num_heads * (self.nope_dim + self.v_head_dim)
        return {"kv_b_proj.weight": (rows, self.kv_lora_rank)}

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if self.quant is not None:
            # FP8 in DeepSeek-V3's release, absorbed in the model dtype: quantising at load rounds it the same way
            # (a no-op on an FP8 checkpoint's dequantised tensor), as vLLM's online quantisation does.
            tensor = self.quant.scheme.dequantize(*self.quant.scheme.quantize(tensor))
        # kv_b_proj rows are per head [k_nope (N) | v (V)], each row a vector over the latent L.
        per_head = tensor.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_uk.data.copy_(per_head[:, : self.nope_dim])
        self.w_uv.data.copy_(per_head[:, self.nope_dim :])


def _are_row_slices(fused: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether ``first`` then ``second`` are the rows of ``fused``, in place (same storage, consecutive)."""
    rows_ok = first.shape[0] + second.shape[0] == fused.shape[0] and first.shape[1:] == second.shape[1:] == \
        fused.shape[1:]
    return (rows_ok and first.dtype == second.dtype == fused.dtype and first.data_ptr() == fused.data_ptr()
            and second.data_ptr() == fused.data_ptr() + first.numel() * first.element_size())


def _share_rows(first: nn.Module, second: nn.Module, *names: str) -> list[torch.Tensor]:
    """Re-register each parameter ``name`` of ``first`` and ``second`` as row slices of one new tensor (first's
    rows, then second's; attributes such as the quantisation scheme kept) -> the new tensors, in ``names`` order."""
    out = []
    for name in names:
        a, b = getattr(first, name), getattr(second, name)
        fused = torch.empty(a.shape[0] + b.shape[0], *a.shape[1:], dtype=a.dtype, device=a.device)
        for mod, old, part in ((first, a, fused[: a.shape[0]]), (second, b, fused[a.shape[0]:])):
            param = nn.Parameter(part, requires_grad=False)
            param.__dict__.update(old.__dict__)  # e.g. quant_scheme (dummy weights find the scheme through it)
            setattr(mod, name, param)
        out.append(fused)
    return out
