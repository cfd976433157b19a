"""The CUDA backend's op implementations, one file per op family, chosen once per engine (``select``) and asked
for the call, the kernel configurations to compile at start-up, and the op report.

``FAMILIES`` lists them in the order the warm-up compiles their kernels (the forward's order, then the step's)."""

from __future__ import annotations

from .base import OpConfig, OpImpl
from .grouped_mlp import GroupedMLP
from .linear import Linear
from .mla_attention import MLAAttention
from .mla_epilogue import MLAEpilogue
from .mla_prefill_mha import MLAPrefillMHA
from .mla_prolog import MLAProlog
from .moe_routing import MoERouting
from .norms import Norms
from .step import StepKernels

FAMILIES: dict[str, type[OpImpl]] = {
    "norms": Norms,
    "linear": Linear,
    "mla_prolog": MLAProlog,
    "mla_attention": MLAAttention,
    "mla_epilogue": MLAEpilogue,
    "mla_prefill_mha": MLAPrefillMHA,
    "moe_routing": MoERouting,
    "grouped_mlp": GroupedMLP,
    "step": StepKernels,
}

__all__ = ["FAMILIES", "OpConfig", "OpImpl"]
