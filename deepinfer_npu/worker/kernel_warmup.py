"""The ``KernelWarmupPlan`` of an engine: the shapes its steps can have, known once the model is loaded.

The worker hands it to ``KernelSet.warmup`` before any graph is captured (``EngineConfig.kernel_warmup``), so that a
backend with per-configuration kernels (CUDA's TileLang kernels) compiles them all at start-up rather than inside
the first steps that reach them.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from deepinfer_npu.hal.graph_sizes import graph_sizes
from deepinfer_npu.hal.types import KernelWarmupPlan
from deepinfer_npu.model_executor.layers.mla import LATENT_NORM_EPS
from deepinfer_npu.model_executor.layers.mlp import DenseMLP
from deepinfer_npu.model_executor.layers.moe import DeepseekMoE


def build_kernel_warmup_plan(runner, *, k: int, varlen: bool, drafter=None, graphs=None) -> KernelWarmupPlan:
    """``runner``: the loaded ``ModelRunner``; ``k``: drafts per request and step (0 without speculation);
    ``varlen``: draft counts are re-split on the device; ``graphs``: the worker's ``DecodeGraphs`` or None."""
    cfg, mc = runner.config, runner.model_config
    # The model's own modules say which MLP widths and which router its layers use (MTP layers included).
    modules = list(runner.model.modules())
    mlp_sizes = tuple(sorted({m.intermediate_size for m in modules if isinstance(m, DenseMLP)}))
    moe = next((m for m in modules if isinstance(m, DeepseekMoE)), None)
    # DFlash's decoder norms run on the kernel set with the drafter's own eps (MTP's layers are the model's).
    drafter_eps = float(drafter.cfg.rms_norm_eps) if getattr(drafter, "name", None) == "dflash" else None
    # Every 2-D floating weight of the model (MTP layers included): the linears' (in_features, dtype); the
    # embedding's entry coincides with the hidden-size projections'.
    linear_weights = tuple(sorted({(int(p.shape[1]), p.dtype) for p in runner.model.parameters()
                                   if p.dim() == 2 and p.dtype.is_floating_point}, key=str))
    return KernelWarmupPlan(
        dtype=runner.dtype,
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        num_heads=mc.num_attention_heads,  # no tensor parallelism: every head runs here
        qk_nope_head_dim=mc.qk_nope_head_dim,
        qk_rope_head_dim=mc.qk_rope_head_dim,
        kv_lora_rank=mc.kv_lora_rank,
        q_lora_rank=mc.q_lora_rank,
        rope_interleaved=bool(mc.rope_interleave),
        softmax_scale=float(mc.softmax_scale),
        rms_norm_eps=float(mc.rms_norm_eps),
        latent_norm_eps=LATENT_NORM_EPS,
        mlp_intermediate_sizes=mlp_sizes,
        moe_gating=moe.gating if moe is not None else None,
        moe_intermediate_size=int(moe.experts.w2.shape[2]) if moe is not None else 0,
        drafter_rms_norm_eps=drafter_eps,
        linear_weights=linear_weights,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_prompts=cfg.max_num_prompts or cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_speculative_tokens=k,
        speculative_method=cfg.speculative_method if drafter is not None else None,
        varlen=varlen,
        decode_graph_sizes=tuple(graphs.sizes) if graphs is not None else (),
        decode_graph_width=graphs.width if graphs is not None else 0,
        quantization=cfg.quantization,
        kv_cache_fp8=cfg.kv_cache_dtype == "fp8",
        fp8_linear_shapes=tuple(sorted({tuple(map(int, p.shape)) for p in runner.model.parameters()
                                        if p.dim() == 2 and p.dtype == torch.float8_e4m3fn})),
        fp8_one_row_shapes=tuple(sorted({tuple(map(int, m.fused_a_proj.shape)) for m in runner.model.modules()
                                         if getattr(m, "fused_a_proj", None) is not None
                                         and m.fused_a_proj.dtype == torch.float8_e4m3fn})),
    )


def expected_kernel_warmup_plan(runner) -> KernelWarmupPlan:
    """The plan :func:`build_kernel_warmup_plan` will give the worker, from the model as built (its weights not yet
    loaded, no drafter, no decode graphs yet): the drafts and the re-split from the engine's settings, the decode
    graph sizes the worker plans when graphs are on by request or by the backend's default. A DFlash drafter's own
    norms (and the sizes of a graph set the worker then refuses) are the difference; the worker's warm-up builds
    what this plan missed. For ``KernelSet.start_early_warmup``."""
    from deepinfer_npu.worker.decode_graphs import decode_graph_max_tokens, graph_table_width

    cfg, backend = runner.config, runner.backend
    k = cfg.num_speculative_tokens if cfg.speculative_method else 0
    varlen = bool(cfg.varlen_verification and k and cfg.zero_overhead_scheduling
                  and backend.supports_device_resplit)
    graphs = None
    wanted = cfg.enable_graphs if cfg.enable_graphs is not None else getattr(backend, "graphs_by_default", False)
    if wanted:
        graphs = SimpleNamespace(sizes=graph_sizes(decode_graph_max_tokens(cfg, k)),
                                 width=graph_table_width(runner.max_model_len, runner.block_size, 2 * k))
    plan = build_kernel_warmup_plan(runner, k=k, varlen=varlen, graphs=graphs)
    return dataclasses.replace(plan, speculative_method=cfg.speculative_method if k else None)  # no drafter yet
