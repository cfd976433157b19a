"""``mla_attention``: absorbed MLA over the paged latent cache.

Per step, from host facts only (the host bound on the query length: the HAL's ``max_seqlen_q``, else
``host.max_seqlen_q``, else the shape bound ``T - B + 1``, exact for decode without drafts and valid whenever every
request has a query token, as the worker's rows always do):

- decode and draft verification (max q 1..16), bf16 on the DeepSeek dims (kv_lora 512 + rope 64, page 64):
  ``kernels_cuda.mla_decode`` (FlashMLA layout; its 64-row tiles on ``mla_decode_ws``, warp-specialized, on a
  Hopper; a packed FP8 cache on the pipelined kernel's FP8 variant, which dequantises each page to bf16 in shared
  memory); other shapes: a dense sync-free composition (``backends/cuda/mla_dense.py``);
- prefill steps (any chunk length; also steps of unknown kind with max q > 16), same dtype and dims:
  ``kernels_cuda.mla_decode.mla_prefill`` (causal tile bound, one compiled variant per power-of-two chunk bucket from
  32: a step of short chunks needs no decode variants for its batch and split counts); else the reference arithmetic
  looping on the host's exact lengths (sync-free); else the reference (a sync).
"""

from __future__ import annotations

import torch

from deepinfer_npu.hal.types import KernelWarmupPlan
from deepinfer_npu.model_executor.quantization.kv_fp8 import fp8_latent_row_bytes

from .. import mla_dense
from .base import BF16, NOT_ON_DEVICE, OpConfig, OpImpl, kernel_module, known_syncing_fallback, ref

KV_LORA, ROPE, PAGE = 512, 64, 64  # what kernels_cuda.mla_decode is built for (FlashMLA layout)
FP8_ROW_BYTES = fp8_latent_row_bytes(KV_LORA, ROPE)  # its packed FP8 rows (kv_cache_dtype="fp8"): 656 bytes
MAX_Q = 16  # query tokens per request the decode kernel handles (speculative verification)


def ws_disabled_reason(md) -> str | None:
    """Why ``kernels_cuda.mla_decode_ws`` is off in this process (its compile failed), or None. The one place that
    reads the decode module's private handle on it."""
    return md._ws_module().disabled_reason


def mla_dims_refusal(kernel: str, cfg: OpConfig) -> str | None:
    """Why the model's dtype / latent dims / page size rule out a TileLang MLA kernel, or None."""
    if not cfg.known:
        return None
    if cfg.dtype != BF16:
        return f"{cfg.dtype}: kernels_cuda.{kernel} is bf16-only"
    if cfg.kv_lora_rank != KV_LORA or cfg.qk_rope_head_dim != ROPE:
        return f"kv_lora {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}: kernel built for the DeepSeek dims " \
            f"{KV_LORA} + {ROPE}"
    if cfg.block_size != PAGE:
        return f"block_size {cfg.block_size}: kernel reads pages of {PAGE}"
    return None


