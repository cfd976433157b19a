"""Plain-torch DeepSeek-V3 (MLA + DeepSeekMoE + MTP) used to train the embedded reference model.

It computes what Hugging Face transformers' ``DeepseekV3ForCausalLM`` computes from the exported weights
(checked by ``evaluate.check_hf_parity``): MLA with q_lora and interleaved RoPE (``rope_interleave: true``,
the layout of the original DeepSeek weights), sigmoid ``noaux_tc`` routing with ``e_score_correction_bias``,
``n_group``/``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``, shared experts,
``first_k_dense_replace`` dense layers. Parameter names are the Hugging Face / DeepSeek checkpoint names
except the routed experts, which are stored stacked for speed and unstacked to
``mlp.experts.{e}.{gate,up,down}_proj.weight`` by :func:`export_state_dict`.

MTP (DeepSeek-V3 paper §2.2, one module, stored as decoder layer index ``num_hidden_layers``): for position
i, ``h'_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])`` where ``h_i`` is the main model's final hidden
state *after* ``model.norm`` (what vLLM/SGLang and transformers' MtpModel pass), then one MoE decoder block,
then ``shared_head.norm``, then the main model's ``lm_head`` (shared, not saved again), predicting
``t_{i+2}``. The embedding is shared with the main model too."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RefConfig:
    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 512
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 4
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int | None = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    initializer_range: float = 0.02

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def hf_config(self) -> dict:
        """config.json in the layout of deepseek-ai/DeepSeek-V3 (plus ``rope_interleave``); transformers
        reads it."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "ep_size": 1,
            "first_k_dense_replace": self.first_k_dense_replace,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "kv_lora_rank": self.kv_lora_rank,
            "max_position_embeddings": self.max_position_embeddings,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_layer_freq": 1,
            "n_group": self.n_group,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "norm_topk_prob": self.norm_topk_prob,
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_attention_heads,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "pretraining_tp": 1,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_interleave": True,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": self.topk_group,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "v_head_dim": self.v_head_dim,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_hf_config(cls, d: dict) -> RefConfig:
        names = set(asdict(cls()).keys())
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


