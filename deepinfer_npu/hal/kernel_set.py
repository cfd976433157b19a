"""The KernelSet contract: every device op the models call, with shapes.

Each op is an abstract method whose docstring is its contract. The HAL's declared reference is the CPU backend's
``CpuKernelSet`` (plain, device-agnostic torch; it sets :attr:`KernelSet.IS_REFERENCE`). A device backend
subclasses it and overrides the ops it has native kernels for: every other op runs the reference on the device's
tensors and ``op_report()`` lists it as a fallback, so a backend is usable at once and honest about what is
native. The dependency runs one way: backends import the HAL, never the reverse.

Notation: ``T`` tokens in the step, ``B`` requests, ``H`` heads, ``D`` hidden size, ``L`` kv_lora_rank,
``R`` qk_rope_head_dim, ``E`` routed experts, ``k`` experts per token, ``I`` expert intermediate size.
Tensors live on the backend's device; activations use the model dtype unless stated (router math is fp32).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .types import DispatchState, EPDispatched, GatingParams, KernelWarmupPlan, MLAWeights, RopeLike


class KernelSet(abc.ABC):
    """The op contract (abstract ops) plus composites built from the ops, warm-up and reporting hooks."""

    #: Op names in contract order; ``op_report`` walks this list.
    OPS: tuple[str, ...] = (
        "rms_norm",
        "add_rms_norm",
        "linear",
        "silu_and_mul",
        "rope",
        "mla_prolog",
        "mla_attention",
        "mla_epilogue",
        "moe_gating_topk",
        "moe_dispatch",
        "grouped_mlp",
        "moe_combine",
        "spec_verify",
        "zos_fixup",
        "decode_inputs",
        "copy_kv_blocks",
    )
    #: Optional per-op reasons shown in ``op_report`` for ops a subclass deliberately leaves on the reference.
    FALLBACK_REASONS: dict[str, str] = {}
    #: True on the reference kernel set only: its ops are native there and fallbacks in the classes inheriting them.
    IS_REFERENCE: ClassVar[bool] = False

    # ---- norms / dense -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` [..., N], ``weight`` [N] -> [..., N] in ``x``'s dtype; statistics in fp32."""

    @abc.abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused residual add + norm: returns ``(rms_norm(x + residual), x + residual)``; shapes [T, N]."""

    @abc.abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., in] @ ``weight`` [out, in]^T (+ ``bias`` [out]) -> [..., out]."""

    @abc.abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU activation: ``x`` [..., 2I] = [gate | up] -> ``silu(gate) * up`` [..., I]."""

    def dense_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Composite of the ops above, the dense SwiGLU MLP: ``linear(silu_and_mul(linear(x, gate_up)), down)``
        with ``gate_up`` [2I, D] = [gate | up] and ``down`` [D, I]. Not in :attr:`OPS` (its parts are reported);
        a backend may fuse it (CUDA fuses the activation into the gate/up GEMM at decode sizes), with the same
        roundings as the composition."""
        return self.linear(self.silu_and_mul(self.linear(x, gate_up)), down)

    def router_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Composite, not in :attr:`OPS`: the MoE router's fp32 logits ``linear(hidden.float(), weight)`` for
        ``hidden`` [T, D] in the model dtype and ``weight`` [E, D] fp32. CUDA reads bf16 rows directly (the
        conversion to fp32 is exact) instead of launching the cast."""
        return self.linear(hidden.float(), weight)

    def run_parallel(
        self, main: Callable[[], Any], *side: Callable[[], Any], rows: int | None = None
    ) -> list[Any]:
        """Independent branches of a forward (e.g. the shared experts next to the routed ones) ->
        ``[main(), *(f() for f in side)]``. No branch may read another's outputs. A backend may overlap them
        (CUDA: the side branches on a second stream forked from the current one and joined back, inside CUDA
        graph capture too), which hides the small kernels of one branch behind the other at decode sizes.
        ``rows``: the token rows the branches work on (host int), for a backend whose choice depends on the size.
        Default: in order on the current stream."""
        return [main(), *(f() for f in side)]

    # ---- attention -----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
    ) -> torch.Tensor:
        """Rotary embedding. ``x`` [T, H, R], ``positions`` [T] int64, ``cos_sin_cache`` [max_pos, R] fp32
        (cos in the first R/2 columns, sin in the last; YaRN attention factor already folded in).
        ``interleaved``: pairs ``(x[2i], x[2i+1])`` rotate by frequency i (DeepSeek layout), else halves
        ``(x[i], x[i+R/2])`` (NeoX layout). Returns a new [T, H, R] tensor in the same layout as ``x``."""

    @abc.abstractmethod
    def mla_prolog(
        self,
        hidden: torch.Tensor,
        w: MLAWeights,
        positions: torch.Tensor,
        rope: RopeLike,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA front half: ``hidden`` [T, D] (input-normed) -> ``(q_latent [T, H, L], q_rope [T, H, R])``.

        q = q_proj(hidden) or q_b_proj(rms_norm(q_a_proj(hidden))), split into nope [T, H, N] and rope parts;
        ``q_latent = q_nope @ w_uk`` (absorption), ``q_rope = rope(q_rope)``. Side effect: writes
        ``rms_norm(c_kv) ‖ rope(k_pe)`` ([T, L+R]) into ``kv_cache`` [num_blocks, block_size, L+R] at
        ``slot_mapping`` [T] int64 (``block * block_size + offset``; negative slots are skipped = padding).
        """

    @abc.abstractmethod
    def mla_attention(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seqlens_q: torch.Tensor,
        seqlens_k: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        softmax_scale: float,
        host=None,
        max_seqlen_q: int | None = None,
        is_prefill: bool | None = None,
    ) -> torch.Tensor:
        """Absorbed MLA over the paged latent cache -> ``out_latent`` [T, H, L].

        ``host`` (``HostLengths`` or None): host copies of the lengths for kernels whose API takes host ints;
        under ZOS its ``seqlens_k`` are upper bounds (``seqlens_k_exact`` False) and the tensors are the truth.
        ``max_seqlen_q``: a host bound on any request's query length (``AttentionMetadata.max_seqlen_q``; k + 1
        after a device re-split, when ``host`` is None), for kernels compiled per query-length bucket; None =
        unknown. The reference ignores it. ``is_prefill``: the step is a prefill step
        (``AttentionMetadata.is_prefill``; None = unknown), so a backend may serve short chunks on its prefill
        kernel rather than compile decode variants for them; the reference ignores it.

        ``q_latent`` [T, H, L], ``q_rope`` [T, H, R]; keys are the cache rows [L+R] (the first L are also the
        values). ``block_tables`` [B, nb] int32, ``seqlens_q``/``seqlens_k`` [B], ``cu_seqlens_q`` [B+1]
        int32. Causal: query j of request b sits at position ``seqlens_k[b] - seqlens_q[b] + j`` and sees keys
        at positions <= its own. Scores ``(q_latent·c + q_rope·k_rope) * softmax_scale``; softmax in fp32.
        """

    @abc.abstractmethod
    def mla_epilogue(self, out_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
        """MLA back half: ``out_latent`` [T, H, L] -> values (``w_uv`` [H, V, L]) -> ``o_proj`` -> [T, D]."""

    def mla_forward(self, hidden: torch.Tensor, w: MLAWeights, positions: torch.Tensor, rope: RopeLike,
                    kv_cache: torch.Tensor, attn, softmax_scale: float) -> torch.Tensor:
        """Composite, not in :attr:`OPS`: one MLA layer, ``hidden`` [T, D] (input-normed) -> [T, D], writing this
        step's latents into ``kv_cache``; ``attn`` is the step's ``AttentionMetadata``. Default: ``mla_prolog``,
        ``mla_attention``, ``mla_epilogue`` (the absorbed form). A backend may run prefill steps another way with
        the same result (CUDA: decompressed keys and flash attention)."""
        q_latent, q_rope = self.mla_prolog(hidden, w, positions, rope, kv_cache, attn.slot_mapping)
        out_latent = self.mla_attention(
            q_latent, q_rope, kv_cache, attn.block_tables, attn.seqlens_q, attn.seqlens_k, attn.cu_seqlens_q,
            softmax_scale, host=attn.host,
            max_seqlen_q=attn.max_seqlen_q,  # k + 1 after a device re-split (host None): keeps the decode kernel
            is_prefill=attn.is_prefill,
        )
        return self.mla_epilogue(out_latent, w)

    # ---- MoE -----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def moe_gating_topk(
        self, router_logits: torch.Tensor, bias: torch.Tensor | None, params: GatingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek gating. ``router_logits`` [T, E] fp32, ``bias`` [E] fp32 (``e_score_correction_bias``,
        noaux_tc only) -> ``(weights [T, k] fp32, ids [T, k] int32)``; weights include normalisation
        (``norm_topk_prob``) and ``routed_scaling_factor``. The order of the k choices is unspecified."""

    @abc.abstractmethod
    def moe_dispatch(
        self, hidden: torch.Tensor, ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """Permute token copies so each expert's rows are contiguous (expert 0 first).

        ``hidden`` [T, D], ``ids`` [T, k] -> ``(sorted_hidden [T*k, D], tokens_per_expert [E] int64, state)``.
        """

    @abc.abstractmethod
    def grouped_mlp(
        self,
        sorted_hidden: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        """Per-expert SwiGLU MLP over contiguous row groups: ``sorted_hidden`` [M, D] -> [M, D], with
        ``w13`` [E, 2I, D] (gate rows then up rows) and ``w2`` [E, D, I]."""

    @abc.abstractmethod
    def moe_combine(
        self, expert_out: torch.Tensor, state: DispatchState, weights: torch.Tensor
    ) -> torch.Tensor:
        """Undo the permutation and sum each token's k expert outputs weighted by ``weights`` [T, k] -> [T, D]
        (accumulated in fp32, returned in ``expert_out``'s dtype)."""

    def moe_route(self, router_logits: torch.Tensor, bias: torch.Tensor | None, params: GatingParams,
                  hidden: torch.Tensor, num_experts: int):
        """Composite, not in :attr:`OPS` (its parts are reported): ``moe_gating_topk`` then ``moe_dispatch`` ->
        ``(weights [T, k] fp32, ids [T, k] int32, sorted_hidden [T*k, D], tokens_per_expert [E] int64,
        DispatchState)``. A backend may do both in one kernel at decode sizes (CUDA, gated until checked)."""
        weights, ids = self.moe_gating_topk(router_logits, bias, params)
        sorted_hidden, tokens_per_expert, state = self.moe_dispatch(hidden, ids, num_experts)
        return weights, ids, sorted_hidden, tokens_per_expert, state

    def moe_combine_add(
        self, expert_out: torch.Tensor, state: DispatchState, weights: torch.Tensor, addend: torch.Tensor
    ) -> torch.Tensor:
        """Composite, not in :attr:`OPS`: ``moe_combine(expert_out, state, weights) + addend`` with ``addend``
        [T, D] in ``expert_out``'s dtype (the MoE layer's routed output plus its shared experts'), the combine
        rounded to the dtype before the add. A backend may fuse the add into the combine (CUDA: one kernel)."""
        return self.moe_combine(expert_out, state, weights) + addend

    # ---- expert parallelism (not in OPS: distributed/ep_report.py reports their path) ---------------------------
    @abc.abstractmethod
    def ep_dispatch(self, hidden: torch.Tensor, slots: torch.Tensor, placement: Any, group: Any,
                    weights: torch.Tensor | None = None) -> EPDispatched:
        """Send each (token, choice) row to the rank owning its physical expert slot; -> this rank's received rows
        sorted by local slot, with ``tokens_per_slot`` [slots_per_rank] int64 on the device.

        ``hidden`` [T, D] (T may be 0), ``slots`` [T, k] physical slot ids (``ExpertPlacement.route``),
        ``placement`` the layer's ``ExpertPlacement`` (``slots_per_rank`` consecutive slots a rank), ``group`` the
        EP process group. ``weights`` [T, k] fp32: the router weights ``ep_combine`` will get, for a path whose
        dispatch carries them (DeepEP weights the outputs on the expert's rank); None where the caller has none
        yet (such a path then steps aside). Every rank of the group calls it in the same order (a collective)."""

    @abc.abstractmethod
    def ep_combine(self, expert_out: torch.Tensor, dispatched: EPDispatched, weights: torch.Tensor,
                   group: Any) -> torch.Tensor:
        """Bring ``expert_out`` [R, D] (``dispatched.rows``' order) back to the ranks that sent the rows and sum each
        token's k outputs weighted by ``weights`` [T, k] in fp32, in the single-device ``moe_combine``'s order
        -> [T, D] in ``expert_out``'s dtype. A collective, like ``ep_dispatch``."""

    # ---- speculative decoding -------------------------------------------------------------------------------
    @abc.abstractmethod
    def spec_verify(self, logits, draft_next, row_of_token, j_of_token, num_rows: int, max_q: int, t,
                    ban_mask=None):
        """Verify a decode step's drafts (greedy: longest matching prefix + bonus; sampling: lossless rejection
        sampling with one-hot proposals) -> ``VerifyOutput``. Contract in ``backends/cpu/spec_verify.py``. When
        ``t.needs_processing`` the target distribution also gets the logit bias, penalties and ``min_p`` of
        ``backends/cpu/logits_processors.py`` (every backend calls those torch functions; no host sync)."""

    @abc.abstractmethod
    def zos_fixup(self, seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None, caps=None):
        """Correct an optimistically scheduled step on the device (``seqlens_k`` by accepted counts, ``seqlens_q``
        re-split by confidences) -> ``(seqlens_q, seqlens_k)``. Contract in ``backends/cpu/zos.py``."""

    @abc.abstractmethod
    def decode_inputs(self, seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts,
                      block_size: int, num_tokens: int):
        """A decode step's per-token inputs on the device (positions, cache slots,
        ``cu_seqlens_q``, row / offset of each token, input ids from the slot state, the next draft of each token)
        from the lengths ``zos_fixup`` corrected, with no host read -> ``DecodeInputs``. Contract and reference in
        ``backends/cpu/step_inputs.py``."""

    # ---- KV cache blocks -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def copy_kv_blocks(self, caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Fork copy-on-write: in every cache of ``caches`` (the KV caches of one layout, e.g. all main-model and
        drafter layers), block ``dst[i]`` becomes a copy of block ``src[i]``; ``src`` / ``dst`` [C] int64 on the
        device. In place; sources are all read before destinations are written. Reference: ``index_copy_`` on
        dim 0 of each ``[num_blocks, block_size, L+R]`` cache (``backends/cpu/cache_ops.py``). A backend that
        stores the cache in another layout (Ascend's split k_nope / k_rope caches) copies in that layout."""

    def plan_for_model(self, model_config, dtype: torch.dtype, block_size: int) -> None:
        """Decide model-dependent op choices ahead of the first forward (``--list-ops`` shows them). Backends
        whose native kernels depend on the model's shapes override this; the default decides at first call."""

    def quantization_capture_refusal(self, quantization: str | None, hidden_size: int = 0,
                                     moe_intermediate_size: int = 0) -> str | None:
        """Why decode graphs cannot capture this engine's quantised ops, or None. Default: quantised models run
        eagerly (the reference grouped expert op reads its token counts on the host). ``hidden_size`` and
        ``moe_intermediate_size`` (0: no MoE layer) are the model's, for kernels that serve some shapes only."""
        if quantization is None:
            return None
        return f"quantization={quantization!r} runs reference ops that read device values on the host"

    def warmup(self, plan: KernelWarmupPlan) -> str:
        """Build every kernel variant the engine can reach for ``plan`` now, so that no step stalls on a first-use
        compile (a second or more per TileLang configuration on CUDA). The worker calls it once at start-up, after
        the model is loaded and before any graph is captured (``EngineConfig.kernel_warmup``). Must not raise for a
        kernel that fails to build: that op falls back (``op_report`` says why) and the summary names it.
        Returns a one-line summary. Default: nothing is compiled ahead of use."""
        return "nothing to warm up"

    def start_early_warmup(self, plan: KernelWarmupPlan) -> str | None:
        """Start building ``plan``'s kernel variants in the background before the model's weights are loaded
        (``plan``: the engine's expected plan, from the model as built); :meth:`warmup` waits for them later.
        -> a one-line note, None when this kernel set builds nothing ahead of use (the default)."""
        return None

    # ---- reporting -----------------------------------------------------------------------------------------
    def op_report(self) -> dict[str, str]:
        """``{op: "native" | "fallback (reason)"}``: an op is a fallback when this class inherits it from the
        reference kernel set without being the reference itself."""
        report = {}
        for op in self.OPS:
            owner = next(c for c in type(self).__mro__ if op in vars(c))
            if owner is type(self) or not vars(owner).get("IS_REFERENCE", False):
                report[op] = "native"
            else:
                reason = self.FALLBACK_REASONS.get(op, "no native kernel; runs the CPU reference op")
                report[op] = f"fallback ({reason})"
        return report

    # ---- quantised weights (model_executor/quantization; reference in backends/cpu/quant.py) ----------------
    OPS = OPS + ("fp8_linear", "fp8_grouped_mlp", "w8a8_linear", "w8a8_grouped_mlp", "mla_prolog_quant",
                 "mla_epilogue_quant")

    @abc.abstractmethod
    def fp8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """W8A8 FP8 GEMM: ``x`` [..., K] (model dtype) quantised per token in 1 x 128 groups along K to e4m3 with fp32
        scales (``amax / 448``), times ``weight`` [N, K] float8_e4m3fn with ``weight_scale_inv`` [ceil(N/128),
        ceil(K/128)] fp32 (one scale per 128 x 128 tile), fp32 accumulation, (+ ``bias`` [N]) -> [..., N] in
        ``x``'s dtype. The reference dequantises both operands and multiplies in fp32 (DeepGEMM's numerics)."""

    def fp8_dense_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale_inv: torch.Tensor,
                      down: torch.Tensor, down_scale_inv: torch.Tensor) -> torch.Tensor:
        """Composite, not in :attr:`OPS`: the dense SwiGLU MLP over FP8 weights,
        ``fp8_linear(silu_and_mul(fp8_linear(x, gate_up)), down)``. A backend may fuse the activation into the
        second quantisation (CUDA), with the same roundings as the composition."""
        return self.fp8_linear(self.silu_and_mul(self.fp8_linear(x, gate_up, gate_up_scale_inv)), down,
                               down_scale_inv)

    @abc.abstractmethod
    def fp8_grouped_mlp(
        self,
        sorted_hidden: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        w13: torch.Tensor,
        w13_scale_inv: torch.Tensor,
        w2: torch.Tensor,
        w2_scale_inv: torch.Tensor,
    ) -> torch.Tensor:
        """``grouped_mlp`` over FP8 experts: ``w13`` [E, 2I, D] and ``w2`` [E, D, I] float8_e4m3fn with block scales
        [E, ceil(2I/128), ceil(D/128)] and [E, ceil(D/128), ceil(I/128)]; both GEMMs are ``fp8_linear``'s (the
        SwiGLU output is quantised per token group again) -> [M, D] in ``sorted_hidden``'s dtype."""

    @abc.abstractmethod
    def w8a8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """INT8 W8A8 GEMM: ``x`` [..., K] quantised per token to int8 (symmetric, ``amax / 127``; Ascend's
        ``npu_dynamic_quant``), times ``weight`` [N, K] int8 with ``weight_scale`` [N] fp32 (per output channel),
        exact int32 accumulation, both scales applied in fp32 (+ ``bias`` [N]) -> [..., N] in ``x``'s dtype."""

    @abc.abstractmethod
    def w8a8_grouped_mlp(
        self,
        sorted_hidden: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
    ) -> torch.Tensor:
        """``grouped_mlp`` over INT8 experts: ``w13`` [E, 2I, D] / ``w2`` [E, D, I] int8 with per-channel scales
        [E, 2I] / [E, D]; both GEMMs are ``w8a8_linear``'s -> [M, D] in ``sorted_hidden``'s dtype."""

    @abc.abstractmethod
    def mla_prolog_quant(
        self,
        hidden: torch.Tensor,
        w: MLAWeights,
        scales: dict[str, torch.Tensor],
        positions: torch.Tensor,
        rope: RopeLike,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``mla_prolog`` with the projections ``w.q_proj`` (or ``w.q_a_proj`` and ``w.q_b_proj``) and ``w.kv_a_proj``
        quantised: float8_e4m3fn run as ``fp8_linear``, int8 as ``w8a8_linear``, with ``scales[field name]`` their
        scales; ``w_uk`` and the norms in the model dtype. Same outputs and cache write as ``mla_prolog``."""

    @abc.abstractmethod
    def mla_epilogue_quant(
        self, out_latent: torch.Tensor, w: MLAWeights, scales: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``mla_epilogue`` with ``w.o_proj`` quantised (``fp8_linear`` / ``w8a8_linear`` by dtype,
        ``scales["o_proj"]``); ``w_uv`` in the model dtype -> [T, D]."""