class MLAAttention(OpImpl):
    KERNELS = ("mla_decode", "mla_decode_ws", "mla_prefill")
    PRIMARY = {"mla_attention": "mla_decode"}
    PLANNED = {
        "mla_attention": "kernels_cuda.mla_decode for bf16, kv_lora 512 + rope 64, page 64, max q <= 16 (64-row "
        "tiles on sm_90 through kernels_cuda.mla_decode_ws, warp-specialized); "
        "else decode (max q <= 16) in composed torch (dense, sync-free); prefill steps on a bf16 cache with exact "
        "host lengths: kv_b decompression + torch varlen flash attention (mla_prefill_mha.py); "
        "prefill (max q > 16) on kernels_cuda.mla_decode.mla_prefill (causal tile bound) for the same shapes, "
        "else on the host's exact lengths (the reference loop, sync-free); else the reference (syncs)",
    }
    SYNCING = {"mla_attention": "int(seqlens_q[b]) / int(seqlens_k[b]) per request"}

    def refuses(self, name: str, cfg: OpConfig) -> str | None:
        if name == "mla_decode_ws" and not cfg.sm90:
            return "not a Hopper device (compute capability 9.x)"
        return mla_dims_refusal("mla_decode", cfg)

    def _reason(self, q_latent, q_rope, kv_cache, block_tables, max_q: int) -> str | None:
        lrank, rdim = q_latent.shape[-1], q_rope.shape[-1]
        if not q_latent.is_cuda:
            return NOT_ON_DEVICE
        if q_latent.dtype != BF16 or kv_cache.dtype not in (BF16, torch.uint8) or q_rope.dtype != BF16:
            return f"{q_latent.dtype} (cache {kv_cache.dtype}): kernels_cuda.mla_decode is bf16-only"
        if lrank != KV_LORA or rdim != ROPE:
            return f"kv_lora {lrank} + rope {rdim}: kernel built for the DeepSeek dims {KV_LORA} + {ROPE}"
        if kv_cache.dtype == torch.uint8 and (kv_cache.shape[-1] != FP8_ROW_BYTES or not kv_cache.is_contiguous()):
            return f"packed FP8 cache rows of {kv_cache.shape[-1]} bytes: kernel reads contiguous {FP8_ROW_BYTES}"
        if kv_cache.shape[1] != PAGE:
            return f"block_size {kv_cache.shape[1]}: kernel reads pages of {PAGE}"
        if block_tables.shape[0] == 0:
            return "no requests"
        if not 1 <= max_q <= MAX_Q:
            return f"prefill (max query length {max_q} > {MAX_Q})"
        return self.use("mla_decode")[1]

    def mla_attention(self, q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q,
                      softmax_scale, host=None, max_seqlen_q: int | None = None,
                      is_prefill: bool | None = None) -> torch.Tensor:
        num_tokens, num_reqs = q_latent.shape[0], block_tables.shape[0]
        if max_seqlen_q is None and host is not None:
            max_seqlen_q = host.max_seqlen_q
        max_q = int(max_seqlen_q) if max_seqlen_q is not None else num_tokens - num_reqs + 1
        i32 = torch.int32
        why = self._reason(q_latent, q_rope, kv_cache, block_tables, max_q)
        if (why is not None and max_q > MAX_Q or is_prefill and max_q >= 1) and "mla_prefill" not in self.off:
            # prefill on the same TileLang kernel (causal tile bound, no split)
            pre_why = self._reason(q_latent, q_rope, kv_cache, block_tables, 1)
            mod = self.use("mla_decode")[0] if pre_why is None else None
            if mod is not None and max_q <= mod.MAX_PREFILL_Q:
                self.note("mla_attention", f"kernels_cuda.mla_decode.mla_prefill ({_cache_words(kv_cache)}, "
                          f"H={q_latent.shape[1]}, q<= {mod.bucket_prefill_q(max_q)})", True)
                out, _lse = mod.mla_prefill(q_latent.contiguous(), q_rope.contiguous(), kv_cache,
                                            block_tables.to(i32).contiguous(), seqlens_q.to(i32),
                                            seqlens_k.to(i32), cu_seqlens_q.to(i32), float(softmax_scale),
                                            max_seqlen_q=max_q)
                return out
        if why is not None and q_latent.is_cuda and 1 <= max_q <= MAX_Q and block_tables.shape[0] > 0 and (
            torch.cuda.is_current_stream_capturing()
            or mla_dense.gather_bytes(q_latent, kv_cache, block_tables) <= mla_dense.MAX_GATHER_BYTES
        ):  # decode / verification off the kernel's shapes: composed torch, sync-free (graph-capturable)
            self.note("mla_attention", f"composed torch dense decode, sync-free ({why})", False)
            return mla_dense.mla_attention_dense(
                q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale
            )
        if why is not None and host is not None and host.seqlens_k_exact and len(host.seqlens_q) == num_reqs:
            # prefill (or any step whose lengths the host knows exactly): the reference loop on host ints
            self.note("mla_attention", f"reference arithmetic on host lengths, sync-free ({why})", False)
            return ref("mla").mla_attention(q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k,
                                            cu_seqlens_q, softmax_scale, host=host)
        if why is not None:
            self.note("mla_attention", f"reference ({why})", False, syncs=q_latent.is_cuda)
            with known_syncing_fallback():
                return ref("mla").mla_attention(
                    q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale
                )
        mod = self.use("mla_decode")[0]
        ws = self.use("mla_decode_ws")[0] is not None and kv_cache.dtype != torch.uint8
        ws_note = ""
        if ws and mod.decode_block_m(q_latent.shape[1], mod.bucket_q(max_q)) == mod.BLOCK_M:
            off = ws_disabled_reason(mod)
            ws_note = ("; warp-specialized (mla_decode_ws)" if off is None
                       else f"; pipelined 64-row tile (mla_decode_ws off: {off})")
        self.note("mla_attention", f"kernels_cuda.mla_decode ({_cache_words(kv_cache)}, H={q_latent.shape[1]}, q<= "
                  f"{mod.bucket_q(max_q)}{ws_note})", True)
        out, _lse = mod.mla_decode(
            q_latent.contiguous(),
            q_rope.contiguous(),
            kv_cache,
            block_tables.to(i32).contiguous(),
            seqlens_q.to(i32),
            seqlens_k.to(i32),
            cu_seqlens_q.to(i32),
            float(softmax_scale),
            max_seqlen_q=max_q,
            num_sms=self.ks.sms(q_latent.device),
            warp_specialized=ws,
        )
        return out

    # ---- warm-up -------------------------------------------------------------------------------------------
    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        if not self.wants("mla_decode"):
            return {}
        return {"mla_decode": mla_decode_configs(plan, num_sms, prefill=self.wants("mla_prefill"),
                                                 warp_specialized=self.wants("mla_decode_ws"))}