def rope_cos_sin(cfg: RefConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, R/2] of positions (fp32), as transformers' default RoPE computes them."""
    r = cfg.qk_rope_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, R] holding interleaved pairs (x0, x1), (x2, x3)...; the output is de-interleaved exactly as
    transformers' ``apply_rotary_pos_emb_interleave`` does (q and k get the same permutation, so q.k is that
    of interleaved RoPE)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)
        self.scaling = cfg.qk_head_dim**-0.5  # rope_scaling is null: no YaRN mscale

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The MLA projections with RoPE applied: x [B, T, D] -> q, k [B, H, T, qk_head_dim], v [B, H, T, v_dim]."""
        c = self.cfg
        b, t, _ = x.shape
        h = c.num_attention_heads
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, h, c.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        k_rot = k_rot.view(b, 1, t, c.qk_rope_head_dim)
        q_rot = apply_rope_interleave(q_rot, cos, sin)
        k_rot = apply_rope_interleave(k_rot, cos, sin)
        kv = self.kv_b_proj(kv_nope).view(b, t, h, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(b, h, t, c.qk_rope_head_dim)], dim=-1)
        return torch.cat([q_pass, q_rot], dim=-1), k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.cfg.num_attention_heads * self.cfg.v_head_dim))


class Gate(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))


def route(cfg: RefConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """noaux_tc routing, as transformers' DeepseekV3TopkRouter.

    x [N, D] -> (scores [N, E], weights [N, k], ids [N, k])."""
    n = x.shape[0]
    e, g = cfg.n_routed_experts, cfg.n_group
    with torch.autocast(device_type=x.device.type, enabled=False):
        scores = F.linear(x.float(), weight.float()).sigmoid()
    sfc = scores + bias
    group_scores = sfc.view(n, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, g, e // g).reshape(n, e)
    sfc = sfc.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(sfc, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, w * cfg.routed_scaling_factor, ids


class MoE(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = Gate(cfg)
        # Stacked routed experts (exported as mlp.experts.{e}.{gate,up,down}_proj.weight).
        self.experts_gate_proj = nn.Parameter(torch.empty(e, i, d))
        self.experts_up_proj = nn.Parameter(torch.empty(e, i, d))
        self.experts_down_proj = nn.Parameter(torch.empty(e, d, i))
        self.shared_experts = MLP(d, i * cfg.n_shared_experts)
        self.register_buffer("load_counts", torch.zeros(e), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, t, d = x.shape
        e, i = c.n_routed_experts, c.moe_intermediate_size
        flat = x.reshape(-1, d)
        scores, w, ids = route(c, flat, self.gate.weight, self.gate.e_score_correction_bias)
        dense_w = torch.zeros_like(scores).scatter(1, ids, w)  # [N, E] fp32, zero for unselected experts
        # All experts on all tokens, weighted (zero weight = not routed): dense and fast for 8 tiny experts.
        wg = self.experts_gate_proj.reshape(e * i, d)
        wu = self.experts_up_proj.reshape(e * i, d)
        act = (F.silu(F.linear(flat, wg)) * F.linear(flat, wu)).view(-1, e, i)
        act = act * dense_w.to(act.dtype).unsqueeze(-1)
        wd = self.experts_down_proj.permute(1, 0, 2).reshape(d, e * i)
        routed = F.linear(act.reshape(-1, e * i), wd)
        out = routed.view(b, t, d) + self.shared_experts(x)
        if self.training:
            with torch.no_grad():
                sel = torch.zeros(b * t, e, device=x.device).scatter_(1, ids, 1.0).view(b, t, e)
                self.load_counts += sel.sum(dim=(0, 1))
            # DeepSeek-V3 complementary sequence-wise balance loss (without alpha): sum_i f_i * P_i per
            # sequence.
            f = sel.sum(1) * (e / (c.num_experts_per_tok * t))
            p = (scores / scores.sum(-1, keepdim=True)).view(b, t, e).mean(1)
            self.aux_loss = (f * p).sum(-1).mean()
        return out

    @torch.no_grad()
    def update_bias(self, gamma: float) -> None:
        """Auxiliary-loss-free balancing: b_i += gamma * sign(mean_load - load_i)."""
        err = self.load_counts.mean() - self.load_counts
        self.gate.e_score_correction_bias += gamma * torch.sign(err)
        self.load_counts.zero_()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: RefConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if layer_idx >= cfg.first_k_dense_replace else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.dropout = 0.0

    def block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        x = x + F.dropout(self.self_attn(self.input_layernorm(x), cos, sin), p, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), p, self.training)

    def forward(self, x, cos, sin):
        return self.block(x, cos, sin)


class SharedHead(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: RefConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, prev_hidden, next_embeds, cos, sin):
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(prev_hidden)], dim=-1))
        return self.shared_head.norm(self.block(x, cos, sin))


class Backbone(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        n = cfg.num_hidden_layers
        layers: list[nn.Module] = [DecoderLayer(cfg, i) for i in range(n)]
        layers += [MTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3Ref(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # ---- init / utilities
    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        std = self.cfg.initializer_range
        n_blocks = self.cfg.num_hidden_layers + self.cfg.num_nextn_predict_layers
        out_std = std / math.sqrt(2 * n_blocks)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p) if name.endswith("norm.weight") else nn.init.zeros_(p)
                continue
            s = out_std if ("o_proj" in name or "down_proj" in name) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * s)

    def set_dropout(self, p: float) -> None:
        for m in self.modules():
            if isinstance(m, DecoderLayer):
                m.dropout = p

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.model.layers[self.cfg.num_hidden_layers :])

    # ---- forward
    def forward_main(self, input_ids: torch.Tensor, position_offset: int = 0):
        """input_ids [B, T] -> (final normed hidden [B, T, D], cos, sin)."""
        t = input_ids.shape[1]
        pos = torch.arange(position_offset, position_offset + t, device=input_ids.device)
        cos, sin = rope_cos_sin(self.cfg, pos)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers[: self.cfg.num_hidden_layers]:
            x = layer(x, cos, sin)
        return self.model.norm(x), cos, sin

    def forward_mtp(self, hidden: torch.Tensor, next_ids: torch.Tensor, cos, sin, depth: int = 0):
        """hidden [B, T, D] (main final normed hidden at positions i), next_ids [B, T] (tokens i+1) -> MTP
        hidden [B, T, D] (after shared_head.norm); logits for tokens i+2 are lm_head of it."""
        return self.mtp_layers[depth](hidden, self.model.embed_tokens(next_ids), cos, sin)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def training_loss(self, batch: torch.Tensor, mtp_weight: float, aux_alpha: float):
        """batch [B, T+2] token ids -> (total loss, main CE, MTP CE, aux)."""
        t = batch.shape[1] - 2
        inp, tgt, tgt2 = batch[:, :t], batch[:, 1 : t + 1], batch[:, 2 : t + 2]
        hidden, cos, sin = self.forward_main(inp)
        v = self.cfg.vocab_size
        main = F.cross_entropy(self.logits(hidden).float().view(-1, v), tgt.reshape(-1))
        total = main
        mtp = torch.zeros((), device=batch.device)
        if self.cfg.num_nextn_predict_layers:
            mh = self.forward_mtp(hidden, tgt, cos, sin)
            mtp = F.cross_entropy(self.logits(mh).float().view(-1, v), tgt2.reshape(-1))
            total = total + mtp_weight * mtp
        aux = torch.zeros((), device=batch.device)
        if self.training:
            auxes = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
            if auxes:
                aux = torch.stack(auxes).mean()
                total = total + aux_alpha * aux
        return total, main, mtp, aux


# ---- HF layout (de)serialisation

EXPERT_PARAMS = ("experts_gate_proj", "experts_up_proj", "experts_down_proj")


def export_state_dict(model: DeepseekV3Ref, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Hugging Face / DeepSeek checkpoint names; e_score_correction_bias stays fp32 (as in DeepSeek-V3's
    release)."""
    out: dict[str, torch.Tensor] = {}
    sd = model.state_dict()
    for name, t in sd.items():
        t = t.detach().cpu()
        leaf = name.rsplit(".", 1)[-1]
        if leaf in EXPERT_PARAMS:
            prefix = name[: -len(leaf)]
            proj = leaf[len("experts_") :]
            for e in range(t.shape[0]):
                out[f"{prefix}experts.{e}.{proj}.weight"] = t[e].to(dtype).contiguous()
        elif leaf == "e_score_correction_bias":
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def import_state_dict(model: DeepseekV3Ref, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of export_state_dict (values cast to the model's dtype)."""
    sd = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if ".experts." in name:
            prefix, rest = name.split(".experts.", 1)
            e, proj, _ = rest.split(".")
            stacks.setdefault(f"{prefix}.experts_{proj}", {})[int(e)] = t
        else:
            sd[name] = t
    for key, d in stacks.items():
        sd[key] = torch.stack([d[e] for e in range(len(d))])
    ref = model.state_dict()
    missing = set(ref) - set(sd)
    unexpected = set(sd) - set(ref)
    if missing or unexpected:
        raise KeyError(f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in sd.items()})


def load_ref_model(model_dir, dtype: torch.dtype = torch.float32) -> DeepseekV3Ref:
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    cfg = RefConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    model = DeepseekV3Ref(cfg).to(dtype)
    import_state_dict(model, load_file(str(model_dir / "model.safetensors")))
    model.eval()
    return model


def count_params(model: DeepseekV3Ref) -> dict[str, int]:
    n = model.cfg.num_hidden_layers
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for layer in model.model.layers[n:] for p in layer.parameters())
    emb = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    c = model.cfg
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    inactive = (c.n_routed_experts - c.num_experts_per_tok) * per_expert * (n - c.first_k_dense_replace)
    return {
        "total": total,
        "main": total - mtp,
        "mtp_module": mtp,
        "embedding_and_head": emb,
        "main_active_per_token": total - mtp - inactive,
    }
