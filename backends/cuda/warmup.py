"""CUDA kernel warm-up: every TileLang configuration the engine can reach, compiled at start-up.

TileLang kernels (``kernels_cuda/``) are JIT-compiled per configuration (seconds each, nvcc included) at the first
call that selects them, then cached in memory and on disk. A first call inside a served or timed step stalls it:
a DFlash benchmark on an H200 ran at 37 tok/s instead of ~480 while zos_fixup's re-split variants compiled inside
its first decode steps. ``CudaKernelSet.warmup`` (the HAL hook ``KernelSet.warmup``) therefore lists, for the
engine's ``KernelWarmupPlan``, every configuration the kernel set would route to, and compiles them before the
first step through each module's own ``precompile`` (builds on the calling thread, nvcc in parallel threads).
Modules are compiled one after another: CPython 3.11's ``ast.parse`` is not thread-safe, so two modules must never
build (parse) their kernels at once. With TileLang's disk cache warm, a restart only re-parses (~0.1 s a config).

What each op reaches (mirrors the routing in ``backends/cuda/kernels.py``; ``k`` = drafts per request):

- ``rms_norm``: the hidden-size norms, plain and fused with the residual add; the q_a layernorm (q_lora models);
  the kv_a layernorm only where ``mla_rope_cache`` does not apply; a drafter's own hidden-size norms (DFlash).
- ``mla_rope_cache`` (``mla_prolog``): one configuration per model (heads, q layout, rope layout).
- ``mla_decode`` (``mla_attention``, host max query length <= 16), configurations (heads, m_tiles, num_splits)
  from ``default_num_splits(B, H, bucket_q(max_q), block-table width, num_sms)``, as the launch computes them:
  decode graphs (``B`` = each graph size, ``max_q = k + 1``, the graphs' table width); eager steps on the
  scheduler's tables: prefill (``B`` = 1 .. max_num_prompts, every query bucket up to 16: chunks of <= 16 tokens
  take this kernel, and so does MTP's catch-up over them) and eager decode or MTP's catch-up over a decode step
  (``B`` = 1 .. max_num_seqs, ``max_q <= k + 1``, also after a device re-split); MTP's chained drafts (``max_q =
  1``, tables padded by up to k + 1 keys; with graphs, the chain graphs' fixed width at every propose graph
  size). On a Hopper the 64-row ones carry ``mla_decode_ws``' flag, ``(heads, m_tiles, num_splits, False, 64,
  True)`` (``md.decode_config``), and compile that kernel; 16-row ones are ``(..., False, 16)``. Prefill
  (``mla_prefill``: max q > 16): one causal configuration per power-of-two query bucket from 32 up to the longest
  chunk.
- ``silu_mul``: each SwiGLU width (dense layers, shared experts, routed experts), the row variant (<= 128 rows)
  and the tile variant (more rows) where the step sizes reach them.
- ``moe_routing`` (gating, permute, unpermute), ``moe_gemm`` (w13 and w2 GEMMs, its expert scan) for MoE models;
  ``moe_gemm_swap`` (w13 with the SwiGLU, w2) at up to ``MOE_GEMM_SWAP_MAX_ROWS`` rows where its gate allows it.
- ``spec_verify``: the greedy and the sampled (noise) arg-max over the vocabulary and the accept kernel. The worker
  samples every step through ``spec_verify`` (prefill: one row per finished prompt, ``max_q = 1``), with or
  without speculation, so ``kernels_cuda.sampling`` (the ``sample`` op) is not on the engine's path.
- ``skinny_gemm``: ``linear`` on 1-row steps for each (in_features, dtype) of the model's weights (K <= 8192), the
  fp32 router on bf16 rows, the dense MLPs' gated gate/up GEMM.
- ``zos_fixup``: the correction (every decode step) and, with varlen re-splitting, the re-split for ``k`` at every
  launch shape ``resplit_launch(rows)`` of 1 .. max_num_seqs rows.
- ``decode_inputs``: one build for the page size (every size dynamic), while its gate allows it.
- ``moe_routing`` ``route`` (the gating fused with the permute, ``moe_route``): one build, while its gate allows it.
- ``mla_absorb``: W_UK of one token, one build for the model's dims (bf16), while its gate allows it.

Each module's eligibility (dtype, dims, page size, its ``reason(...)`` where it has one, evaluated on meta
tensors of the step's shapes) is respected, and so is the unverified-kernel gate. A module whose compile fails
is turned off in the kernel set: its ops fall back to the reference with the failure as the reason (as a failed
import does), and the summary names it; start-up continues.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from deepinfer_npu.hal.types import KernelWarmupPlan

from . import kernels as _cuda_kernels
from .kernels import (
    KV_LORA,
    MAX_Q,
    MOE_GEMM_MAX_ROWS,
    MOE_GEMM_SWAP_MAX_ROWS,
    NORM_MAX,
    NORM_MIN,
    NORM_MULT,
    PAGE,
    ROPE,
    SKINNY_GROUPED_MAX_ROWS,
    is_sm90,
    tilelang_importable,
    unverified_kernel_enabled,
)

logger = logging.getLogger(__name__)

_BF16 = torch.bfloat16


def _kc(name: str):
    """``deepinfer_npu.kernels_cuda.<name>`` (importable without tilelang: only its host helpers are used here)."""
    return importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}")


def _meta(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor of ``shape`` without storage, for the modules' host-fact ``reason`` checks."""
    return torch.empty(shape, dtype=dtype, device="meta")


