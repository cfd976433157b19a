"""``mla_prolog_quant`` / ``mla_epilogue_quant`` with FP8 projections: the reference's arithmetic
(``backends/cpu/quant.py``) with each projection through the kernel set's ``fp8_linear`` (``kernels_cuda.fp8_quant``
+ ``kernels_cuda.fp8_gemm`` where they apply; for one row the query's first projection and kv_a as one, on the
layer's ``fused_a_proj``), W_UK / W_UV as the bf16 prolog and epilogue run them (``mla_absorb``
or ``skinny_gemm`` for one token, else cuBLAS), and the bf16 prolog's tail (``MLAProlog.rope_and_cache``: the kv_a
layernorm, both ropes and the cache write in one ``kernels_cuda.mla_rope_cache`` launch where it applies, else
composed torch with a cache write that needs no host read). INT8 projections (the Ascend scheme) take the reference
op."""

from __future__ import annotations

import torch

from deepinfer_npu.hal.types import MLAWeights, RopeLike

from .base import OpImpl, known_syncing_fallback, ref
from .mla_prolog import absorb_heads, fused_rows

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj")


class MLAQuant(OpImpl):
    PLANNED = {
        "mla_prolog_quant": "FP8 projections through fp8_linear; W_UK and the tail (kv_a layernorm, ropes, cache "
        "write) as mla_prolog runs them; INT8 projections: the reference",
        "mla_epilogue_quant": "W_UV as mla_epilogue, o_proj through fp8_linear; INT8: the reference",
    }
    SYNCING = {"mla_prolog_quant": "boolean-mask cache write (slot_mapping >= 0)"}

    def mla_prolog_quant(self, hidden: torch.Tensor, w: MLAWeights, scales: dict[str, torch.Tensor],
                         positions: torch.Tensor, rope: RopeLike, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = [getattr(w, name) for name in PROJECTIONS if getattr(w, name) is not None]
        if not hidden.is_cuda or any(t.dtype != FP8 for t in weights):
            why = "tensor not on a CUDA device" if not hidden.is_cuda else "INT8 projections"
            self.note("mla_prolog_quant", f"reference ({why})", False, syncs=hidden.is_cuda)
            with known_syncing_fallback():
                return ref("quant").mla_prolog_quant(hidden, w, scales, positions, rope, kv_cache, slot_mapping)
        ks = self.ks
        num_tokens = hidden.shape[0]
        nope, rdim = w.qk_nope_head_dim, w.qk_rope_head_dim

        def lin(x, name, bias=None):
            return ks.fp8_linear(x, getattr(w, name), scales[name], bias)

        prolog = ks.impl("mla_prolog")

        def q_branch(first=None):  # first: the query's first projection, already computed
            if w.q_proj is not None:
                q = lin(hidden, "q_proj") if first is None else first
            else:
                qa = lin(hidden, "q_a_proj", w.q_a_bias) if first is None else first
                q = lin(ks.rms_norm(qa, w.q_a_layernorm, w.norm_eps), "q_b_proj")
            q = q.view(num_tokens, w.num_heads, nope + rdim)
            return q, prolog.absorb_q(q, w)

        fused = self.fused_a_proj(hidden, w, scales)
        if fused is not None:  # one GEMM for both projections
            first, kv = fused
            q, q_latent = q_branch(first)
        else:  # kv_a does not wait for the query's GEMMs (a second stream at decode sizes, as the bf16 prolog)
            (q, q_latent), kv = ks.run_parallel(q_branch, lambda: lin(hidden, "kv_a_proj", w.kv_a_bias),
                                                rows=num_tokens)
        self.note("mla_prolog_quant", "fp8_linear projections, W_UK and the tail as mla_prolog", True)
        # the bf16 prolog's tail: kernels_cuda.mla_rope_cache (norm, ropes, cache write in one launch) where it
        # applies, else composed torch with a sync-free cache write
        return q_latent, prolog.rope_and_cache(q, kv, w, positions, rope, kv_cache, slot_mapping,
                                               op="mla_prolog_quant")

    def fused_a_proj(self, hidden: torch.Tensor, w: MLAWeights, scales: dict[str, torch.Tensor]):
        """The layer's FP8 ``fused_a_proj`` (with ``scales["fused_a_proj"]``) for one row, or for a decode step of
        more rows where ``mla_prolog.fused_rows`` takes it: the query's first projection and kv_a (same input) as one
        ``fp8_linear`` -- one quantisation and one GEMM instead of two each -> (first, kv); one row: views with
        compact strides, more: column slices of the one output (read in place, as the bf16 prolog's). None where it
        does not apply. Each output column is the same dot product as in its own GEMM (only the fp32 order of its K
        slices may differ)."""
        fused, scale = w.fused_a_proj, scales.get("fused_a_proj")
        if fused is None or scale is None or fused.dtype != FP8 or hidden.dim() != 2:
            return None
        if w.q_a_bias is not None or w.kv_a_bias is not None:
            return None
        rows = fused.shape[0] - w.kv_a_proj.shape[0]
        if hidden.shape[0] != 1:
            if not fused_rows(hidden.shape[0], w, absorb=True):
                return None
            out = self.ks.fp8_linear(hidden, fused, scale)
            self.note("mla_prolog_quant", "q and kv_a projections of more than one row: one fp8_linear "
                      "(fused_a_proj), q and kv read in place", True)
            return out[:, :rows], out[:, rows:]
        flat = self.ks.fp8_linear(hidden, fused, scale).view(-1)
        self.note("mla_prolog_quant", "q / q_a and kv_a projections of one row: one fp8_linear (fused_a_proj)",
                  True)
        return flat[:rows].view(1, rows), flat[rows:].view(1, w.kv_a_proj.shape[0])

    def mla_epilogue_quant(self, out_latent: torch.Tensor, w: MLAWeights,
                           scales: dict[str, torch.Tensor]) -> torch.Tensor:
        if not out_latent.is_cuda or w.o_proj.dtype != FP8:
            why = "tensor not on a CUDA device" if not out_latent.is_cuda else "INT8 o_proj"
            self.note("mla_epilogue_quant", f"reference ({why})", False)
            return ref("quant").mla_epilogue_quant(out_latent, w, scales)
        values = self.ks.impl("mla_epilogue").w_uv_skinny(out_latent, w)
        if values is None:
            values = absorb_heads(out_latent, w.w_uv.transpose(1, 2))
        self.note("mla_epilogue_quant", "W_UV as mla_epilogue, o_proj through fp8_linear", True)
        return self.ks.fp8_linear(values.reshape(values.shape[0], -1), w.o_proj, scales["o_proj"], w.o_bias)
