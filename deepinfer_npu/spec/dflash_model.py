"""The DFlash drafter's layers in plain torch (autograd-friendly, so ``examples/train_dflash.py`` trains the very
code the engine runs): the context projection, pre-norm layers whose attention sees the ring context plus the
block, the Markov correction and the confidence head. The algorithm: ``dflash.py``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .dflash_config import DFlashConfig


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


RmsNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float, fn: list[RmsNormFn]):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._fn = fn  # shared one-element list so the drafter can swap in backend.kernels.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn[0](x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (int) -> cos, sin [..., head_dim/2] fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    f = positions.to(torch.float32).unsqueeze(-1) * inv
    return f.cos(), f.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., H, hd] at positions [...] -> rotated (halves layout), fp32 math, x's dtype."""
    hd = x.shape[-1]
    cos, sin = rope_cos_sin(positions, hd, theta)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    xf = x.float()
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        d, h, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.h, self.hd, self.theta = h, hd, cfg.rope_theta
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, h * hd, bias=False)
        self.v_proj = nn.Linear(d, h * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D], positions [...] -> K (roped), V [..., H, hd]."""
        k = self.k_proj(x).unflatten(-1, (self.h, self.hd))
        v = self.v_proj(x).unflatten(-1, (self.h, self.hd))
        return apply_rope(k, positions, self.theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_valid: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, k, D] (normed block input) at positions [B, k]; ctx_k/ctx_v [B, C, H, hd]; ctx_valid [B, C] bool.

        Every block query sees every valid context key and every block key (non-causal inside the block)."""
        b, k, _ = x.shape
        q = apply_rope(self.q_proj(x).unflatten(-1, (self.h, self.hd)), positions, self.theta)
        kb, vb = self.kv(x, positions)
        # Scores against the context and against the block separately (no concatenation of the [B, C, H, hd]
        # ring), masked softmax over both in fp32. Masked entries get probability exactly 0, so a stale ring cell
        # contributes exactly nothing (ring cells are always finite: zeroed at allocation / zero_slots, then only
        # ever written with K/V of captured hidden states).
        scale = self.hd**-0.5
        kb = kb.to(q.dtype)
        s_ctx = torch.einsum("bkhd,bchd->bhkc", q, ctx_k.to(q.dtype)).float() * scale
        s_blk = torch.einsum("bkhd,bjhd->bhkj", q, kb).float() * scale
        s_ctx = s_ctx.masked_fill(~ctx_valid[:, None, None, :], float("-inf"))
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(vb.dtype)
        c = ctx_k.shape[1]
        o = torch.einsum("bhkc,bchd->bkhd", p[..., :c], ctx_v.to(vb.dtype))
        o = o + torch.einsum("bhkj,bjhd->bkhd", p[..., c:], vb)
        return self.o_proj(o.reshape(b, k, self.h * self.hd))


class DFlashMLP(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, norm_fn: list[RmsNormFn]):
        super().__init__()
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps, norm_fn)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps, norm_fn)
        self.mlp = DFlashMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, ctx_k, ctx_v, ctx_valid):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, ctx_valid)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    """The drafter's own parameters (the state-dict names of ``dflash.safetensors``) and its math.

    The target's embedding ``embed_weight`` [V, D] and head ``lm_head_weight`` [V, D] are passed in and kept out
    of the state dict (frozen, shared)."""

    def __init__(self, cfg: DFlashConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        d, n, r, v = cfg.hidden_size, len(cfg.target_layer_ids), cfg.markov_rank, cfg.vocab_size
        if tuple(embed_weight.shape) != (v, d) or tuple(lm_head_weight.shape) != (v, d):
            raise ValueError(
                f"target embedding {tuple(embed_weight.shape)} / lm_head {tuple(lm_head_weight.shape)} do not match "
                f"the dflash config (vocab_size {v}, hidden_size {d})"
            )
        self._norm_fn: list[RmsNormFn] = [_rms_norm_ref]
        self.fc = nn.Linear(n * d, d, bias=False)
        self.fc_norm = _Norm(d, cfg.rms_norm_eps, self._norm_fn)
        self.layers = nn.ModuleList([DFlashLayer(cfg, self._norm_fn) for _ in range(cfg.num_layers)])
        self.norm = _Norm(d, cfg.rms_norm_eps, self._norm_fn)
        self.markov_w1 = nn.Parameter(torch.zeros(v, r))
        self.markov_w2 = nn.Parameter(torch.zeros(v, r))
        self.confidence = nn.Linear(d + r, 1, bias=True)
        # Frozen target tensors (not parameters: excluded from state_dict / optimiser).
        # (detached: assigning an nn.Parameter would register it)
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()

    def set_rms_norm(self, fn: RmsNormFn) -> None:
        self._norm_fn[0] = fn

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name == "markov_w2" or name.startswith("confidence"):
                    p.zero_()
                else:
                    s = out_std if ("o_proj" in name or "down_proj" in name) else std
                    p.copy_(torch.randn(p.shape, generator=g) * s)

    # ---- pieces shared by inference and training -----------------------------------------------------------
    def context(self, hiddens: list[torch.Tensor]) -> torch.Tensor:
        """Captured hiddens (one per target layer id, in config order) [..., D] -> c [..., D]."""
        x = torch.cat([h.to(self.fc.weight.dtype) for h in hiddens], dim=-1)
        return self.fc_norm(self.fc(x))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """c [..., D] at positions [...] -> [..., L, 2, H, hd] (K roped, V) for every draft layer."""
        per_layer = [torch.stack(layer.self_attn.kv(c, positions), dim=-3) for layer in self.layers]
        return torch.stack(per_layer, dim=-4)

    def block_hidden(
        self,
        block_tokens: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: torch.Tensor,
        ctx_valid: torch.Tensor,
    ) -> torch.Tensor:
        """block_tokens/positions [B, k]; ctx_kv [B, C, L, 2, H, hd]; ctx_valid [B, C] -> final-normed h [B, k, D]."""
        x = F.embedding(block_tokens, self.embed_weight).to(self.fc.weight.dtype)
        for li, layer in enumerate(self.layers):
            x = layer(x, block_positions, ctx_kv[:, :, li, 0], ctx_kv[:, :, li, 1], ctx_valid)
        return self.norm(x)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> target-head logits [..., V] fp32."""
        return F.linear(h, self.lm_head_weight.to(h.dtype)).float()

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        return F.embedding(prev, self.markov_w1)

    def markov_correction(self, e: torch.Tensor) -> torch.Tensor:
        """e [..., r] (markov_w1 rows) -> [..., V] fp32."""
        return F.linear(e.float(), self.markov_w2.float())

    def confidence_logit(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h [..., D], e [..., r] -> acceptance logit [...] fp32."""
        feat = torch.cat([h.float(), e.float()], dim=-1)
        return F.linear(feat, self.confidence.weight.float(), self.confidence.bias.float()).squeeze(-1)

    @staticmethod
    def block_inputs(golden: torch.Tensor, golden_positions: torch.Tensor, k: int, noise_id: int):
        """golden [B], positions [B] -> tokens [B, k] = [golden, noise...], positions [B, k] = P..P+k-1."""
        b = golden.shape[0]
        offs = torch.arange(k, device=golden.device)
        tokens = torch.full((b, k), noise_id, dtype=torch.int64, device=golden.device)
        tokens[:, 0] = golden.to(torch.int64)
        return tokens, golden_positions.to(torch.int64).unsqueeze(1) + offs
