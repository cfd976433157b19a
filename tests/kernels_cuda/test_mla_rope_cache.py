"""kernels_cuda.mla_rope_cache (fused kv_a_layernorm + q/k RoPE + paged latent-cache write) and its use by the
CUDA kernel set's ``mla_prolog``.

Tolerances (the kernel is bf16-only; other dtypes take the composed path): against the fp32 reference computed
with the CPU reference ops' roundings, q_rope and the cached k_pe must be bit-exact (0 bf16 ulp: the same IEEE
fp32 products and sum, no FMA contraction), the cached normalised c_kv within 1 bf16 ulp (the mean square's
summation order differs; 0 observed on an H200), NaN / inf at the same positions, every other cache row
untouched (bit-exact). The GPU tests skip without a CUDA device; the selection tests run anywhere.
"""

import pytest
import torch

from deepinfer_npu.backends.cpu.mla import write_kv_cache
from deepinfer_npu.backends.cpu.norm import rms_norm
from deepinfer_npu.backends.cpu.rope import rope
from deepinfer_npu.kernels_cuda import mla_rope_cache as mrc
from deepinfer_npu.kernels_cuda._testing import bf16_ulps, bf16_within, rope_cache

HEAD_DIM, KV_LORA, ROPE = mrc.HEAD_DIM, mrc.KV_LORA, mrc.ROPE

CASES = [  # (num_tokens, heads, interleaved, pad_every, max_pos, special)
    (1, 16, True, 0, 8192, False),
    (7, 16, True, 3, 8192, True),
    (64, 16, True, 5, 8192, False),
    (130, 16, False, 4, 8192, False),
    (1, 128, True, 0, 8192, False),
    (33, 128, True, 2, 8192, True),
    (256, 128, False, 7, 8192, False),
    (64, 128, True, 0, 163840, False),  # long-context table (V3's max_position_embeddings)
    (2000, 16, True, 9, 8192, False),  # prefill-sized
    (5, 8, True, 2, 8192, True),  # H < 16 (tensor parallel shard)
    (5, 32, False, 0, 8192, False),
]


def reference(inp, interleaved):
    """(q_rope, the cache after the write) by the CPU reference ops, as the composed prolog computes them."""
    c_kv, k_pe = inp["kv"].split([KV_LORA, ROPE], dim=-1)
    q_pe = inp["q"][:, :, inp["q_off"] : inp["q_off"] + ROPE]
    q_rope = rope(q_pe, inp["positions"], inp["cos_sin_cache"], interleaved)
    k_rot = rope(k_pe.unsqueeze(1), inp["positions"], inp["cos_sin_cache"], interleaved).squeeze(1)
    cache = inp["kv_cache"].clone()
    write_kv_cache(cache, torch.cat((rms_norm(c_kv, inp["weight"], inp["eps"]), k_rot), dim=-1), inp["slot_mapping"])
    return q_rope, cache


def compare_all(inp, interleaved, q_out, cache_out, cache_before):
    """q_rope and the written k_pe <= 1 ulp (bit-exact expected), the written c_kv <= 1 ulp, every other cache row
    untouched (bit-exact). ``inp`` holds the cache as it was before the launch."""
    q_ref, cache_ref = reference(dict(inp, kv_cache=cache_before), interleaved)
    slots = inp["slot_mapping"]
    valid = slots[slots >= 0]
    flat_o, flat_r = cache_out.view(-1, HEAD_DIM), cache_ref.view(-1, HEAD_DIM)
    ok_q, sq_ = bf16_within(q_out, q_ref, 1)
    ok_c, sc = bf16_within(flat_o[valid, :KV_LORA], flat_r[valid, :KV_LORA], 1)
    ok_k, sk = bf16_within(flat_o[valid, KV_LORA:], flat_r[valid, KV_LORA:], 1)
    untouched = torch.ones(flat_o.shape[0], dtype=torch.bool, device=flat_o.device)
    untouched[valid] = False
    before = cache_before.view(-1, HEAD_DIM)
    ok_u = torch.equal(flat_o[untouched].view(torch.int16), before[untouched].view(torch.int16))
    return ok_q and ok_c and ok_k and ok_u, dict(q_rope=sq_, c_kv=sc, k_pe=sk, rest_untouched=ok_u)


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
@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-il{int(c[2])}-pad{c[3]}")
def test_mla_rope_cache_matches_reference_gpu(case):
    t_, h, il, pad, max_pos, special = case
    inp = rope_cache(t_, h, max_pos, pad, seed=100 + t_, special=special)
    before = inp["kv_cache"].clone()
    out = torch.full((t_, h, ROPE), float("nan"), dtype=torch.bfloat16, device="cuda")
    mrc.mla_rope_cache(**inp, interleaved=il, out=out)
    ok, stats = compare_all(inp, il, out, inp["kv_cache"], before)
    assert ok, stats
    assert stats["q_rope"]["exact"] and stats["k_pe"]["exact"], stats  # the rope roundings are torch's exactly


