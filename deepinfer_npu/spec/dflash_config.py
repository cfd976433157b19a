"""The DFlash drafter's on-disk format: its config (``dflash_config.json``) and weight names.

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
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT = "deepinfer-dflash-v1"
CONFIG_NAME = "dflash_config.json"
WEIGHTS_NAME = "dflash.safetensors"


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
