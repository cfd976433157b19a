"""DeepSeek MoE layer: router -> ``moe_gating_topk`` -> dispatch -> ``grouped_mlp`` -> combine (+ shared).

Experts are stored stacked (``w13`` [E, 2I, D] = gate rows then up rows, ``w2`` [E, D, I]) so a backend can
run one grouped GEMM; the checkpoint's per-expert ``experts.{e}.{gate,up,down}_proj.weight`` are copied in
at load.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.hal.kernel_set import KernelSet
from deepinfer_npu.hal.types import GatingParams

from ..model_config import DeepseekModelConfig
from .linear import empty_param
from .mlp import DenseMLP


class StackedExperts(nn.Module):
    """The routed experts' weights, stacked for grouped GEMMs."""

    remapped_params = ("w13", "w2")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype, device) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.w13 = empty_param(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.w2 = empty_param(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)

    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        i, d = self.intermediate_size, self.hidden_size
        shapes = {}
        for e in range(self.num_experts):
            shapes[f"{e}.gate_proj.weight"] = (i, d)
            shapes[f"{e}.up_proj.weight"] = (i, d)
            shapes[f"{e}.down_proj.weight"] = (d, i)
        return shapes

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        expert, proj, _ = name.split(".")
        e, i = int(expert), self.intermediate_size
        if proj == "gate_proj":
            self.w13.data[e, :i].copy_(tensor)
        elif proj == "up_proj":
            self.w13.data[e, i:].copy_(tensor)
        else:
            self.w2.data[e].copy_(tensor)


class Router(nn.Module):
    """``weight`` [E, D] (fp32, as in the reference) and, for noaux_tc, ``e_score_correction_bias`` [E]."""

    def __init__(self, cfg: DeepseekModelConfig, device) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = empty_param(e, cfg.hidden_size, dtype=torch.float32, device=device)
        self.e_score_correction_bias = (
            empty_param(e, dtype=torch.float32, device=device) if cfg.topk_method == "noaux_tc" else None
        )


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: DeepseekModelConfig, kernels: KernelSet, *, dtype, device) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_experts = cfg.n_routed_experts
        self.gating = GatingParams(
            top_k=cfg.num_experts_per_tok,
            num_experts=cfg.n_routed_experts,
            scoring_func=cfg.scoring_func,
            topk_method=cfg.topk_method,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        self.gate = Router(cfg, device)
        self.experts = StackedExperts(
            cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype, device=device
        )
        self.shared_experts = (
            DenseMLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                kernels,
                dtype=dtype,
                device=device,
            )
            if cfg.n_shared_experts
            else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [T, D] (post-attention-normed) -> [T, D]."""
        k = self.kernels

        def routed_experts():
            router_logits = k.router_logits(hidden, self.gate.weight)  # [T, E] fp32, as the reference routers
            # gating top-k, then the dispatch (one kernel on CUDA at decode sizes, where its gate allows it)
            weights, _ids, sorted_hidden, tokens_per_expert, state = k.moe_route(
                router_logits, self.gate.e_score_correction_bias, self.gating, hidden, self.num_experts
            )
            expert_out = k.grouped_mlp(sorted_hidden, tokens_per_expert, self.experts.w13, self.experts.w2)
            return expert_out, state, weights

        if self.shared_experts is None:
            return k.moe_combine(*routed_experts())
        # the two branches are independent: a backend may overlap them (KernelSet.run_parallel); the combine
        # then takes the shared experts' output as its addend (one kernel on CUDA)
        (expert_out, state, weights), shared = k.run_parallel(
            routed_experts, lambda: self.shared_experts(hidden), rows=hidden.shape[0]
        )
        return k.moe_combine_add(expert_out, state, weights, shared)