# ---- what each module compiles for a plan ---------------------------------------------------------------------
def _norm_width_ok(n: int) -> bool:
    return NORM_MIN <= n <= NORM_MAX and n % NORM_MULT == 0


def _rope_cache_applies(plan: KernelWarmupPlan) -> bool:
    """``mla_prolog``'s condition for kernels_cuda.mla_rope_cache (the runner's caches are contiguous pages)."""
    return (plan.dtype == _BF16 and plan.kv_lora_rank == KV_LORA and plan.qk_rope_head_dim == ROPE
            and plan.block_size == PAGE and _kc("mla_rope_cache").supported_heads(plan.num_heads))


def rms_norm_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``(width, with_residual, eps)`` as ``kernels_cuda.rms_norm.get_kernel`` takes them."""
    if plan.dtype != _BF16:
        return []
    want = [(plan.hidden_size, False, plan.rms_norm_eps), (plan.hidden_size, True, plan.rms_norm_eps)]
    if plan.q_lora_rank:
        want.append((plan.q_lora_rank, False, plan.latent_norm_eps))
    if not _rope_cache_applies(plan):  # the composed prolog normalises c_kv on this kernel set
        want.append((plan.kv_lora_rank, False, plan.latent_norm_eps))
    if plan.drafter_rms_norm_eps is not None:
        want.append((plan.hidden_size, False, plan.drafter_rms_norm_eps))
    return list(dict.fromkeys((n, r, float(eps)) for n, r, eps in want if _norm_width_ok(n)))


def mla_rope_cache_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``(heads, q_dim, q_off, interleaved, eps)``: q is viewed as [T, H, nope + rope] with the rope part last."""
    if not _rope_cache_applies(plan):
        return []
    nope = plan.qk_nope_head_dim
    return [(plan.num_heads, nope + plan.qk_rope_head_dim, nope, bool(plan.rope_interleaved),
             float(plan.latent_norm_eps))]


def _max_step_rows(plan: KernelWarmupPlan) -> int:
    """Most requests one step holds (the scheduler's row count)."""
    return min(max(plan.max_num_seqs, plan.max_num_prompts), plan.max_num_batched_tokens)


