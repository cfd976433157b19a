"""kernels_cuda/mla_rope_cache.py (fused kv_a_layernorm + q/k RoPE + paged latent-cache write) and its use by the
CUDA kernel set's ``mla_prolog``.

Tolerances (the kernel is bf16-only; other dtypes take the composed path): against the fp32 reference computed
with the CPU reference ops' roundings, q_rope and the cached k_pe must be bit-exact (0 bf16 ulp: the same IEEE
fp32 products and sum, no FMA contraction), the cached normalised c_kv within 1 bf16 ulp (the mean square's
summation order differs; 0 observed on an H200), NaN / inf at the same positions, every other cache row
untouched (bit-exact). The GPU tests skip without a CUDA device; the selection tests run anywhere.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

from kernels_cuda import mla_rope_cache as mrc  # noqa: E402 (importable without tilelang)

HAS_CUDA = torch.cuda.is_available()


def _has_tilelang():
    try:
        import tilelang  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


gpu = pytest.mark.skipif(
    not (HAS_CUDA and _has_tilelang()), reason="no CUDA device (or no tilelang): GPU numerics run on the H200 only"
)


# ---- anywhere ----------------------------------------------------------------------------------------------------
def test_supported_heads():
    assert all(mrc.supported_heads(h) for h in (1, 2, 4, 8, 16, 32, 64, 128))
    assert not any(mrc.supported_heads(h) for h in (0, 3, 12, 24, 40))
    assert mrc.heads_per_cta(128) == 16 and mrc.heads_per_cta(8) == 8


def _mla_weights(heads, lrank, rdim, nope=128, d=256, dtype=torch.bfloat16, device="cpu", seed=0):
    from deepinfer_npu.hal.types import MLAWeights

    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    return MLAWeights(
        num_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rdim, v_head_dim=128, kv_lora_rank=lrank,
        kv_a_proj=r(lrank + rdim, d), kv_a_layernorm=(torch.rand(lrank, generator=g) + 0.5).to(dtype).to(device),
        w_uk=r(heads, nope, lrank), w_uv=r(heads, 128, lrank), o_proj=r(d, heads * 128),
        q_proj=r(heads * (nope + rdim), d),
    )


class _Rope:
    def __init__(self, max_pos, interleaved, device, rdim=64):
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rdim, 2, dtype=torch.float32) / rdim))
        freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        self.interleaved = interleaved


def _prolog_inputs(num_tokens, heads, device, interleaved=True, lrank=512, rdim=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = _mla_weights(heads, lrank, rdim, dtype=dtype, device=device, seed=seed)
    hidden = torch.randn(num_tokens, 256, generator=g).to(dtype).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
    slots = (torch.randperm(6 * 64, generator=g)[:num_tokens] + 64).to(device)
    slots[1::4] = -1  # padding rows
    cache = torch.randn(8, 64, lrank + rdim, generator=g).to(dtype).to(device)
    return hidden, w, positions, _Rope(8192, interleaved, device, rdim), cache, slots


def test_prolog_on_host_tensors_takes_the_composed_path_with_a_reason():
    from deepinfer_npu.backends.cpu import mla as ref_mla
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    assert "kernels_cuda.mla_rope_cache" in ks.op_report()["mla_prolog"]  # pending (planned)
    hidden, w, pos, rope, cache, slots = _prolog_inputs(5, 4, "cpu", lrank=64, rdim=32, dtype=torch.float32)
    ref_cache = cache.clone()
    ql, qr = ks.mla_prolog(hidden, w, pos, rope, cache, slots)
    rl, rr = ref_mla.mla_prolog(hidden, w, pos, rope, ref_cache, slots)
    assert torch.equal(ql, rl) and torch.equal(qr, rr) and torch.equal(cache, ref_cache)
    rep = ks.op_report()["mla_prolog"]
    assert rep.startswith("native (composed torch, sync-free cache write (tensor not on a CUDA device"), rep


# ---- on a CUDA device --------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("case", mrc.CHECK_CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-il{int(c[2])}-pad{c[3]}")
def test_mla_rope_cache_matches_reference_gpu(case):
    t_, h, il, pad, max_pos, special = case
    ok, stats = mrc.check_case(t_, h, il, pad, max_pos, seed=100 + t_, special=special, verbose=False)
    assert ok, stats
    assert stats["q_rope"]["exact"] and stats["k_pe"]["exact"], stats  # the rope roundings are torch's exactly


@gpu
@pytest.mark.parametrize("heads,interleaved", [(16, True), (128, False)])
def test_mla_rope_cache_graph_replay_gpu(heads, interleaved):
    """Captured once, replayed on new positions / slots / padding rows: no host read of device values."""
    ok, stats = mrc.check_graph(40, heads, interleaved, seed=3, verbose=False)
    assert ok, stats


@gpu
@pytest.mark.parametrize("heads,interleaved", [(16, True), (128, False)])
def test_backend_fused_prolog_matches_composed_gpu(heads, interleaved):
    """CudaKernelSet.mla_prolog with the kernel vs the same kernel set with the kernel unavailable (the composed
    path): q_latent and q_rope identical, written cache rows within 1 ulp, nothing else written."""
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    hidden, w, pos, rope, cache, slots = _prolog_inputs(13, heads, "cuda", interleaved)
    fused_ks, comp_ks = CudaKernelSet(), CudaKernelSet()
    comp_ks._kernel_modules["mla_rope_cache"] = None
    comp_ks._kernel_error["mla_rope_cache"] = "disabled by the test"
    c_fused, c_comp = cache.clone(), cache.clone()
    ql_f, qr_f = fused_ks.mla_prolog(hidden, w, pos, rope, c_fused, slots)
    ql_c, qr_c = comp_ks.mla_prolog(hidden, w, pos, rope, c_comp, slots)
    assert torch.equal(ql_f, ql_c) and torch.equal(qr_f, qr_c)
    assert mrc.bf16_ulps(c_fused, c_comp).max().item() <= 1
    valid = slots[slots >= 0]
    untouched = torch.ones(cache.shape[0] * 64, dtype=torch.bool, device="cuda")
    untouched[valid] = False
    assert torch.equal(c_fused.view(-1, 576)[untouched], cache.view(-1, 576)[untouched])
    rep = fused_ks.op_report()["mla_prolog"]
    assert rep.startswith(f"native (kernels_cuda.mla_rope_cache (bf16, H={heads}"), rep
    assert "disabled by the test" in comp_ks.op_report()["mla_prolog"]
    assert fused_ks.syncing_ops() == {}


@gpu
def test_backend_prolog_toy_dims_fall_back_gpu():
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    hidden, w, pos, rope, cache, slots = _prolog_inputs(4, 4, "cuda", lrank=64, rdim=32)
    ks.mla_prolog(hidden, w, pos, rope, cache, slots)
    rep = ks.op_report()["mla_prolog"]
    assert "composed torch, sync-free cache write (kv_lora 64 + rope 32" in rep, rep