def test_shared_rows_finds_the_fused_projections_slices_only():
    buf = torch.randn(5, 16 * 192 + HEAD_DIM)
    q, kv = buf[:, : 16 * 192].view(5, 16, 192), buf[:, 16 * 192 :]
    base, kv_off = mrc.shared_rows(q, kv)
    assert kv_off == 16 * 192 and base.shape == buf.shape and base.data_ptr() == buf.data_ptr()
    assert mrc.shared_rows(q.contiguous(), kv.contiguous()) is None  # compact rows: the compact kernel
    assert mrc.shared_rows(q, kv.clone()) is None  # another buffer
    assert mrc.shared_rows(q[:1], kv[:1]) is None  # one row: compact by definition
    assert mrc.config_key(16, 192, 128, True, 1e-6, *mrc.fused_row(16, 192)) == (16, 192, 128, True, 1e-6, 3648,
                                                                                  3648, 3072)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("tokens,heads,interleaved", [(2, 16, True), (64, 16, True), (256, 16, False)])
def test_reads_the_fused_projection_rows_in_place_gpu(tokens, heads, interleaved):
    """q and kv as the column slices of one [T, H x 192 + 576] buffer (the fused q / kv_a GEMM's output), read in
    place: the same bits as the compact kernel on contiguous copies (q_rope and every cache row)."""
    inp = rope_cache(tokens, heads, seed=7, pad_every=3)
    buf = torch.cat((inp["q"].reshape(tokens, -1), inp["kv"]), dim=1)
    q_view, kv_view = buf[:, : heads * 192].view(tokens, heads, 192), buf[:, heads * 192 :]
    assert mrc.shared_rows(q_view, kv_view) is not None and not kv_view.is_contiguous()
    compact_cache, fused_cache = inp["kv_cache"].clone(), inp["kv_cache"].clone()
    want = mrc.mla_rope_cache(**dict(inp, kv_cache=compact_cache), interleaved=interleaved)
    got = mrc.mla_rope_cache(**dict(inp, q=q_view, kv=kv_view, kv_cache=fused_cache), interleaved=interleaved)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(fused_cache.view(torch.int16), compact_cache.view(torch.int16))
    ok, stats = compare_all(inp, interleaved, got, fused_cache, inp["kv_cache"])
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("tokens,heads,interleaved", [(64, 16, True), (40, 16, True), (48, 128, False)])
def test_mla_rope_cache_graph_replay_gpu(tokens, heads, interleaved):
    """Captured once, replayed on new inputs copied into the static buffers (new positions, new slots with padding
    rows): no host read, the slot test is on the device."""
    a = rope_cache(tokens, heads, seed=3, pad_every=5)
    b = rope_cache(tokens, heads, seed=4, pad_every=3, num_blocks=a["kv_cache"].shape[0])
    out = torch.full((tokens, heads, ROPE), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn = lambda: mrc.mla_rope_cache(**a, interleaved=interleaved, out=out)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    for k in ("kv", "weight", "q", "positions", "slot_mapping", "kv_cache"):
        a[k].copy_(b[k])
    before = a["kv_cache"].clone()
    out.fill_(float("nan"))
    gr.replay()
    ok, stats = compare_all(a, interleaved, out, a["kv_cache"], before)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("heads,interleaved", [(16, True), (128, False)])
def test_backend_fused_prolog_matches_composed_gpu(heads, interleaved):
    """CudaKernelSet.mla_prolog with the kernel vs the same kernel set with the kernel unavailable (the composed
    path): q_latent and q_rope identical, written cache rows within 1 ulp, nothing else written."""
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    hidden, w, pos, rope, cache, slots = _prolog_inputs(13, heads, "cuda", interleaved)
    fused_ks, comp_ks = CudaKernelSet(), CudaKernelSet()
    comp_ks.modules.disable("mla_rope_cache", "disabled by the test")
    c_fused, c_comp = cache.clone(), cache.clone()
    ql_f, qr_f = fused_ks.mla_prolog(hidden, w, pos, rope, c_fused, slots)
    ql_c, qr_c = comp_ks.mla_prolog(hidden, w, pos, rope, c_comp, slots)
    assert torch.equal(ql_f, ql_c) and torch.equal(qr_f, qr_c)
    assert bf16_ulps(c_fused, c_comp).max().item() <= 1
    valid = slots[slots >= 0]
    untouched = torch.ones(cache.shape[0] * 64, dtype=torch.bool, device="cuda")
    untouched[valid] = False
    assert torch.equal(c_fused.view(-1, 576)[untouched], cache.view(-1, 576)[untouched])
    rep = fused_ks.op_report()["mla_prolog"]
    assert rep.startswith(f"native (kernels_cuda.mla_rope_cache (bf16, H={heads}"), rep
    assert "disabled by the test" in comp_ks.op_report()["mla_prolog"]
    assert fused_ks.syncing_ops() == {}


@pytest.mark.gpu
@pytest.mark.tilelang
def test_backend_prolog_toy_dims_fall_back_gpu():
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    hidden, w, pos, rope, cache, slots = _prolog_inputs(4, 4, "cuda", lrank=64, rdim=32)
    ks.mla_prolog(hidden, w, pos, rope, cache, slots)
    rep = ks.op_report()["mla_prolog"]
    assert "composed torch, sync-free cache write (kv_lora 64 + rope 32" in rep, rep