def _cache_words(kv_cache: torch.Tensor) -> str:
    return "bf16, packed FP8 cache" if kv_cache.dtype == torch.uint8 else "bf16"


def _bucket_reachable(bucket: int, max_q: int) -> bool:
    """Whether some host max query length in 1..max_q rounds up to ``bucket`` (``bucket_q``: 1, 2, 4, 8, 16)."""
    return (bucket // 2 + 1 if bucket > 1 else 1) <= max_q


def mla_decode_configs(plan: KernelWarmupPlan, num_sms: int, prefill: bool = True,
                       warp_specialized: bool = False) -> list[tuple]:
    """Decode ``md.decode_config`` tuples (heads, m_tiles, num_splits[, False, 64, True on mla_decode_ws' 64-row
    tiles]) from ``default_num_splits(B, H, bucket_q(max_q), table width, num_sms)`` as the launch computes them,
    and prefill ``(heads, m_tiles, 1, True)`` (causal tile bound), one per power-of-two query bucket from 32 up to
    the longest chunk (every prefill step takes it; without ``prefill``, chunks of <= 16 tokens take the decode
    kernel: B = 1 .. max_num_prompts, every bucket). Decode reaches: the decode graphs (each size,
    ``max_q = k + 1``, the graphs' width); eager decode or MTP's catch-up on the scheduler's tables: B = 1 ..
    max_num_seqs, ``max_q <= k + 1``, also after a device re-split; MTP's
    chained drafts (``max_q = 1``, tables padded by up to k + 1 keys; with graphs, the chain graphs' width at
    every propose graph size)."""
    if not (plan.dtype == BF16 and plan.kv_lora_rank == KV_LORA and plan.qk_rope_head_dim == ROPE
            and plan.block_size == PAGE):
        return []
    md = kernel_module("mla_decode")
    h, k, bs, mnbt = plan.num_heads, plan.num_speculative_tokens, plan.block_size, plan.max_num_batched_tokens
    fp8 = plan.kv_cache_fp8  # the FP8 variant of the pipelined kernel, never the warp-specialized one
    warp_specialized = warp_specialized and not fp8
    decode: set[tuple] = set()

    def add(batch: int, max_q_bound: int, width: int) -> None:
        """Every bucket of a host max query length 1..max_q_bound, at ``batch`` rows and table ``width``."""
        for bucket in (1, 2, 4, 8, 16):
            if _bucket_reachable(bucket, min(max_q_bound, MAX_Q)):
                decode.add(md.decode_config(h, bucket, md.default_num_splits(batch, h, bucket, width, num_sms, fp8),
                                            warp_specialized, fp8))

    for size in plan.decode_graph_sizes:  # S rows, host max_seqlen_q = k + 1 exactly, the graphs' own tables
        bucket = md.bucket_q(k + 1)
        decode.add(md.decode_config(h, bucket, md.default_num_splits(size, h, bucket, plan.decode_graph_width,
                                                                     num_sms, fp8), warp_specialized, fp8))
    if not prefill:  # without mla_prefill, prefill chunks of <= 16 query tokens take the decode kernel
        for b in range(1, min(plan.max_num_prompts, mnbt) + 1):
            add(b, min(mnbt, plan.max_model_len), plan.block_table_width)
    if not plan.decode_graph_sizes or plan.speculative_method == "mtp":  # eager decode steps, MTP's catch-up
        for b in range(1, min(plan.max_num_seqs, mnbt) + 1):
            add(b, k + 1, plan.block_table_width)
    if plan.speculative_method == "mtp" and k:  # MTP's chains: max_seqlen_k <= max_model_len (+ 2k re-split)
        max_k = plan.max_model_len + (2 * k if plan.varlen else 0)
        widest = max(plan.block_table_width, (max_k + k + 1) // bs + 1)
        rows = min(max(plan.max_num_seqs, plan.max_num_prompts), plan.max_num_batched_tokens)
        for b in range(1, rows + 1):
            for width in range(plan.block_table_width, widest + 1):
                add(b, 1, width)
    if plan.speculative_method == "mtp" and k and plan.decode_graph_sizes:  # the chain replayed from graphs
        from deepinfer_npu.hal.graph_sizes import graph_sizes
        from deepinfer_npu.spec.mtp_drafter import chain_graph_width

        width = chain_graph_width(plan.max_model_len, k, bs)
        for b in graph_sizes(max(1, plan.max_num_seqs)):
            add(b, 1, width)
    cfgs = sorted(decode)
    longest = min(mnbt, plan.max_model_len, md.MAX_PREFILL_Q)
    if prefill:  # every prefill step, short chunks included (from the 32-query bucket)
        bucket = md.bucket_prefill_q(1)
        while bucket <= md.bucket_prefill_q(longest):
            cfgs.append((h, md.m_tiles_for(h, bucket), 1, True) + ((md.BLOCK_M, False, True) if fp8 else ()))
            bucket *= 2
    return cfgs
