"""The MLA prolog's tail for a packed FP8 cache (``MLAProlog._rope_and_fp8_cache``): ``mla_rope_cache`` writes the
tokens' bf16 rows into scratch pages, ``fp8_quant`` quantises their latents, and the packed rows go to their slots.
Anywhere, with stand-ins for the two kernels built from the reference ops (the kernels themselves are checked
against those references in tests/kernels_cuda): the cache bytes equal the composed tail's (``pack_fp8_latents``
then the sync-free write), padding rows (negative slots) write nothing, and q_rope is the kernel's."""

from __future__ import annotations

import torch

from deepinfer_npu.backends.cpu.norm import rms_norm
from deepinfer_npu.backends.cpu.rope import rope
from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
from deepinfer_npu.backends.cuda.ops.mla_prolog import write_kv_cache_sync_free
from deepinfer_npu.hal.types import MLAWeights
from deepinfer_npu.model_executor.quantization.fp8 import quantize_per_token_group
from deepinfer_npu.model_executor.quantization.kv_fp8 import fp8_latent_row_bytes

L, R, H, NOPE = 512, 64, 16, 128


class _RopeCache:
    """kernels_cuda.mla_rope_cache's contract on the reference ops (its bf16 roundings)."""

    def __init__(self):
        self.caches = []

    def mla_rope_cache(self, kv, weight, eps, q, q_off, positions, cos_sin_cache, interleaved, kv_cache,
                       slot_mapping):
        self.caches.append(kv_cache)
        rows = torch.cat((rms_norm(kv[:, :L], weight, eps),
                          rope(kv[:, None, L:], positions, cos_sin_cache, interleaved)[:, 0]), dim=-1)
        flat = kv_cache.view(-1, L + R)
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                flat[slot] = rows[t]
        return rope(q[..., q_off:q_off + R], positions, cos_sin_cache, interleaved)


class _Quant:
    @staticmethod
    def quantize(x, gated=False):
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and not gated
        return quantize_per_token_group(x)


def test_fp8_cache_tail_writes_the_composed_tails_bytes():
    g = torch.Generator().manual_seed(0)
    tokens = 70  # more than one scratch page of 64 rows
    w = MLAWeights(num_heads=H, qk_nope_head_dim=NOPE, qk_rope_head_dim=R, v_head_dim=128, kv_lora_rank=L,
                   kv_a_proj=torch.empty(0), kv_a_layernorm=(torch.rand(L, generator=g) + 0.5).bfloat16(),
                   w_uk=torch.empty(0), w_uv=torch.empty(0), o_proj=torch.empty(0), norm_eps=1e-6)
    kv = (torch.randn(tokens, L + R, generator=g) * torch.exp2(torch.randint(-4, 5, (tokens, 1), generator=g))
          ).bfloat16()
    q = torch.randn(tokens, H, NOPE + R, generator=g).bfloat16()
    positions = torch.randint(0, 256, (tokens,), generator=g)
    ang = torch.arange(256).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, R, 2).float() / R))[None]
    ropes = type("Rope", (), {"cos_sin_cache": torch.cat((ang.cos(), ang.sin()), -1), "interleaved": True})()
    slots = torch.randperm(4 * 64, generator=g)[:tokens] + 64  # block 0 is the reserved padding block
    slots[[3, 40]] = -1  # padding rows
    row_bytes = fp8_latent_row_bytes(L, R)
    cache = torch.randint(0, 255, (5, 64, row_bytes), generator=g, dtype=torch.uint8)
    want = cache.clone()
    prolog = CudaKernelSet().impl("mla_prolog")
    kernel = _RopeCache()
    q_rope = prolog._rope_and_fp8_cache(kernel, _Quant(), q, kv, w, positions, ropes, cache, slots)
    latents = torch.cat((rms_norm(kv[:, :L], w.kv_a_layernorm, 1e-6),
                         rope(kv[:, None, L:], positions, ropes.cos_sin_cache, True)[:, 0]), dim=-1)
    write_kv_cache_sync_free(want, latents, slots, L)
    assert torch.equal(cache, want)
    assert torch.equal(q_rope, rope(q[..., NOPE:], positions, ropes.cos_sin_cache, True))
    scratch = kernel.caches[0]  # whole pages of bf16 rows, every token written (padding rows included)
    assert scratch.shape == (2, 64, L + R) and scratch.dtype == torch.bfloat16
