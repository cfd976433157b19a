"""DFlash parallel drafter: one non-causal forward over ``[golden, noise x (k-1)]`` gives k drafts.

Design (seed §7.1, DESIGN.md §6). The target's main forward captures the residual stream after the decoder layers
``target_layer_ids``; for every token it processes (prefill and decode, accepted or not) the drafter concatenates
those hidden states, projects and normalises them (``fc`` then ``fc_norm``) into a context vector ``c_t`` and writes
each draft layer's key (with RoPE at the token's position) and value of ``c_t`` into a sliding-window **ring** held
in the sequence's state slot, at ring index ``position % ring_size``. To draft after a verify step whose bonus
("golden") token sits at position ``P``, the drafter embeds ``[golden, noise, ..., noise]`` (k tokens at positions
``P .. P+k-1``; ``noise_token_id`` fills the block) with the target's (frozen) embedding and runs ``num_layers``
pre-norm transformer layers whose attention sees the ring context positions ``max(0, P-W) .. P-1`` plus the block's
own keys (bidirectional inside the block). Block position ``j`` predicts the token at ``P+j+1``:

    logits_j = lm_head(norm(h_j)) + markov_w2 @ markov_w1[prev_j]          (prev_0 = golden, prev_j = draft_j)
    draft_{j+1} = argmax(logits_j)                                          (sequential over j: the Markov input)
    confidence_j = sigmoid(confidence([norm(h_j) ; markov_w1[prev_j]]))     (P(draft accepted | previous accepted))

``lm_head`` and the embedding are the target's own tensors (shared, never stored here).

Why no masking by acceptance is needed: a verify step writes keys for positions ``P0 .. P0+d`` before the result
is known; with ``a`` drafts accepted the next golden sits at ``P = P0+a+1`` and the rejected positions
``P .. P0+d <= P+k-1`` are overwritten by later steps before being read as such. A read at ``P`` interprets ring
index ``i`` as the position ``p_i = P-1 - ((P-1-i) mod R)`` (the newest position ``< P`` with that index) and
masks it unless ``P-W <= p_i``; a stale write of a rejected position ``p' >= P`` lands on index ``p' mod R`` whose
interpreted position ``p' - mR`` lies outside ``[P-W, P-1]`` whenever ``R >= W + k`` (``p' - p <= W+k-1``). The
config enforces ``ring_size = window + max_backtrack`` with ``max_backtrack >= k + 1`` (the seed's rule).

Module format (a directory, shipped beside the target model, e.g. ``assets/reference/dflash/``):

* ``dflash_config.json`` (:class:`DFlashConfig`): ``format`` ("deepinfer-dflash-v1"), ``target_layer_ids``
  (main decoder layers whose output residual stream is captured), ``hidden_size`` (= the target's),
  ``vocab_size`` (= the target's), ``num_layers``, ``num_heads``, ``head_dim``, ``intermediate_size``,
  ``window`` W, ``num_speculative_tokens`` k, ``noise_token_id``, ``markov_rank`` r, ``max_backtrack`` (>= k+1),
  ``ring_size`` (= window + max_backtrack), ``rope_theta`` (the target's), ``rms_norm_eps``; optional
  provenance fields (``target``, ``training``) are ignored by the loader.
* ``dflash.safetensors`` (bf16; loaded into the target's dtype):

  ========================================================  ==========================  ===========================
  name                                                      shape                       role
  ========================================================  ==========================  ===========================
  ``fc.weight``                                             [D, len(ids)*D]             concat of captured hiddens
  ``fc_norm.weight``                                        [D]                         RMSNorm after ``fc``
  ``layers.{l}.input_layernorm.weight``                     [D]                         pre-attention norm (block)
  ``layers.{l}.self_attn.{q,k,v}_proj.weight``              [H*hd, D]                   (context uses k/v of c_t)
  ``layers.{l}.self_attn.o_proj.weight``                    [D, H*hd]
  ``layers.{l}.post_attention_layernorm.weight``            [D]
  ``layers.{l}.mlp.{gate,up}_proj.weight``                  [I, D]                      SwiGLU
  ``layers.{l}.mlp.down_proj.weight``                       [D, I]
  ``norm.weight``                                           [D]                         final norm
  ``markov_w1``                                             [V, r]                      previous-token embedding
  ``markov_w2``                                             [V, r]                      back to the vocabulary
  ``confidence.weight`` / ``confidence.bias``               [1, D+r] / [1]              acceptance logit
  ========================================================  ==========================  ===========================

  RoPE is the non-interleaved ("halves") rotation over the full ``head_dim`` with ``rope_theta``; attention scale
  ``head_dim ** -0.5``; RMSNorm with fp32 statistics (as the target's). Context keys/values are ``k_proj(c_t)`` /
  ``v_proj(c_t)`` (``c_t`` is already normalised by ``fc_norm``; no ``input_layernorm``).

* Per-slot state: ``ring`` [num_state_slots, ring_size, num_layers, 2 (K, V), num_heads, head_dim] in the target's
  dtype; zeroed with :meth:`DFlashDrafter.zero_slots` for new sequences, copied with :meth:`clone_slots` on forks.

Training: ``examples/train_dflash.py`` (labels are the target's greedy continuation; see its docstring).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .drafter import Drafter

FORMAT = "deepinfer-dflash-v1"
CONFIG_NAME = "dflash_config.json"
WEIGHTS_NAME = "dflash.safetensors"


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class DFlashConfig:
    target_layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 48
    intermediate_size: int = 512
    window: int = 64
    num_speculative_tokens: int = 5
    noise_token_id: int = 2
    markov_rank: int = 32
    max_backtrack: int = 6
    ring_size: int = 70
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    format: str = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)  # provenance (target, training); not used by the loader

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"dflash config field {name!r} {why} (got {getattr(self, name)!r})")

        if self.format != FORMAT:
            raise bad("format", f"must be {FORMAT!r}")
        if not self.target_layer_ids or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise bad("target_layer_ids", "must be a non-empty list of distinct layer indices")
        if any(i < 0 for i in self.target_layer_ids):
            raise bad("target_layer_ids", "must be >= 0")
        for name in (
            "hidden_size",
            "vocab_size",
            "num_layers",
            "num_heads",
            "head_dim",
            "intermediate_size",
            "window",
            "num_speculative_tokens",
            "markov_rank",
        ):
            if int(getattr(self, name)) < 1:
                raise bad(name, "must be >= 1")
        if self.head_dim % 2:
            raise bad("head_dim", "must be even (RoPE pairs)")
        k = self.num_speculative_tokens
        if self.max_backtrack < k + 1:
            raise bad("max_backtrack", f"must be >= num_speculative_tokens + 1 = {k + 1}")
        if self.ring_size != self.window + self.max_backtrack:
            raise bad("ring_size", f"must equal window + max_backtrack = {self.window + self.max_backtrack}")
        if not 0 <= self.noise_token_id < self.vocab_size:
            raise bad("noise_token_id", f"must be a token id < vocab_size {self.vocab_size}")

    @classmethod
    def make(cls, **kw) -> DFlashConfig:
        """Fill ``max_backtrack`` (k+1) and ``ring_size`` (window + max_backtrack) when not given."""
        k = kw.get("num_speculative_tokens", cls.num_speculative_tokens)
        kw.setdefault("max_backtrack", k + 1)
        kw.setdefault("ring_size", kw.get("window", cls.window) + kw["max_backtrack"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        missing = [n for n in ("target_layer_ids", "hidden_size", "vocab_size") if n not in known]
        if missing:
            raise ValueError(f"dflash config lacks required field(s) {missing}")
        return cls(**known, extra=extra)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> DFlashConfig:
        p = Path(path)
        if p.is_dir():
            p = p / CONFIG_NAME
        if not p.is_file():
            raise FileNotFoundError(f"DFlash config not found: {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: malformed JSON: {e}") from e
        try:
            return cls.from_dict(d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}: {e}") from e

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# Building blocks (plain torch; autograd-friendly so the training script uses the very same code)
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# Inference
# ----------------------------------------------------------------------------------------------------------------
class DFlashDrafter(Drafter):
    """Inference-side DFlash drafter over a target model's embedding and head (see the module docstring).

    ``DFlashDrafter.from_pretrained(dflash_dir, target_model, num_state_slots)`` (or :meth:`load`, the factory's
    spelling); the engine then calls :meth:`capture` (or the contract's :meth:`on_main_forward`) after every main
    forward, :meth:`propose` after every verification (explicit tensors, or a ``DraftContext``), and
    :meth:`zero_slots` / :meth:`clone_slots` for ``zero_states`` / ``clone_states``.

    ``num_speculative_tokens`` may be set below the trained block length ``cfg.num_speculative_tokens``: the block
    is still the trained ``[golden, noise x (k-1)]`` and only the first drafts are returned.
    """

    name = "dflash"

    def __init__(
        self,
        cfg: DFlashConfig,
        weights: dict[str, torch.Tensor],
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        num_state_slots: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        rms_norm: RmsNormFn | None = None,
        num_speculative_tokens: int | None = None,
    ) -> None:
        k = cfg.num_speculative_tokens if num_speculative_tokens is None else int(num_speculative_tokens)
        if not 1 <= k <= cfg.num_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens {k} must be in [1, {cfg.num_speculative_tokens}] (the drafter's trained block)"
            )
        super().__init__(k)
        self.propose_graphs = None  # ProposeGraphs once the worker offers a graph runner (enable_graphs)
        self.cfg = cfg
        self.device = torch.device(device) if device is not None else embed_weight.device
        self.dtype = dtype or embed_weight.dtype
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.capture_layer_ids = self.target_layer_ids  # the contract's name: layers the main forward must capture
        model = DFlashModel(cfg, embed_weight.to(self.device), lm_head_weight.to(self.device))
        expected = model.state_dict()
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise ValueError(f"dflash weights: missing {missing[:8]}, unexpected {unexpected[:8]}")
        for name, t in weights.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                raise ValueError(
                    f"dflash weight {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
                )
        model.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()})
        model.to(device=self.device, dtype=self.dtype)
        # the frozen target tensors keep their own dtype/device (model.to() does not touch plain attributes)
        model.embed_weight = embed_weight.detach().to(self.device)
        model.lm_head_weight = lm_head_weight.detach().to(self.device)
        if rms_norm is not None:
            model.set_rms_norm(rms_norm)
        model.eval().requires_grad_(False)
        self.model = model
        self.num_state_slots = int(num_state_slots)
        c = cfg
        self.ring = torch.zeros(
            self.num_state_slots,
            c.ring_size,
            c.num_layers,
            2,
            c.num_heads,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._ring_offsets = torch.arange(c.ring_size, device=self.device)
        self._block_offsets = torch.arange(c.num_speculative_tokens, device=self.device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        target_model,
        num_state_slots: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        num_speculative_tokens: int | None = None,
    ) -> DFlashDrafter:
        """Load ``dflash_config.json`` + ``dflash.safetensors`` from ``path`` for ``target_model`` (our
        ``DeepseekForCausalLM``: its embedding / lm_head / backend / dtype are used)."""
        from safetensors.torch import load_file

        cfg = DFlashConfig.from_pretrained(path)
        tcfg = target_model.config
        if cfg.hidden_size != tcfg.hidden_size or cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(
                f"{path}: dflash hidden_size/vocab_size {cfg.hidden_size}/{cfg.vocab_size} do not match the target's "
                f"{tcfg.hidden_size}/{tcfg.vocab_size}"
            )
        if max(cfg.target_layer_ids) >= tcfg.num_hidden_layers:
            raise ValueError(
                f"{path}: target_layer_ids {cfg.target_layer_ids} exceed the target's {tcfg.num_hidden_layers} layers"
            )
        wpath = Path(path) / WEIGHTS_NAME
        if not wpath.is_file():
            raise FileNotFoundError(f"DFlash weights not found: {wpath}")
        backend = getattr(target_model, "backend", None)
        rms = backend.kernels.rms_norm if backend is not None else None
        return cls(
            cfg,
            load_file(str(wpath)),
            target_model.model.embed_tokens.weight,
            target_model.lm_head.weight,
            num_state_slots,
            device=device,
            dtype=dtype or getattr(target_model, "dtype", None),
            rms_norm=rms,
            num_speculative_tokens=num_speculative_tokens,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        target_model,
        backend=None,
        *,
        num_state_slots: int,
        num_speculative_tokens: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """:meth:`from_pretrained` with an explicit backend (its device; its ``rms_norm`` kernel is already taken
        from the target model's backend)."""
        device = backend.device if backend is not None else None
        return cls.from_pretrained(
            path,
            target_model,
            num_state_slots,
            device=device,
            dtype=dtype,
            num_speculative_tokens=num_speculative_tokens,
        )

    # ---- state slots ---------------------------------------------------------------------------------------
    def zero_slots(self, slots: torch.Tensor) -> None:
        """Zero the rings of ``slots`` [z] (new sequences)."""
        slots = torch.as_tensor(slots, device=self.device).to(torch.int64).reshape(-1)
        self.ring.index_fill_(0, slots, 0)

    def clone_slots(self, pairs: torch.Tensor, dst: torch.Tensor | None = None) -> None:
        """Copy ring ``src -> dst`` for each row of ``pairs`` [c, 2] (forks); or ``clone_slots(src [c], dst [c])``."""
        if dst is None:
            pairs = torch.as_tensor(pairs, device=self.device).to(torch.int64).reshape(-1, 2)
            src, dst = pairs[:, 0], pairs[:, 1]
        else:
            src = torch.as_tensor(pairs, device=self.device).to(torch.int64).reshape(-1)
            dst = torch.as_tensor(dst, device=self.device).to(torch.int64).reshape(-1)
        self.ring[dst] = self.ring[src]

    # ---- capture -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(
        self,
        captured_hidden: dict[int, torch.Tensor],
        positions: torch.Tensor,
        slots_per_token: torch.Tensor,
    ) -> None:
        """``captured_hidden[layer_id]`` [T, D] (the target forward's residual stream after that layer),
        ``positions`` [T], ``slots_per_token`` [T] -> K/V written at ``ring[slot, position % ring_size]``.

        When one call holds more than ``ring_size`` tokens of a slot (a long prefill chunk), every write to a ring
        cell carries the values of that cell's newest position, so the result does not depend on write order."""
        r = self.cfg.ring_size
        positions = positions.to(device=self.device, dtype=torch.int64)
        slots = slots_per_token.to(device=self.device, dtype=torch.int64)
        c = self.model.context([captured_hidden[i] for i in self.target_layer_ids])
        kv = self.model.context_kv(c, positions).to(self.dtype)  # [T, L, 2, H, hd]
        t = positions.shape[0]
        idx = positions % r
        # newest token per (slot, ring index): amax over key = position * T + token index
        cell = slots * r + idx
        key = positions * t + torch.arange(t, device=self.device)
        best = torch.full((self.num_state_slots * r,), -1, dtype=torch.int64, device=self.device)
        best.scatter_reduce_(0, cell, key, reduce="amax")
        src = best[cell] % max(t, 1)
        self.ring[slots, idx] = kv[src]

    def on_main_forward(self, attn, captured: dict[int, torch.Tensor] | None, slots_per_token: torch.Tensor) -> None:
        """The drafter contract's hook (``spec/drafter.py``): :meth:`capture` at ``attn.positions``."""
        if captured is not None:
            self.capture(captured, attn.positions, slots_per_token)

    def main_forward_hook_in_graph(self):
        """:meth:`capture` is device ops only (scatter-reduce, index writes into the ring): decode graphs capture it
        after the main forward, which takes its ~50 launches off the host at every decode step. Padding tokens
        write ring cell 0 of state slot 0, the dummy slot."""
        return self.capture

    # ---- propose -------------------------------------------------------------------------------------------
    def context_mask(self, golden_positions: torch.Tensor) -> torch.Tensor:
        """[B, ring_size] bool: ring index i holds (as read at P) position p_i = P-1 - ((P-1-i) mod R); valid iff
        0 <= p_i and P - p_i <= window."""
        r, w = self.cfg.ring_size, self.cfg.window
        pm1 = golden_positions.to(torch.int64).unsqueeze(1) - 1
        back = torch.remainder(pm1 - self._ring_offsets, r)  # P-1 - p_i
        return (back < w) & (pm1 - back >= 0)

    @torch.no_grad()
    def propose(
        self,
        golden_tokens,
        golden_positions: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """golden_tokens [B] (the bonus token), golden_positions [B] (its position P; context < P must have been
        captured), slots [B] -> (drafts [B, k] int64 for positions P+1..P+k, confidences [B, k] fp32).

        ``propose(ctx)`` with a ``DraftContext`` reads ``ctx.bonus_tokens / bonus_positions / slots``."""
        if golden_positions is None:
            ctx_in = golden_tokens
            golden_tokens, golden_positions, slots = ctx_in.bonus_tokens, ctx_in.bonus_positions, ctx_in.slots
        golden = golden_tokens.to(device=self.device, dtype=torch.int64)
        pos = golden_positions.to(device=self.device, dtype=torch.int64)
        slots = slots.to(device=self.device, dtype=torch.int64)
        if self.propose_graphs is not None:
            out = self.propose_graphs.run(golden, pos, slots)
            if out is not None:
                return out
        return self._propose(golden, pos, slots)

    def enable_graphs(self, runner, max_rows: int) -> bool:
        """Replay :meth:`propose` from graphs per padded row count (``spec/propose_graphs.py``): it is
        row-independent, sync-free and reads slot state only through the persistent ring buffer."""
        from .propose_graphs import ProposeGraphs

        self.propose_graphs = ProposeGraphs(self._propose, runner, max_rows, self.device)
        return True

    def _propose(self, golden: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor):
        """The propose computation on int64 device tensors (eager, or captured by :class:`ProposeGraphs`)."""
        cfg, m = self.cfg, self.model
        k = cfg.num_speculative_tokens
        ctx = self.ring[slots]  # [B, R, L, 2, H, hd]
        valid = self.context_mask(pos)
        tokens = torch.full((golden.shape[0], k), cfg.noise_token_id, dtype=torch.int64, device=self.device)
        tokens[:, 0] = golden
        h = m.block_hidden(tokens, pos.unsqueeze(1) + self._block_offsets, ctx, valid)  # [B, k, D]
        base = m.base_logits(h)  # [B, k, V] fp32
        drafts, confs = [], []
        prev = golden
        for j in range(self.num_speculative_tokens):
            e = m.markov_embed(prev)
            nxt = torch.argmax(base[:, j] + m.markov_correction(e), dim=-1)
            confs.append(torch.sigmoid(m.confidence_logit(h[:, j], e)))
            drafts.append(nxt)
            prev = nxt
        return torch.stack(drafts, dim=1), torch.stack(confs, dim=1)

    # ---- misc ----------------------------------------------------------------------------------------------
    def state_bytes_per_slot(self) -> int:
        return self.ring[0].numel() * self.ring.element_size()


def save_dflash(
    directory: str | os.PathLike, cfg: DFlashConfig, model: DFlashModel, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write ``dflash_config.json`` and ``dflash.safetensors`` (``dtype``) to ``directory``."""
    from safetensors.torch import save_file

    cfg.save(directory)
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(Path(directory) / WEIGHTS_NAME), metadata={"format": FORMAT})


__all__ = ["CONFIG_NAME", "DFlashConfig", "DFlashDrafter", "DFlashModel", "FORMAT", "WEIGHTS_NAME", "save_dflash"]
