"""Rotary embedding for the MLA rope dimensions, with DeepSeek's YaRN scaling.

The cos/sin table is precomputed in fp32 as ``[cos | sin]`` rows (``cos_sin_cache`` [max_pos, R]) with the
YaRN attention factor ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` folded in, exactly as
transformers computes it (``_compute_yarn_parameters``). The matching softmax-scale correction lives in
``DeepseekModelConfig.softmax_scale``.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [dim/2] (interpolation/extrapolation blend) and the attention factor."""
    factor = float(scaling["factor"])
    orig_max = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_weight = 1 - ramp  # high-frequency pairs keep their original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Holds ``cos_sin_cache`` [max_positions, R] fp32 and the pair layout (a ``hal.types.RopeLike``)."""

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        base: float,
        scaling: dict[str, Any] | None,
        interleaved: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        if scaling is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
            attention_factor = 1.0
        else:
            inv_freq, attention_factor = _yarn_inv_freq(rotary_dim, base, scaling)
        # Same fp32 arithmetic as transformers (position * inv_freq, then cos/sin, then the factor).
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        self.cos_sin_cache = cache.to(device)
        self.attention_factor = attention_factor

    @classmethod
    def from_config(cls, cfg, device: torch.device | str = "cpu") -> RotaryEmbedding:
        return cls(
            cfg.qk_rope_head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.rope_interleave,
            device,
        )
