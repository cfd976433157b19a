"""``mla_prolog``: the reference's arithmetic (``backends/cpu/mla.py``) with the projections through the kernel
set's ``linear``; the query's first projection and kv_a as one GEMM (``MLAWeights.fused_a_proj``: one
``skinny_gemm`` launch for one row, one cuBLAS GEMM at more rows in decode steps, ``fused_rows``); W_UK on
``kernels_cuda.mla_absorb`` for one row, else cuBLAS' batched GEMM. The tail (kv_a
layernorm, both ropes, the latent-cache write) is one ``kernels_cuda.mla_rope_cache`` launch for bf16 on the DeepSeek
dims (a packed FP8 cache: that kernel into scratch rows, then ``kernels_cuda.fp8_quant`` and the packed write); else
composed torch with a cache write that needs no host read."""

from __future__ import annotations

import torch

from deepinfer_npu import envs
from deepinfer_npu.hal.types import KernelWarmupPlan, MLAWeights, RopeLike
from deepinfer_npu.model_executor.quantization.kv_fp8 import FP8_KV_DTYPE, pack_fp8_latents

from .base import BF16, NOT_ON_DEVICE, OpConfig, OpImpl, kernel_module, ref, step_token_bounds
from .mla_attention import KV_LORA, PAGE, ROPE, mla_dims_refusal
from .norms import norm_configs