def _bucket_reachable(bucket: int, max_q: int) -> bool:
    """Whether some host max query length in 1..max_q rounds up to ``bucket`` (``bucket_q``: 1, 2, 4, 8, 16)."""
    return (bucket // 2 + 1 if bucket > 1 else 1) <= max_q


def mla_decode_configs(plan: KernelWarmupPlan, num_sms: int, prefill: bool = True,
                       warp_specialized: bool = False) -> list[tuple]:
    """Decode ``md.decode_config`` tuples and prefill ``(heads, m_tiles, 1, True)`` (causal tile bound)
    configurations, as ``mla_attention`` launches them (module docstring); ``warp_specialized``: the decode tiles
    of 64 rows on ``mla_decode_ws``'s kernel (its gate)."""
    if not (plan.dtype == _BF16 and plan.kv_lora_rank == KV_LORA and plan.qk_rope_head_dim == ROPE
            and plan.block_size == PAGE):
        return []
    md = _kc("mla_decode")
    h, k, bs, mnbt = plan.num_heads, plan.num_speculative_tokens, plan.block_size, plan.max_num_batched_tokens
    decode: set[tuple] = set()

    def add(batch: int, max_q_bound: int, width: int) -> None:
        """Every bucket of a host max query length 1..max_q_bound, at ``batch`` rows and table ``width``."""
        for bucket in (1, 2, 4, 8, 16):
            if _bucket_reachable(bucket, min(max_q_bound, MAX_Q)):
                decode.add(md.decode_config(h, bucket, md.default_num_splits(batch, h, bucket, width, num_sms),
                                            warp_specialized))

    # Decode graphs: S rows, host max_seqlen_q = k + 1 (exactly that bucket), the graphs' own (wider) tables.
    for size in plan.decode_graph_sizes:
        bucket = md.bucket_q(k + 1)
        decode.add(md.decode_config(h, bucket, md.default_num_splits(size, h, bucket, plan.decode_graph_width,
                                                                     num_sms), warp_specialized))
    # Prefill chunks of <= 16 query tokens (and MTP's catch-up over them): B prompts on the scheduler's tables.
    for b in range(1, min(plan.max_num_prompts, mnbt) + 1):
        add(b, min(mnbt, plan.max_model_len), plan.block_table_width)
    # Eager decode steps (no graphs; with MTP its catch-up forward over the main step's metadata): host max q
    # <= k + 1, also after a device re-split (the worker's AttentionMetadata.max_seqlen_q, which the MLA layer
    # passes to mla_attention).
    eager_decode = not plan.decode_graph_sizes or plan.speculative_method == "mtp"
    if eager_decode:
        for b in range(1, min(plan.max_num_seqs, mnbt) + 1):
            add(b, k + 1, plan.block_table_width)
    # MTP's chained drafts: one query a row on the step's tables padded to max_seqlen_k + k + 1 keys, where
    # max_seqlen_k <= max_model_len (+ 2k after a device re-split).
    if plan.speculative_method == "mtp" and k:
        max_k = plan.max_model_len + (2 * k if plan.varlen else 0)
        widest = max(plan.block_table_width, (max_k + k + 1) // bs + 1)
        for b in range(1, _max_step_rows(plan) + 1):
            for width in range(plan.block_table_width, widest + 1):
                add(b, 1, width)
    # MTP's chain replayed from graphs (spec/mtp_drafter.py): one query a row at every propose graph size, on
    # tables of the chain graphs' fixed width.
    if plan.speculative_method == "mtp" and k and plan.decode_graph_sizes:
        from deepinfer_npu.hal.graph_sizes import graph_sizes
        from deepinfer_npu.spec.mtp_drafter import chain_graph_width

        width = chain_graph_width(plan.max_model_len, k, bs)
        for b in graph_sizes(max(1, plan.max_num_seqs)):
            add(b, 1, width)
    cfgs = sorted(decode)
    # Host max q past 16: mla_prefill, one configuration per bucket 32, 64, ... up to the longest query.
    longest = min(mnbt, plan.max_model_len, md.MAX_PREFILL_Q)
    if prefill and longest > MAX_Q:
        bucket = md.bucket_prefill_q(MAX_Q + 1)
        while bucket <= md.bucket_prefill_q(longest):
            cfgs.append((h, md.m_tiles_for(h, bucket), 1, True))
            bucket *= 2
    return cfgs


def _step_token_bounds(plan: KernelWarmupPlan) -> tuple[int, int]:
    """(fewest, most) tokens of a step: 1 .. max_num_batched_tokens (graph sizes never exceed it)."""
    return 1, max([plan.max_num_batched_tokens, *plan.decode_graph_sizes])


def silu_mul_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``(I, row_variant)``: the row variant for <= SMALL_ROWS rows, the tile variant above."""
    if plan.dtype != _BF16:
        return []
    sm = _kc("silu_mul")
    lo, hi = _step_token_bounds(plan)
    widths = [(i, lo, hi) for i in plan.mlp_intermediate_sizes]  # one row a token
    if plan.moe_gating is not None and plan.moe_intermediate_size:  # routed experts: top_k rows a token
        top_k = plan.moe_gating.top_k
        widths.append((plan.moe_intermediate_size, lo * top_k, hi * top_k))
    cfgs = []
    for inter, fewest, most in widths:
        if sm.supported(inter):
            if fewest <= sm.SMALL_ROWS:
                cfgs.append((inter, True))
            if most > sm.SMALL_ROWS:
                cfgs.append((inter, False))
    return list(dict.fromkeys(cfgs))


def moe_routing_configs(plan: KernelWarmupPlan, fused_add: bool = False, fused_scan: bool = False,
                        fused_route: bool = False) -> list[tuple]:
    """``(kind, cfg)`` of gating, permute and unpermute, each where its ``*_reason`` accepts a one-token step;
    ``fused_add``: also the un-permute with the shared experts' output fused (``moe_combine_add``); ``fused_scan``:
    the permute that writes the expert GEMMs' scan too (``moe_dispatch_scan``); ``fused_route``: the gating fused
    with that permute (``moe_route``) where both apply (one-token steps, which every plan reaches, are within its
    MAX_ROUTE_TOKENS)."""
    g = plan.moe_gating
    if g is None:
        return []
    mr = _kc("moe_routing")
    items = []
    # The router's correction bias (noaux_tc) is a CUDA tensor at run time; the check here is on the shapes.
    if mr.gating_reason(_meta(1, g.num_experts, dtype=torch.float32), None, g) is None:
        items.append(("gating", mr._gating_cfg(g, "torch_last", True)))  # the launch's own key
    dt = mr.DTYPES.get(plan.dtype)
    k, d = g.top_k, plan.hidden_size
    if dt is not None and mr.permute_reason(_meta(1, d, dtype=plan.dtype), _meta(1, k, dtype=torch.int32),
                                            g.num_experts) is None:
        items.append(("permute", (d, k, g.num_experts, dt)))
        if fused_scan and g.num_experts <= mr.MAX_SCAN_EXPERTS:
            items.append(("permute", (d, k, g.num_experts, dt, 128, True)))
        if fused_route and items and items[0][0] == "gating" and g.num_experts <= mr.MAX_SCAN_EXPERTS:
            items.append(("route", mr._route_cfg(g, d, dt, True)))  # the launch's own key (bias as for gating)
    if dt is not None and mr.unpermute_reason(_meta(k, d, dtype=plan.dtype), _meta(k), _meta(1, k,
                                              dtype=torch.float32), 1, k) is None:
        items.append(("unpermute", (d, k, dt, "torch_strided")))
        if fused_add:
            items.append(("unpermute", (d, k, dt, "torch_strided", 128, True)))
    return items


def moe_gemm_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``("gemm", (n, k, block_n))`` for w13 [E, 2I, D] and w2 [E, D, I] at the decode-sized row counts the kernel
    set routes to it, and ``("expert_scan", (E,))`` (compiled by its first launch)."""
    g = plan.moe_gating
    if g is None or plan.dtype != _BF16 or not plan.moe_intermediate_size:
        return []
    mg = _kc("moe_gemm")
    d, inter = plan.hidden_size, plan.moe_intermediate_size
    if not (mg.supported(2 * inter, d) and mg.supported(d, inter)):
        return []
    if g.num_experts > mg.MAX_EXPERTS:  # grouped_mlp takes torch._grouped_mm (the expert scan's limit)
        return []
    lo, hi = _step_token_bounds(plan)
    rows = range(lo * g.top_k, min(hi * g.top_k, MOE_GEMM_MAX_ROWS) + 1)
    items = [("gemm", (n, kk, bn)) for n, kk in ((2 * inter, d), (d, inter))
             for bn in sorted({mg.pick_block_n(n, r) for r in rows})]
    items.append(("expert_scan", (g.num_experts,)))
    return items


def moe_gemm_swap_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``kernels_cuda.moe_gemm_swap.config_for`` tuples (w13 gated, w2) at the row counts up to
    ``MOE_GEMM_SWAP_MAX_ROWS`` the steps reach, where grouped_mlp takes moe_gemm (whose scan it shares)."""
    g, inter, d = plan.moe_gating, plan.moe_intermediate_size, plan.hidden_size
    if g is None or not moe_gemm_configs(plan):
        return []
    sw = _kc("moe_gemm_swap")
    if not (sw.supported(2 * inter, d, True) and sw.supported(d, inter, False)):
        return []
    lo, hi = _step_token_bounds(plan)
    rows = range(lo * g.top_k, min(hi * g.top_k, MOE_GEMM_SWAP_MAX_ROWS) + 1)
    cfgs = [c for r in rows for c in (sw.config_for(2 * inter, d, r, True), sw.config_for(d, inter, r, False))]
    return list(dict.fromkeys(cfgs))


def skinny_gemm_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``kernels_cuda.skinny_gemm.config_for`` tuples: ``linear`` on every (in_features, dtype) of the model's
    weights (K <= DENSE_MAX_K) at each row block up to DENSE_MAX_ROWS tokens (fp32 weights: the router, fed fp32
    rows); the gated gate/up GEMM of the dense MLPs; the grouped expert GEMMs (w13 gated, w2) up to
    ``SKINNY_GROUPED_MAX_ROWS`` rows (0: off)."""
    sk = _kc("skinny_gemm")
    lo, hi = _step_token_bounds(plan)
    blocks = sorted({sk.rows_block(m) for m in range(lo, min(hi, sk.DENSE_MAX_ROWS) + 1)})
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    cfgs = []
    for k, dt in plan.linear_weights:
        if dt in name and k % sk.vec_for(name[dt]) == 0 and k <= sk.DENSE_MAX_K:
            if dt == plan.dtype:  # linear on the model's own dtype
                cfgs += [sk.config_for(k, rb, False, False, dt, dt, dt) for rb in blocks]
            elif dt == torch.float32 and plan.dtype == _BF16:  # the fp32 router on bf16 rows (router_logits)
                cfgs += [sk.config_for(k, rb, False, False, _BF16, dt, dt) for rb in blocks]
    if plan.dtype == _BF16 and plan.mlp_intermediate_sizes and plan.hidden_size % 8 == 0 \
            and plan.hidden_size <= sk.DENSE_MAX_K:
        cfgs += [sk.config_for(plan.hidden_size, rb, True, False, _BF16, _BF16, _BF16) for rb in blocks]
    if _cuda_kernels.SKINNY_W_UV and plan.dtype == _BF16 and lo <= 1 and plan.kv_lora_rank % 8 == 0:  # W_UV, 1 token
        cfgs.append(sk.config_for(plan.kv_lora_rank, sk.rows_block(1), False, True, _BF16, _BF16, _BF16))
    g, inter = plan.moe_gating, plan.moe_intermediate_size
    if g is not None and plan.dtype == _BF16 and inter and SKINNY_GROUPED_MAX_ROWS and moe_gemm_configs(plan):
        rows = range(lo * g.top_k, min(hi * g.top_k, SKINNY_GROUPED_MAX_ROWS) + 1)
        for rb in sorted({sk.rows_block(min(r, 2)) for r in rows}):  # skinny_gemm's grouped row block
            cfgs += [sk.config_for(plan.hidden_size, rb, True, True, _BF16, _BF16, _BF16),
                     sk.config_for(inter, rb, False, True, _BF16, _BF16, _BF16)]
    return list(dict.fromkeys(cfgs))


def spec_verify_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``(kind, cfg)``: the greedy arg-max, the noise arg-max (temperature rows without drafts: every prefill's
    sampled rows, and decode without speculation) and the accept kernel, where ``reason`` accepts them."""
    sv = _kc("spec_verify")
    v = plan.vocab_size

    def ok(greedy: bool, rows: int, max_q: int) -> bool:
        t = SimpleNamespace(all_greedy=greedy, need_top_k=False, need_top_p=False, max_num_logprobs=None)
        n = rows * max_q
        return sv.reason(_meta(n, v, dtype=torch.float32), _meta(n), _meta(n), _meta(n), rows, max_q, t) is None

    items = []
    if ok(True, 1, 1) or ok(True, 1, plan.num_speculative_tokens + 1):
        items += [("argmax", (v, False)), ("accept", ())]
    if ok(False, 1, 1):
        items += [("argmax", (v, True)), ("accept", ())]
    return list(dict.fromkeys(items))


def zos_fixup_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``("correct", ())`` (every decode step) and ``("resplit", (k, threads, rows_per_thread))`` per launch shape
    of 1 .. max_num_seqs rows when drafts are re-split on the device."""
    zf = _kc("zos_fixup")
    k, slots = plan.num_speculative_tokens, plan.max_num_seqs + 1
    i32 = torch.int32

    def ok(rows: int, resplit: bool) -> bool:
        extra = (_meta(slots, k, dtype=torch.float32), _meta(rows)) if resplit else ()
        return zf.reason(_meta(rows, dtype=i32), _meta(rows, dtype=i32), _meta(rows, dtype=torch.bool), _meta(rows),
                         _meta(slots), *extra) is None

    items = [("correct", ())] if ok(1, False) else []
    if plan.varlen and k:
        items += [("resplit", (k, *zf.resplit_launch(b))) for b in range(1, plan.max_num_seqs + 1) if ok(b, True)]
    return list(dict.fromkeys(items))


def decode_inputs_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``(block_size, threads)``: one build serves every decode step (the sizes are dynamic)."""
    di = _kc("decode_inputs")
    return [(plan.block_size, di.THREADS)]


def mla_absorb_configs(plan: KernelWarmupPlan) -> list[tuple]:
    """``config_for(H, N, L, N + R)``: W_UK of one token, for a bf16 model whose dims the kernel is built for (one
    build; a configuration whose steps never have one token, e.g. fixed-k speculation, compiles it needlessly)."""
    ma = _kc("mla_absorb")
    h, n, lrank, qd = plan.num_heads, plan.qk_nope_head_dim, plan.kv_lora_rank, plan.qk_nope_head_dim + \
        plan.qk_rope_head_dim
    if plan.dtype != _BF16 or ma.supported(h, n, lrank, qd) is not None:
        return []
    return [ma.config_for(h, n, lrank, qd)]


def reachable_configs(plan: KernelWarmupPlan, num_sms: int,
                      enabled: Callable[[str], bool] = unverified_kernel_enabled,
                      sm90: bool = True) -> dict[str, list[tuple]]:
    """``{kernels_cuda module: [config, ...]}`` in the form each module's ``precompile`` takes (module docstring), in
    compile order (the forward's, then verification and the ZOS correction); modules with nothing to compile are
    left out. ``enabled``: the unverified-kernel gate; ``sm90``: a Hopper device (``mla_decode_ws`` runs only there).
    """
    out = {
        "rms_norm": rms_norm_configs(plan),
        "mla_rope_cache": mla_rope_cache_configs(plan),
        "mla_decode": mla_decode_configs(plan, num_sms, prefill=enabled("mla_prefill"),
                                         warp_specialized=enabled("mla_decode_ws") and sm90 and _cuda_kernels.MLA_WS),
        "mla_absorb": mla_absorb_configs(plan) if enabled("mla_absorb") else [],
        "skinny_gemm": skinny_gemm_configs(plan) if enabled("skinny_gemm") else [],
        "silu_mul": silu_mul_configs(plan),
        "moe_routing": moe_routing_configs(plan, fused_add=enabled("moe_combine_add"),
                                           fused_scan=enabled("moe_dispatch_scan"), fused_route=enabled("moe_route")),
        "moe_gemm": moe_gemm_configs(plan),
        "moe_gemm_swap": moe_gemm_swap_configs(plan) if enabled("moe_gemm_swap") else [],
        "spec_verify": spec_verify_configs(plan) if enabled("spec_verify") else [],
        "zos_fixup": zos_fixup_configs(plan) if enabled("zos_fixup") else [],
        "decode_inputs": decode_inputs_configs(plan) if enabled("decode_inputs") else [],
    }
    return {name: cfgs for name, cfgs in out.items() if cfgs}


# ---- compiling ------------------------------------------------------------------------------------------------
def _compile_moe_gemm(mod, items: list[tuple], device: torch.device) -> None:
    """kernels_cuda.moe_gemm has no ``precompile``: its public ``get_kernel`` (one at a time), and ``expert_starts``
    on an all-zero count vector, which compiles the expert scan at its first launch."""
    for kind, cfg in items:
        if kind == "gemm":
            mod.get_kernel(*cfg)
        else:
            mod.expert_starts(torch.zeros(cfg[0], dtype=torch.int64, device=device))


def _compile(name: str, mod, cfgs: list[tuple], plan: KernelWarmupPlan, device: torch.device) -> None:
    if name == "mla_decode":
        mod.precompile(cfgs, softmax_scale=float(plan.softmax_scale))
    elif name == "moe_gemm":
        _compile_moe_gemm(mod, cfgs, device)
    else:
        mod.precompile(cfgs)


def _compiled_kernels(mod) -> list:
    """TileLang kernels held in a module's caches (dicts and lists of its globals)."""
    found = []
    for obj in list(vars(mod).values()):
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
        found += [v for v in list(values) if hasattr(getattr(v, "adapter", None), "get_exportable_executable")]
    return found


def _link(kernel) -> None:
    executable = kernel.adapter.get_exportable_executable()
    if hasattr(executable, "jit"):  # tvm.runtime.Executable: jit() builds and caches the runnable module
        executable.jit()


def _load_executables(mods: list) -> int:
    """Link and load each compiled kernel's host module now. TileLang builds it at a kernel's first call (a gcc run
    of the host wrapper, ~130 ms on an H200 host): seen as 0.5 s inside the first decode steps of a DFlash + varlen
    run whose kernels the warm-up had compiled but not called. Kernels loaded from TileLang's disk cache have it."""
    import concurrent.futures as cf

    kernels = [k for m in mods for k in _compiled_kernels(m)]
    with cf.ThreadPoolExecutor(max(1, min(16, len(kernels)))) as ex:
        list(ex.map(_link, kernels))
    return len(kernels)


def _counts(configs: dict[str, list[tuple]]) -> str:
    if not configs:
        return "no TileLang kernel applies"
    parts = []
    for name, cfgs in configs.items():
        n_prefill = sum(1 for c in cfgs if name == "mla_decode" and len(c) == 4)
        parts.append(f"{name}: {len(cfgs)}" + (f" ({n_prefill} prefill)" if n_prefill else ""))
    return ", ".join(parts)


def _device_is_sm90() -> bool:
    """The current CUDA device is a Hopper (mla_decode_ws' kernels run only there)."""
    return torch.cuda.is_available() and is_sm90(torch.cuda.current_device())


def warm_up(kernels: Any, plan: KernelWarmupPlan) -> str:
    """Compile every configuration of :func:`reachable_configs` for ``kernels`` (a ``CudaKernelSet``), module by
    module; -> ``"N configs in X s (module: n, ...)"`` plus the modules that failed or were skipped. A module that
    fails is turned off in the kernel set (its ops then run the reference, with this reason)."""
    t0 = time.perf_counter()
    if not tilelang_importable():
        return "nothing to warm up: tilelang is not installed (every TileLang op runs the reference)"
    try:
        num_sms = kernels.num_sms
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            kernels.num_sms = num_sms
        configs = reachable_configs(plan, num_sms, sm90=_device_is_sm90())
    except Exception as e:  # noqa: BLE001 - a bug here must not stop start-up; the kernels compile at first use
        logger.warning("kernel warm-up skipped: listing the configurations failed: %s: %s", type(e).__name__, e)
        return f"skipped: listing the configurations failed: {type(e).__name__}: {e}"
    skipped: dict[str, str] = {}
    for name in list(configs):
        if kernels._kernel(name) is None:  # imports the module as the op would; keeps the reason
            skipped[name] = kernels._kernel_error[name]
            del configs[name]
    total = sum(len(c) for c in configs.values())
    logger.info("kernel warm-up: compiling %d TileLang kernel configs (%s) ...", total, _counts(configs))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    failed: dict[str, str] = {}
    for i, (name, cfgs) in enumerate(configs.items(), 1):
        t1 = time.perf_counter()
        try:
            _compile(name, kernels._kernel(name), cfgs, plan, device)
        except Exception as e:  # noqa: BLE001 - never fail start-up: the ops fall back to the reference
            why = f"warm-up compile failed: {type(e).__name__}: {str(e).strip()[:200]}"
            failed[name] = why
            kernels._kernel_modules[name] = None  # what _kernel() returns from now on: the op takes the reference
            kernels._kernel_error[name] = f"kernels_cuda.{name} {why}"
            logger.warning("kernel warm-up: kernels_cuda.%s %s; its ops fall back to the reference", name, why)
            continue
        logger.info("kernel warm-up [%d/%d]: kernels_cuda.%s, %d configs in %.1f s", i, len(configs), name,
                    len(cfgs), time.perf_counter() - t1)
    done = {n: c for n, c in configs.items() if n not in failed}
    try:
        loaded = _load_executables([kernels._kernel(n) for n in done])
        logger.info("kernel warm-up: %d kernels linked and loaded", loaded)
    except Exception as e:  # noqa: BLE001 - the first call links them instead
        logger.warning("kernel warm-up: loading the compiled kernels failed (%s: %s); the first calls will",
                       type(e).__name__, e)
    summary = f"{sum(len(c) for c in done.values())} configs in {time.perf_counter() - t0:.1f} s ({_counts(done)})"
    if failed:
        summary += "; failed: " + ", ".join(f"{n} ({why})" for n, why in failed.items())
    if skipped:
        summary += "; skipped: " + ", ".join(f"{n} ({why})" for n, why in skipped.items())
    logger.info("kernel warm-up: %s", summary)
    return summary
