"""``mla_forward`` for prefill steps: the latents decompressed through kv_b and multi-head attention on torch's
varlen flash attention, as DeepSeek's and vLLM's prefill do; decode and every other step keep the absorbed path.

Absorbed MLA costs H x (2L + R) x 2 FLOPs a (query, key) pair (576-wide keys, 512-wide values: 34.8 kFLOP at V2-Lite's
16 heads); decompressed it is H x (N + R + V) x 2 (10.2 kFLOP) plus one kv_b GEMM a key, so for prompts of hundreds
of tokens and more the decompressed form does about a third of the work. The query keeps its nope part un-absorbed
(``MLAProlog.mla_prolog(absorb=False)``: no W_UK; the rotated rope part written back into the projection's tensor),
the keys are the cache rows of each request's whole context (its cached prefix and this step's tokens, gathered on
the device: no host read), K = [c W_UK^T | k_rope] and V = c W_UV^T (one GEMM of the rows, ``kv_weight``), and the
attention output goes straight to o_proj (no W_UV). FlashAttention-2 takes one head dim for q, k and v, so V is
zero-padded to N + R (by zero rows of that GEMM's weight) and the padding columns dropped after.

Same arithmetic as the reference up to bf16 roundings in another place (the keys and values rounded after kv_b
instead of the query after W_UK and the output before W_UV), checked against the CPU reference in
tests/cuda/test_mla_prefill_mha.py with bf16 tolerances.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from deepinfer_npu.hal.types import MLAWeights, RopeLike

from .base import BF16, NOT_ON_DEVICE, OpImpl, logger

MAX_HEAD_DIM = 256  # FlashAttention-2's largest head dim
# kv_weight's per-layer weights are kept up to this many bytes in all (they are made after the KV cache is sized):
# V2-Lite's 27 layers take 191 MB; past it (128-head models: 57 MB a layer) a layer's weight is made at each step
KV_WEIGHT_CACHE_BYTES = 256 << 20


def _flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, scale: float, is_causal: bool = False):
    """The call ``torch.nn.attention.varlen.varlen_attn`` makes on its flash path, made directly: the public
    function wraps it in a custom op whose Python dispatch (and an extra zero-filled tensor a call) cost host time on
    every layer of a prefill step, where the host is the bottleneck. Causal masks align to the bottom right, as
    there."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False,
                                                   scale=scale)[0]


def _varlen_attn(direct: bool = True):
    """torch's varlen flash attention: aten's flash forward called directly (``direct``, where torch has it), else
    ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9), else None."""
    if direct and hasattr(torch.ops.aten, "_flash_attention_forward"):
        return _flash_varlen
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _causal_kwargs(fn) -> dict:
    """Causal masking in either signature: ``is_causal=True`` (torch 2.9) or ``window_size=(-1, 0)`` (later),
    aligned to the bottom right (query j of a chunk sees the prefix and keys up to its own position)."""
    params = inspect.signature(fn).parameters
    return {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}