class MLAProlog(OpImpl):
    KERNELS = ("mla_rope_cache", "mla_absorb")
    PRIMARY = {"mla_prolog": "mla_rope_cache"}
    PLANNED = {
        "mla_prolog": "kernels_cuda.mla_rope_cache (kv_a_layernorm + both ropes + cache write in one kernel) for "
        "bf16, kv_lora 512 + rope 64, page 64; else composed torch with a sync-free cache write; for one row the "
        "q / q_a and kv_a projections as one skinny_gemm launch (fused_a_proj) and W_UK on kernels_cuda.mla_absorb",
    }
    SYNCING = {"mla_prolog": "boolean-mask cache write (slot_mapping >= 0)"}

    def refuses(self, name: str, cfg: OpConfig) -> str | None:
        return mla_dims_refusal(name, cfg) if name == "mla_rope_cache" else None

    def mla_prolog(self, hidden: torch.Tensor, w: MLAWeights, positions: torch.Tensor, rope: RopeLike,
                   kv_cache: torch.Tensor, slot_mapping: torch.Tensor, absorb: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Padding rows (negative slots) write nothing: the kernel skips them; the composed cache write rewrites
        slot 0 (block 0, the reserved padding block that no sequence owns) with its own current contents.
        ``absorb=False``: the whole projected query [T, H, N + R] (its rope part not rotated: q_rope is) instead
        of ``q_latent`` (prefill on decompressed keys, ``mla_prefill_mha.py``, writes q_rope into it)."""
        ks = self.ks
        lin = ks.linear
        num_tokens = hidden.shape[0]
        nope, rdim = w.qk_nope_head_dim, w.qk_rope_head_dim

        def q_branch(first=None):  # first: the query's first projection, already computed
            if w.q_proj is not None:
                q = lin(hidden, w.q_proj) if first is None else first
            else:
                qa = lin(hidden, w.q_a_proj, w.q_a_bias) if first is None else first
                q = lin(ks.rms_norm(qa, w.q_a_layernorm, w.norm_eps), w.q_b_proj)
            q = q.view(num_tokens, w.num_heads, nope + rdim)
            return q, (self.absorb_q(q, w) if absorb else q)

        fused = self.fused_a_proj(hidden, w, absorb)
        if fused is not None:  # one GEMM for both projections
            first, kv = fused
            q, q_latent = q_branch(first)
        else:  # the latent projection does not wait for the query's GEMMs (a second stream at decode sizes)
            (q, q_latent), kv = ks.run_parallel(q_branch, lambda: lin(hidden, w.kv_a_proj, w.kv_a_bias),
                                                rows=num_tokens)
        return q_latent, self.rope_and_cache(q, kv, w, positions, rope, kv_cache, slot_mapping)

    def rope_and_cache(self, q: torch.Tensor, kv: torch.Tensor, w: MLAWeights, positions: torch.Tensor,
                       rope: RopeLike, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       op: str = "mla_prolog") -> torch.Tensor:
        """The prolog's tail after the projections (``q`` [T, H, N + R], ``kv`` [T, L + R]): the query's rope part
        rotated -> q_rope [T, H, R], and ``kv_cache`` written at each slot >= 0 with rms_norm(c_kv) and the rotated
        k_pe. One ``kernels_cuda.mla_rope_cache`` launch where it applies, else composed torch; reported under
        ``op`` (the FP8 prolog shares it)."""
        nope, rdim, lrank = w.qk_nope_head_dim, w.qk_rope_head_dim, w.kv_lora_rank
        num_tokens = q.shape[0]
        q_pe = q[..., nope:]
        mod = None
        fp8_cache = kv_cache.dtype == FP8_KV_DTYPE
        quant = self.ks.impl("quant").use("fp8_quant")[0] if fp8_cache else None
        if not kv.is_cuda:
            why = NOT_ON_DEVICE
        elif fp8_cache and quant is None:
            why = "packed FP8 cache without kernels_cuda.fp8_quant"
        elif any(t.dtype != BF16 for t in (q, kv, w.kv_a_layernorm)) or not (fp8_cache or kv_cache.dtype == BF16):
            why = f"{kv.dtype} (cache {kv_cache.dtype}): kernels_cuda.mla_rope_cache is bf16-only"
        elif lrank != KV_LORA or rdim != ROPE:
            why = f"kv_lora {lrank} + rope {rdim}: kernel built for the DeepSeek dims {KV_LORA} + {ROPE}"
        elif kv_cache.dim() != 3 or kv_cache.shape[1] != PAGE or not kv_cache.is_contiguous():
            why = f"cache block {tuple(kv_cache.shape[1:])}, contiguous={kv_cache.is_contiguous()}: kernel writes " \
                f"contiguous pages of {PAGE}"
        elif rope.cos_sin_cache.dtype != torch.float32 or rope.cos_sin_cache.shape[-1] != rdim:
            why = f"cos_sin_cache {rope.cos_sin_cache.dtype} width {rope.cos_sin_cache.shape[-1]}: kernel reads fp32 " \
                f"rows of {ROPE}"
        elif (found := self.use("mla_rope_cache"))[0] is None:
            why = found[1]
        elif not found[0].supported_heads(w.num_heads):
            why = f"H={w.num_heads}: kernel rotates 16 heads a CTA (H a multiple of 16, or 1, 2, 4, 8)"
        else:
            mod, why = found[0], None
        if why is None and fp8_cache:
            self.note(op, f"kernels_cuda.mla_rope_cache into scratch bf16 rows + kernels_cuda.fp8_quant + a "
                      f"sync-free write (packed FP8 cache, H={w.num_heads})", True)
            return self._rope_and_fp8_cache(mod, quant, q, kv, w, positions, rope, kv_cache, slot_mapping)
        if why is None:
            self.note(op, f"kernels_cuda.mla_rope_cache (bf16, H={w.num_heads}, interleaved="
                      f"{bool(rope.interleaved)}): kv_a_layernorm + ropes + sync-free cache write in one kernel", True)
            return mod.mla_rope_cache(kv, w.kv_a_layernorm, float(w.norm_eps), q, nope, positions,
                                      rope.cos_sin_cache, rope.interleaved, kv_cache, slot_mapping)
        self.note(op, f"composed torch, sync-free cache write ({why})", True)
        q_rope = ref("rope").rope(q_pe, positions, rope.cos_sin_cache, rope.interleaved)
        c_kv, k_pe = kv.split([lrank, rdim], dim=-1)
        c_kv = self.ks.rms_norm(c_kv, w.kv_a_layernorm, w.norm_eps)
        k_pe = ref("rope").rope(k_pe.unsqueeze(1), positions, rope.cos_sin_cache, rope.interleaved).squeeze(1)
        if num_tokens:
            write_kv_cache_sync_free(kv_cache, torch.cat((c_kv, k_pe), dim=-1), slot_mapping, lrank)
        return q_rope

    def _rope_and_fp8_cache(self, mod, quant, q, kv, w: MLAWeights, positions, rope: RopeLike, kv_cache,
                            slot_mapping) -> torch.Tensor:
        """The tail for a packed FP8 cache on kernels that exist for the bf16 one: ``mla_rope_cache`` writes the
        tokens' bf16 rows (rms_norm(c_kv) ‖ rope(k_pe)) into a scratch page set, ``fp8_quant`` quantises their
        latents (the bytes and scales ``pack_fp8_latents`` makes), and the packed rows go to their slots without a
        host read: about nine launches a layer instead of the composed tail's ~35."""
        lrank, num_tokens = w.kv_lora_rank, q.shape[0]
        pages = max(1, -(-num_tokens // PAGE))
        scratch = torch.empty(pages, PAGE, lrank + w.qk_rope_head_dim, dtype=BF16, device=kv.device)
        rows = torch.arange(num_tokens, device=kv.device)  # every token's row (a padding token's too: unused)
        q_rope = mod.mla_rope_cache(kv, w.kv_a_layernorm, float(w.norm_eps), q, w.qk_nope_head_dim, positions,
                                    rope.cos_sin_cache, rope.interleaved, scratch, rows)
        latents = scratch.view(-1, scratch.shape[-1])[:num_tokens]
        if num_tokens:
            codes, scales = quant.quantize(latents[:, :lrank].contiguous())
            packed = torch.cat((codes.view(torch.uint8), scales.view(torch.uint8),
                                latents[:, lrank:].view(torch.uint8)), dim=-1)
            write_rows_sync_free(kv_cache, packed, slot_mapping)
        return q_rope

    def absorb_q(self, q: torch.Tensor, w: MLAWeights) -> torch.Tensor:
        """W_UK of the query: ``kernels_cuda.mla_absorb`` for one bf16 token (a TileLang kernel, so the
        programmatic launch chain goes on); else cuBLAS' batched GEMM (``absorb_heads``, the reference's
        arithmetic)."""
        if q.shape[0] == 1:
            mod, path = self.checked("mla_absorb", q, q, w.w_uk)
            if mod is not None:
                self.note("mla_prolog", "W_UK of one token: kernels_cuda.mla_absorb", True)
                return mod.absorb_q(q, w.w_uk)
            self.note("mla_prolog", f"W_UK of one token: cuBLAS batched GEMM ({path})", False)
        return absorb_heads(q[..., : w.qk_nope_head_dim], w.w_uk)

    def fused_a_proj(self, hidden: torch.Tensor, w: MLAWeights, absorb: bool = True):
        """``w.fused_a_proj`` set: the query's first projection and kv_a (q_proj or q_a_proj, then kv_a_proj: the
        same input) as one GEMM -> (first, kv) views of its output; None where it does not apply.

        One row: one ``skinny_gemm`` launch, which computes each output column alone (a warp per column, the same K
        order), so the columns are bit-identical to the two separate launches. More rows (:func:`fused_rows`): one
        cuBLAS GEMM [T, H x (N + R) + L + R] instead of two on two streams, where the query is q_proj's (no q-LoRA)
        and the step absorbs it (decode): q and kv stay column slices of the one output, which W_UK's batched GEMM
        and ``mla_rope_cache`` read in place (each column the same dot product; cuBLAS may order its K sums
        differently for another N)."""
        fused = w.fused_a_proj
        if fused is None or hidden.dim() != 2 or hidden.dtype != fused.dtype or w.q_a_bias is not None or \
                w.kv_a_bias is not None:
            return None
        kv_rows = w.kv_a_proj.shape[0]
        first_rows = fused.shape[0] - kv_rows
        if hidden.shape[0] != 1:
            if not fused_rows(hidden.shape[0], w, absorb):
                return None
            self.note("mla_prolog", "q and kv_a projections of more than one row: one GEMM (fused_a_proj), q and kv "
                      "read in place", True)
            out = self.ks.linear(hidden, fused)
            return out[:, :first_rows], out[:, first_rows:]
        linear = self.ks.impl("linear")
        mod, _why = linear.skinny(hidden, fused)
        if mod is None:
            return None
        linear.note_skinny_linear(mod)
        self.note("mla_prolog", "q / q_a and kv_a projections: one kernels_cuda.skinny_gemm launch (fused_a_proj)",
                  True)
        flat = mod.skinny_gemm(hidden, fused).view(-1)
        # views with their own compact strides (a split's [1, n] views would keep the fused row stride)
        return flat[:first_rows].view(1, first_rows), flat[first_rows:].view(1, kv_rows)

    # ---- warm-up -------------------------------------------------------------------------------------------
    def rope_cache_applies(self, plan: KernelWarmupPlan) -> bool:
        """The kernel's condition on the plan (the runner's caches are contiguous pages of bf16 rows; a packed FP8
        cache takes the kernel's rows from a scratch page set, then fp8_quant)."""
        return (self.wants("mla_rope_cache") and plan.dtype == BF16
                and (not plan.kv_cache_fp8 or self.ks.impl("quant").wants("fp8_quant"))
                and plan.kv_lora_rank == KV_LORA
                and plan.qk_rope_head_dim == ROPE and plan.block_size == PAGE
                and kernel_module("mla_rope_cache").supported_heads(plan.num_heads))

    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """``mla_rope_cache``: ``(heads, q_dim, q_off, interleaved, eps)``, q viewed as [T, H, nope + rope] with the
        rope part last; ``mla_absorb``: one build for the model's dims (bf16; a configuration whose steps never have
        one token, e.g. fixed-k speculation, compiles it needlessly); ``rms_norm``: the q_a layernorm (q_lora
        models) and the kv_a one where the rope-cache kernel does not apply (the composed tail normalises c_kv)."""
        out: dict[str, list[tuple]] = {}
        applies = self.rope_cache_applies(plan)
        if plan.dtype == BF16 and self.ks.impl("norms").wants("rms_norm"):
            want = [(plan.q_lora_rank, False, plan.latent_norm_eps)] if plan.q_lora_rank else []
            if not applies:
                want.append((plan.kv_lora_rank, False, plan.latent_norm_eps))
            out["rms_norm"] = norm_configs(want)
        if applies:
            mrc = kernel_module("mla_rope_cache")
            nope = plan.qk_nope_head_dim
            key = (plan.num_heads, nope + plan.qk_rope_head_dim, nope, bool(plan.rope_interleaved),
                   float(plan.latent_norm_eps))
            out["mla_rope_cache"] = [mrc.config_key(*key)]
            if fused_rows_planned(plan):  # decode steps of more than one row read the fused projection's rows
                out["mla_rope_cache"].append(mrc.config_key(*key, *mrc.fused_row(plan.num_heads, key[1])))
        if self.wants("mla_absorb") and plan.dtype == BF16:
            ma = kernel_module("mla_absorb")
            h, n, lrank = plan.num_heads, plan.qk_nope_head_dim, plan.kv_lora_rank
            qd = n + plan.qk_rope_head_dim
            if ma.supported(h, n, lrank, qd) is None:
                out["mla_absorb"] = [ma.config_for(h, n, lrank, qd)]
        return out


def absorb_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul ``out[t, h] = x[t, h] @ w[h]`` (x [T, H, K], w [H, K, N] -> [T, H, N] contiguous): the
    reference's ``einsum("thn,hnl->thl")`` (W_UK; W_UV with ``w`` transposed) as one cuBLAS batched GEMM over the
    heads. The strided q_nope view and the transposed W_UV feed it without a copy, and it writes the contiguous
    [T, H, N] result in place: head h's matrix is every H-th row of N values (batch stride N, row stride H x N).
    einsum returned a [T, H, N] view of an [H, T, N] result, which the decode kernel's query and o_proj's
    [T, H x N] input each copied (6.4 and 2.7 us of a layer's decode step at batch 256 on an H200)."""
    if x.shape[0] == 0:
        return torch.einsum("thn,hnl->thl", x, w).contiguous()
    out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=x.dtype, device=x.device)
    torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
    return out


def write_kv_cache_sync_free(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor,
                             kv_lora_rank: int | None = None) -> None:
    """``flat[slot] = latents`` for ``slot >= 0`` without a data-dependent shape: padding rows (negative
    slots) are sent to slot 0 carrying slot 0's current value (block 0 is reserved: never a sequence's). A uint8
    cache holds packed FP8 rows (``kv_cache_dtype="fp8"``): the latents are packed first (``kv_lora_rank`` = L)."""
    if kv_cache.dtype == FP8_KV_DTYPE:
        if kv_lora_rank is None:
            raise ValueError("writing a packed FP8 latent cache needs kv_lora_rank")
        rows = pack_fp8_latents(latents, kv_lora_rank)
    else:
        rows = latents.to(kv_cache.dtype)
    write_rows_sync_free(kv_cache, rows, slot_mapping)


def write_rows_sync_free(kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``flat[slot] = rows`` (rows already in the cache's dtype and row width) for ``slot >= 0``, sync-free as
    :func:`write_kv_cache_sync_free`."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    idx = torch.where(valid, slot_mapping, torch.zeros_like(slot_mapping))
    vals = torch.where(valid.unsqueeze(-1), rows, flat[0].unsqueeze(0))
    flat.index_copy_(0, idx, vals)


def fused_rows(rows: int, w: MLAWeights, absorb: bool) -> bool:
    """Whether a step of ``rows`` (> 1) rows runs the query's projection and kv_a as one GEMM
    (``DEEPINFER_FUSED_A_PROJ``): decode steps (the query absorbed) of models whose query is q_proj's (with
    q-LoRA the first projection's output goes through a norm and q_b_proj, which would copy the slice)."""
    return rows > 1 and absorb and w.q_proj is not None and envs.FUSED_A_PROJ


def fused_rows_planned(plan: KernelWarmupPlan) -> bool:
    """:func:`fused_rows` for the warm-up: steps of more than one row, no q-LoRA, ``DEEPINFER_FUSED_A_PROJ``.
    (A model whose two weights are not one tensor's slices runs two GEMMs: one configuration built needlessly.)"""
    _lo, hi = step_token_bounds(plan)
    return hi > 1 and not plan.q_lora_rank and envs.FUSED_A_PROJ
