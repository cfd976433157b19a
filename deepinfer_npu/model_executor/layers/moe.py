"""DeepSeek MoE layer: router -> ``moe_gating_topk`` -> dispatch -> ``grouped_mlp`` -> combine (+ shared).

Experts are stored stacked (``w13`` [E, 2I, D] = gate rows then up rows, ``w2`` [E, D, I]) so a backend can
run one grouped GEMM; the checkpoint's per-expert ``experts.{e}.{gate,up,down}_proj.weight`` are copied in
at load. Quantised (``quant``), both stacks are in the scheme's dtype with per-expert scales (FP8: 128 x 128 block
scales ``w13_scale_inv`` / ``w2_scale_inv``, ``kernels.fp8_grouped_mlp``; W8A8: per-channel ``w13_scale`` /
``w2_scale``, ``kernels.w8a8_grouped_mlp``).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_npu.distributed.ep_moe import ep_moe_forward
from deepinfer_npu.distributed.parallel_state import get_expert_parallel
from deepinfer_npu.hal.kernel_set import KernelSet
from deepinfer_npu.hal.types import GatingParams

from ..model_config import DeepseekModelConfig
from ..quantization import QuantConfig
from ..quantization.params import add_quant_param, store_fp8_rows, store_quantized
from .linear import empty_param
from .mlp import DenseMLP


class StackedExperts(nn.Module):
    """The routed experts' weights, stacked for grouped GEMMs: ``expert_ids[i]`` is the logical expert in row ``i``
    (all of them on one device; a rank's slots under expert parallelism, a hot expert possibly twice)."""

    remapped_params = ("w13", "w2")

    def __init__(self, expert_ids: list[int], num_logical: int, hidden_size: int, intermediate_size: int, *,
                 dtype, device, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.expert_ids = list(expert_ids)
        self.num_experts = len(self.expert_ids)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.quant = quant
        e, i, d = self.num_experts, intermediate_size, hidden_size
        if quant is None:
            self.w13 = empty_param(e, 2 * i, d, dtype=dtype, device=device)
            self.w2 = empty_param(e, d, i, dtype=dtype, device=device)
        else:
            self.scheme = quant.scheme
            sfx = self.scheme.scale_suffix
            self.remapped_params = ("w13", "w2", "w13" + sfx, "w2" + sfx)
            add_quant_param(self, "w13", e, 2 * i, d, scheme=self.scheme, device=device)
            add_quant_param(self, "w2", e, d, i, scheme=self.scheme, device=device)
            self._pending: dict[tuple[int, str], torch.Tensor] = {}  # gate / up parts waiting for their partner
        if self.expert_ids != list(range(num_logical)):
            # seeded dummy weights draw the full [num_logical, ...] tensors and keep these rows, so every
            # placement holds the single-device weights
            for name, param in self.named_parameters():
                param.dummy_rows = (num_logical, self.expert_ids)
        self.num_logical = num_logical
        self.relabel(self.expert_ids)

    def relabel(self, expert_ids: list[int]) -> None:
        """Row ``i`` now holds logical expert ``expert_ids[i]`` (after the load balancer moved the weights)."""
        self.expert_ids = list(expert_ids)
        self._rows: dict[int, list[int]] = {}
        for row, expert in enumerate(self.expert_ids):
            self._rows.setdefault(expert, []).append(row)
        self._foreign = [e for e in range(self.num_logical) if e not in self._rows]

    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        i, d = self.intermediate_size, self.hidden_size
        shapes = {}
        for e in self._rows:
            shapes[f"{e}.gate_proj.weight"] = (i, d)
            shapes[f"{e}.up_proj.weight"] = (i, d)
            shapes[f"{e}.down_proj.weight"] = (d, i)
        return shapes

    def skipped_checkpoint_tensors(self) -> list[str]:
        """Checkpoint tensors of experts other ranks hold: present in the files, not read here."""
        return [f"{e}.{p}.weight" for e in self._foreign for p in ("gate_proj", "up_proj", "down_proj")]

    @property
    def fp8_checkpoint_tensors(self) -> tuple[str, ...]:
        """Checkpoint tensors taken as FP8 + scales (all of them with the FP8 scheme)."""
        return tuple(self.checkpoint_tensors()) if self.quant is not None and self.quant.method == "fp8" else ()

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 scales, w2 scales)`` of the quantised stacks."""
        sfx = self.scheme.scale_suffix
        return getattr(self, "w13" + sfx), getattr(self, "w2" + sfx)

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        expert, proj, _ = name.split(".")
        i = self.intermediate_size
        if self.quant is not None:
            self._load_quantized(int(expert), proj, tensor)
            return
        for row in self._rows[int(expert)]:
            if proj == "gate_proj":
                self.w13.data[row, :i].copy_(tensor)
            elif proj == "up_proj":
                self.w13.data[row, i:].copy_(tensor)
            else:
                self.w2.data[row].copy_(tensor)

    def _load_quantized(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """Quantise at load: ``down_proj`` at once, gate / up once both arrived, stacked (as ``DenseMLP``)."""
        s13, s2 = self.scales
        if proj == "down_proj":
            for row in self._rows[expert]:
                store_quantized(self.scheme, self.w2.data[row], s2.data[row], tensor)
            return
        self._pending[(expert, proj)] = tensor.float()
        if (expert, "gate_proj") in self._pending and (expert, "up_proj") in self._pending:
            stacked = torch.cat((self._pending.pop((expert, "gate_proj")), self._pending.pop((expert, "up_proj"))))
            for row in self._rows[expert]:
                store_quantized(self.scheme, self.w13.data[row], s13.data[row], stacked)

    def load_checkpoint_fp8(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        expert, proj, _ = name.split(".")
        s13, s2 = self.scales
        for row in self._rows[int(expert)]:
            if proj == "down_proj":
                self.w2.data[row].copy_(weight)
                s2.data[row].copy_(scale_inv)
            else:
                start = 0 if proj == "gate_proj" else self.intermediate_size
                store_fp8_rows(self.w13.data[row], s13.data[row], start, weight, scale_inv, self.scheme.part_alignment)


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
        self.ep = get_expert_parallel()  # None: every routed expert lives in this process
        self.quant = cfg.quant
        expert_ids = self.ep.local_experts if self.ep is not None else list(range(cfg.n_routed_experts))
        self.experts = StackedExperts(
            expert_ids, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype, device=device,
            quant=cfg.quant,
        )
        self.shared_experts = (
            DenseMLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                kernels,
                dtype=dtype,
                device=device,
                quant=cfg.quant,
            )
            if cfg.n_shared_experts
            else None
        )
        # this layer's placement, route table and per-slot token counts under expert parallelism
        self.ep_layer = self.ep.register(self) if self.ep is not None else None

    def experts_mlp(self, sorted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """This process's routed experts over rows sorted by expert (the quantised op with a quantisation)."""
        ex, k = self.experts, self.kernels
        if self.quant is None:
            return k.grouped_mlp(sorted_hidden, tokens_per_expert, ex.w13, ex.w2)
        s13, s2 = ex.scales
        return ex.scheme.grouped_mlp(k, sorted_hidden, tokens_per_expert, ex.w13, s13, ex.w2, s2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [T, D] (post-attention-normed) -> [T, D]."""
        if self.ep is not None:
            return ep_moe_forward(self, hidden, self.ep)
        k = self.kernels

        def routed_experts():
            router_logits = k.router_logits(hidden, self.gate.weight)  # [T, E] fp32, as the reference routers
            # gating top-k, then the dispatch (one kernel on CUDA at decode sizes, where its gate allows it)
            weights, _ids, sorted_hidden, tokens_per_expert, state = k.moe_route(
                router_logits, self.gate.e_score_correction_bias, self.gating, hidden, self.num_experts
            )
            return self.experts_mlp(sorted_hidden, tokens_per_expert), state, weights

        if self.shared_experts is None:
            return k.moe_combine(*routed_experts())
        # the two branches are independent: a backend may overlap them (KernelSet.run_parallel); the combine
        # then takes the shared experts' output as its addend (one kernel on CUDA)
        (expert_out, state, weights), shared = k.run_parallel(
            routed_experts, lambda: self.shared_experts(hidden), rows=hidden.shape[0]
        )
        return k.moe_combine_add(expert_out, state, weights, shared)