def context_slots(attn, page: int, total_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache rows of every request's keys 0 .. seqlens_k - 1, in request order [total_k] int64, cu_seqlens_k
    [B + 1] int32), from the block tables on the device; ``total_k`` (a host int) sizes the outputs."""
    lens = attn.seqlens_k.long()
    dev = lens.device
    req = torch.repeat_interleave(torch.arange(lens.shape[0], device=dev), lens, output_size=total_k)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total_k, device=dev) - starts[req]
    blocks = attn.block_tables.long()[req, pos // page]
    cu_k = F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
    return blocks * page + pos % page, cu_k


class MLAPrefillMHA(OpImpl):
    """Prefill steps (bf16 cache, host lengths exact): kv_b decompression + torch varlen flash attention
    (FlashAttention-2) over N + R head dims; else mla_prolog + mla_attention + mla_epilogue (the absorbed path).
    Its calls are reported under ``mla_attention`` (the op report lists the HAL's ops; mla_forward is a
    composite)."""

    #: the name that leaves this path out of a selection (``CudaKernelSet.SKIP``); it launches no TileLang kernel
    NAME = "mla_prefill_mha"

    @staticmethod
    def on_device(x: torch.Tensor) -> bool:
        """Where the path runs (CUDA; the CPU test of the composition replaces this and the attention)."""
        return x.is_cuda

    def __init__(self, ks) -> None:
        super().__init__(ks)
        self._error: str | None = None  # a failed call turns the path off for good
        self._direct = True  # aten's flash forward called directly, until a call of it fails
        self._skipped = False
        # (the step's AttentionMetadata, key rows, cu_seqlens_k): every layer of a step reads the same rows
        self._step_keys: tuple | None = None
        self._kv_weights: dict[int, tuple] = {}  # id(w_uk) -> (w_uk, w_uv, kv_weight), a layer each
        self._kv_weight_bytes = 0

    def select(self, cfg) -> None:
        super().select(cfg)
        self._skipped = self.NAME in cfg.skip

    def serves_prefill(self, plan) -> bool:
        """Whether ``plan``'s prefill steps take this path, from what start-up knows (selection, torch, dtypes,
        the query/key head dim): the absorbed path's prefill kernels are then a fallback
        (``warmup_background.py``). Steps this path still refuses (padded, a failed call) take that fallback.
        Quantised projections never reach it: their layers run ``mla_prolog_quant`` and the absorbed attention."""
        qk = plan.qk_nope_head_dim + plan.qk_rope_head_dim
        return (not self._skipped and self._error is None and _varlen_attn() is not None and plan.dtype == BF16
                and not plan.kv_cache_fp8 and plan.quantization is None and qk <= MAX_HEAD_DIM and qk % 8 == 0)

    def reason(self, hidden: torch.Tensor, w: MLAWeights, kv_cache: torch.Tensor, attn) -> str | None:
        """Why a step keeps the absorbed path (host facts only), or None."""
        if not attn.is_prefill:
            return "not a prefill step"
        if not self.on_device(hidden):
            return NOT_ON_DEVICE
        if self._skipped:
            return f"{self.NAME} left out of the selection"
        if self._error is not None:
            return self._error
        if _varlen_attn() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen"
        host = attn.host
        if host is None or not host.seqlens_k_exact:
            return "context lengths not exact on the host"
        if hidden.dtype != BF16 or kv_cache.dtype != BF16 or w.w_uk.dtype != BF16:
            return f"{hidden.dtype} (cache {kv_cache.dtype}): bf16 only"
        qk = w.qk_nope_head_dim + w.qk_rope_head_dim
        if qk > MAX_HEAD_DIM or qk % 8 or w.v_head_dim > qk or w.v_head_dim % 8:
            return f"head dims {qk} / {w.v_head_dim}: flash attention takes <= {MAX_HEAD_DIM}, multiples of 8"
        if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
            return "cache is not contiguous [blocks, page, L + R]"
        if attn.num_tokens == 0 or attn.num_tokens != sum(host.seqlens_q):
            return f"{attn.num_tokens} rows for {sum(host.seqlens_q)} query tokens (padded or empty step)"
        return None

    def key_rows(self, attn, page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache rows of the step's keys, cu_seqlens_k), computed at the step's first layer."""
        if self._step_keys is not None and self._step_keys[0] is attn:
            return self._step_keys[1], self._step_keys[2]
        host = attn.host
        if tuple(host.seqlens_q) == tuple(host.seqlens_k):  # no cached prefix: the keys are this step's rows
            slots, cu_k = attn.slot_mapping, attn.cu_seqlens_q.to(torch.int32)
        else:
            slots, cu_k = context_slots(attn, page, int(sum(host.seqlens_k)))
        self._step_keys = (attn, slots, cu_k)
        return slots, cu_k

    def kv_weight(self, w: MLAWeights) -> torch.Tensor:
        """``[2 H (N + R), L + R]``, built at a layer's first prefill step and kept: the cache rows ``[c | k_rope]``
        times its transpose are ``K = [c W_UK^T | k_rope]`` and ``V = [c W_UV^T | 0]`` for every head, in the layout
        flash attention reads (one head dim N + R for both).

        The rope part passes through an identity block (one product with 1.0 among zeros: exact in the fp32
        accumulator) and V's padding columns through zero rows, so one GEMM replaces the two kv_b GEMMs, the
        concatenation that broadcast k_rope over the heads and the padding of V (about 0.28 ms a layer of a
        16384-token step on an H200, against about 0.07 ms for the GEMM's 1.7x FLOPs). Kept up to
        ``KV_WEIGHT_CACHE_BYTES`` in all, else made again at each step (four small launches a layer)."""
        entry = self._kv_weights.get(id(w.w_uk))  # the layer's own tensor (MLAWeights is built every call)
        if entry is not None and entry[0] is w.w_uk and entry[1] is w.w_uv:
            return entry[2]
        h, nope, rdim, vdim, lrank = w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.v_head_dim, \
            w.kv_lora_rank
        weight = torch.zeros(2, h, nope + rdim, lrank + rdim, dtype=w.w_uk.dtype, device=w.w_uk.device)
        weight[0, :, :nope, :lrank] = w.w_uk
        weight[0, :, nope:, lrank:] = torch.eye(rdim, dtype=w.w_uk.dtype, device=w.w_uk.device)
        weight[1, :, :vdim, :lrank] = w.w_uv
        weight = weight.view(2 * h * (nope + rdim), lrank + rdim)
        size = weight.numel() * weight.element_size()
        if self._kv_weight_bytes + size <= KV_WEIGHT_CACHE_BYTES:
            self._kv_weights[id(w.w_uk)] = (w.w_uk, w.w_uv, weight)
            self._kv_weight_bytes += size
        return weight

    def _attend(self, q, k, v, cu_q, cu_k, host, scale: float) -> torch.Tensor:
        """Causal varlen flash attention: the direct call, and the public function if that ever fails."""
        error: Exception | None = None
        for direct in (True, False) if self._direct else (False,):
            fn = _varlen_attn(direct)
            if fn is None:
                continue
            try:
                return fn(q, k, v, cu_q, cu_k, int(host.max_seqlen_q), int(host.max_seqlen_k), scale=scale,
                          **_causal_kwargs(fn))
            except Exception as e:  # noqa: BLE001 - the public function is tried next
                error = e
                if fn is _flash_varlen:
                    self._direct = False
                    logger.warning("cuda backend: aten._flash_attention_forward called directly failed (%s: %s); "
                                   "prefill attention goes through torch.nn.attention.varlen", type(e).__name__,
                                   str(e)[:160])
        raise error or RuntimeError("this torch has no varlen flash attention")

    def mla_forward(self, hidden: torch.Tensor, w: MLAWeights, positions: torch.Tensor, rope: RopeLike,
                    kv_cache: torch.Tensor, attn, softmax_scale: float) -> torch.Tensor | None:
        """The decompressed prefill, or None where :meth:`reason` refuses (the caller runs the absorbed path)."""
        if self.reason(hidden, w, kv_cache, attn) is not None:
            return None  # the absorbed path's ops report what they run
        ks = self.ks
        h, nope, rdim, vdim, lrank = w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.v_head_dim, \
            w.kv_lora_rank
        host = attn.host
        q, q_rope = ks.impl("mla_prolog").mla_prolog(hidden, w, positions, rope, kv_cache, attn.slot_mapping,
                                                     absorb=False)  # writes this step's rows first
        num_tokens, page = hidden.shape[0], kv_cache.shape[1]
        slots, cu_k = self.key_rows(attn, page)
        rows = kv_cache.view(-1, lrank + rdim).index_select(0, slots)
        tk, width = rows.shape[0], h * (nope + rdim)
        kv = ks.linear(rows, self.kv_weight(w))  # [tk, 2 H (N + R)]: K and padded V, laid out for the attention
        k, v = kv[:, :width].view(tk, h, nope + rdim), kv[:, width:].view(tk, h, nope + rdim)
        q[..., nope:] = q_rope  # the projection's own tensor: a third of the bytes a concatenation would move
        try:
            out = self._attend(q, k, v, attn.cu_seqlens_q.to(torch.int32), cu_k, host, float(softmax_scale))
        except Exception as e:  # noqa: BLE001 - off for good; this step and the next take the absorbed path
            self._error = f"varlen flash attention failed: {type(e).__name__}: {str(e)[:160]}"
            logger.warning("cuda backend: %s; prefill takes the absorbed MLA path", self._error)
            return None
        # reported under mla_attention (the op report lists the HAL's ops; mla_forward is a composite)
        self.note("mla_attention", f"prefill: kv_b decompression + torch varlen flash attention (H={h}, head dim "
                  f"{nope + rdim}, values {vdim} padded)", True)
        out = out[..., :vdim].reshape(num_tokens, h * vdim)
        return ks.linear(out, w.o_proj, w.o_bias)
