"""Expert-parallel load balancing: per-slot token counts on the device, DeepSeek's hierarchical placement policy,
redundant experts, and re-placement while serving (docs/eplb.md)."""

from deepinfer_npu.config import EPLBConfig

from .balancer import ExpertBalancer, ep_stats, initial_placement
from .policy import num_redundant_experts, rebalance_experts

__all__ = ["EPLBConfig", "ExpertBalancer", "ep_stats", "initial_placement", "num_redundant_experts",
           "rebalance_experts"]
