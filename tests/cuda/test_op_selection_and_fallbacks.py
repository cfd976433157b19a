"""The CUDA kernel set's choices and fallbacks: what each op runs is chosen once (from the model and the device;
before any plan, from the device alone at the first call) and reported; fallbacks equal the CPU reference ops and
say why; the sync guard follows them ("warn" while a syncing fallback has run, "error" once every path taken is
sync-free). Host-tensor checks run everywhere, kernel numerics on a CUDA device with tilelang."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
from deepinfer_npu.backends.cuda.ops import OpConfig


def _attention_inputs(device, batch, heads, lrank, rdim, q_len, dtype, block=64, seed=0):
    """Random paged problem (finite cache, shuffled blocks, block 0 unused) for the mla_attention contract."""
    g = torch.Generator().manual_seed(seed)
    sk = [int(v) for v in torch.randint(q_len, 300, (batch,), generator=g)]
    nbs = [-(-k // block) for k in sk]
    width = max(nbs) + 1
    perm = torch.randperm(sum(nbs), generator=g) + 1
    tables = torch.zeros(batch, width, dtype=torch.int32)
    o = 0
    for b, n in enumerate(nbs):
        tables[b, :n] = perm[o : o + n].int()
        o += n
    cache = torch.randn(sum(nbs) + 1, block, lrank + rdim, generator=g).to(dtype)
    t = batch * q_len
    cu = torch.arange(0, t + 1, q_len, dtype=torch.int32)
    return dict(
        q_latent=torch.randn(t, heads, lrank, generator=g).to(dtype).to(device),
        q_rope=torch.randn(t, heads, rdim, generator=g).to(dtype).to(device),
        kv_cache=cache.to(device),
        block_tables=tables.to(device),
        seqlens_q=torch.full((batch,), q_len, dtype=torch.int32, device=device),
        seqlens_k=torch.tensor(sk, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        softmax_scale=(lrank + rdim) ** -0.5,
    )


def toy_attention_inputs(device):
    return _attention_inputs(device, 3, 4, 64, 32, 1, torch.float32)


def real_attention_inputs(device, batch, heads, q_len):
    return _attention_inputs(device, batch, heads, 512, 64, q_len, torch.bfloat16)


# ---- everywhere ------------------------------------------------------------------------------------------------
def test_kernel_set_report_before_any_call_and_on_cpu_tensors():
    from deepinfer_npu.backends.cpu import norm as ref_norm

    ks = CudaKernelSet()
    rep = ks.op_report()
    assert set(rep) == set(ks.OPS)
    assert all(v.startswith(("pending (", "fallback (")) for v in rep.values()), rep
    # On host tensors every decision is a fallback and nothing claims a sync (host reads are free there).
    x = torch.randn(3, 512)
    y = ks.rms_norm(x, torch.ones(512), 1e-6)
    assert torch.equal(y, ref_norm.rms_norm(x, torch.ones(512), 1e-6))
    assert ks.op_report()["rms_norm"].startswith("fallback (reference (tensor not on a CUDA device")
    assert ks.syncing_ops() == {}


def test_selection_for_a_model_reports_kernels_that_cannot_serve_it():
    """``plan_for_model`` (``--list-ops`` with a model) decides once: an fp32 model or another page size leaves the
    MLA kernels off with the reason; the DeepSeek dims in bf16 keep them pending; a kernel left out says so."""
    mc = SimpleNamespace(num_attention_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, kv_lora_rank=512)
    ks = CudaKernelSet()
    ks.plan_for_model(mc, torch.float32, 64)
    rep = ks.op_report()
    assert rep["mla_attention"] == "fallback (kernels_cuda.mla_decode off: torch.float32: kernels_cuda.mla_decode " \
        "is bf16-only)"
    assert rep["mla_prolog"].startswith("fallback (kernels_cuda.mla_rope_cache off: torch.float32")
    ks.select(OpConfig.from_model(mc, torch.bfloat16, 16, sm90=False))
    assert ks.op_report()["mla_attention"] == "fallback (kernels_cuda.mla_decode off: block_size 16: kernel reads " \
        "pages of 64)"
    ks.select(OpConfig.from_model(mc, torch.bfloat16, 64, sm90=False, skip=frozenset({"spec_verify"})))
    rep = ks.op_report()
    assert rep["mla_attention"].startswith("pending (kernels_cuda.mla_decode")
    assert rep["spec_verify"] == "fallback (kernels_cuda.spec_verify off: kernels_cuda.spec_verify left out of " \
        "the selection)"
    assert ks.impl("mla_attention").off.get("mla_decode_ws") == "not a Hopper device (compute capability 9.x)"


def test_first_call_selects_from_the_device_alone_and_keeps_the_choice():
    ks = CudaKernelSet()
    assert ks.config is None
    ks.rms_norm(torch.randn(2, 512), torch.ones(512), 1e-6)
    cfg = ks.config
    assert cfg is not None and not cfg.known and cfg.sm90 == (torch.cuda.is_available()
                                                              and torch.cuda.get_device_capability()[0] == 9)
    ks.linear(torch.randn(2, 8), torch.randn(8, 8))
    assert ks.config is cfg


def test_sync_free_rewrites_match_the_reference_on_cpu():
    """moe_dispatch / moe_combine / the mla_prolog cache write: same results as the reference ops."""
    from deepinfer_npu.backends.cpu import moe as ref_moe
    from deepinfer_npu.backends.cuda.ops.mla_prolog import write_kv_cache_sync_free

    g = torch.Generator().manual_seed(0)
    ks = CudaKernelSet()
    hidden = torch.randn(7, 16, generator=g)
    ids = torch.randint(0, 5, (7, 3), generator=g, dtype=torch.int32)
    a = ks.moe_dispatch(hidden, ids, 5)
    b = ref_moe.moe_dispatch(hidden, ids, 5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2].order, b[2].order)
    w = torch.rand(7, 3, generator=g)
    assert torch.equal(ks.moe_combine(a[0] * 2, a[2], w), ref_moe.moe_combine(b[0] * 2, b[2], w))

    cache = torch.randn(4, 8, 6, generator=g)
    ref_cache = cache.clone()
    lat = torch.randn(5, 6, generator=g)
    slots = torch.tensor([9, -1, 17, -1, 31])
    write_kv_cache_sync_free(cache, lat, slots)
    flat = ref_cache.view(-1, 6)
    flat[slots[slots >= 0]] = lat[slots >= 0]
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_on_host_lengths_matches_reference(dtype):
    """Prefill (q_len 40, exact host lengths) through the CUDA kernel set's host-length path, on CPU tensors:
    identical to the CPU reference (same arithmetic, lengths from the host instead of int(tensor))."""
    from deepinfer_npu.backends.cpu import mla as ref_mla
    from deepinfer_npu.model_executor.attention_metadata import HostLengths

    inp = _attention_inputs("cpu", 3, 4, 64, 32, 40, dtype)
    inp["seqlens_q"][1] = 0  # a request with no query tokens this step (its rows are absent from q)
    sq = [int(v) for v in inp["seqlens_q"]]
    inp["cu_seqlens_q"] = torch.tensor([0, sq[0], sq[0] + sq[1], sum(sq)], dtype=torch.int32)
    for key in ("q_latent", "q_rope"):
        inp[key] = inp[key][: sum(sq)]
    host = HostLengths(tuple(sq), tuple(int(v) for v in inp["seqlens_k"]), True, max(sq), int(inp["seqlens_k"].max()))
    ks = CudaKernelSet()
    out = ks.mla_attention(**inp, host=host)
    assert torch.equal(out, ref_mla.mla_attention(**inp))
    assert "reference arithmetic on host lengths, sync-free" in ks.op_report()["mla_attention"]
    assert not ks.syncing_ops()


@pytest.mark.parametrize("tokens", [0, 1, 3])
def test_absorb_heads_equals_the_reference_einsums(tokens):
    """The per-head W_UK / W_UV matmuls of the CUDA prolog / epilogue (one batched GEMM writing [T, H, N]) equal
    the reference's einsums, from the strided q_nope view and the transposed W_UV, and come out contiguous (the
    decode kernel's query and o_proj's input then need no copy)."""
    from deepinfer_npu.backends.cuda.ops.mla_prolog import absorb_heads

    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, 4, 48, generator=g)  # [T, H, nope + rope]
    w_uk = torch.randn(4, 32, 64, generator=g)  # [H, nope, L]
    got = absorb_heads(q[..., :32], w_uk)
    assert got.is_contiguous()
    assert torch.allclose(got, torch.einsum("thn,hnl->thl", q[..., :32], w_uk), atol=1e-5)
    out_latent = torch.randn(tokens, 4, 64, generator=g)
    w_uv = torch.randn(4, 16, 64, generator=g)  # [H, V, L]
    got = absorb_heads(out_latent, w_uv.transpose(1, 2))
    assert got.shape == (tokens, 4, 16) and got.is_contiguous()
    assert torch.allclose(got, torch.einsum("thl,hvl->thv", out_latent, w_uv), atol=1e-5)


# ---- on a CUDA device ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_forbid_sync_arms_warn_then_error_and_restores(cuda_backend, monkeypatch):
    be = cuda_backend
    monkeypatch.delenv("DEEPINFER_CUDA_SYNC_DEBUG", raising=False)
    assert torch.cuda.get_sync_debug_mode() == 0
    with be.forbid_sync():  # nothing has run yet: unknown fallbacks -> warn
        assert torch.cuda.get_sync_debug_mode() == 1 and be.last_sync_mode == "warn"
    assert torch.cuda.get_sync_debug_mode() == 0
    # a syncing fallback (the reference attention on toy dims, prefill-sized max q) keeps it at warn, and says so
    be.kernels.mla_attention(**toy_attention_inputs("cuda"), max_seqlen_q=17)
    assert "mla_attention" in be.kernels.syncing_ops()
    assert be.op_report()["sync_debug"].startswith("warn (syncing fallbacks used: mla_attention")
    with be.forbid_sync():
        assert torch.cuda.get_sync_debug_mode() == 1
    # a kernel set that has only taken sync-free paths arms error
    be.kernels = CudaKernelSet()
    be.kernels.linear(torch.randn(4, 8, device="cuda"), torch.randn(8, 8, device="cuda"))
    with be.forbid_sync():
        assert torch.cuda.get_sync_debug_mode() == 2 and be.last_sync_mode == "error"
        with pytest.raises(RuntimeError):
            torch.ones(3, device="cuda").sum().item()
    assert torch.cuda.get_sync_debug_mode() == 0
    monkeypatch.setenv("DEEPINFER_DISABLE_SYNC_GUARD", "1")
    with be.forbid_sync():
        assert torch.cuda.get_sync_debug_mode() == 0 and be.last_sync_mode == "off"


@pytest.mark.gpu
@pytest.mark.tilelang
def test_real_dims_select_kernels_and_match_reference(cuda_backend):
    from deepinfer_npu.backends.cpu import mla as ref_mla
    from deepinfer_npu.backends.cpu import norm as ref_norm

    ks = cuda_backend.kernels
    inp = real_attention_inputs("cuda", batch=5, heads=16, q_len=1)
    out = ks.mla_attention(**inp)
    ref = ref_mla.mla_attention(**{k: (v.float() if k in ("q_latent", "q_rope", "kv_cache") else v)
                                   for k, v in inp.items()})
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.99999, cos
    # verification shapes (q_len 3) with the host max passed explicitly
    inp3 = real_attention_inputs("cuda", batch=3, heads=16, q_len=3)
    out3 = ks.mla_attention(**inp3, max_seqlen_q=3)
    ref3 = ref_mla.mla_attention(**{k: (v.float() if k in ("q_latent", "q_rope", "kv_cache") else v)
                                    for k, v in inp3.items()})
    assert torch.nn.functional.cosine_similarity(out3.float().flatten(), ref3.flatten(), dim=0).item() > 0.99999
    x = torch.randn(9, 2048, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    wt = torch.rand(2048, device="cuda").to(torch.bfloat16) + 0.5
    y, s = ks.add_rms_norm(x, r, wt, 1e-6)
    ry, rs = ref_norm.add_rms_norm(x, r, wt, 1e-6)
    assert torch.equal(s, rs) and (y.float() - ry.float()).abs().max().item() <= 0.02 * ry.abs().max().item()
    rep = ks.op_report()
    assert rep["mla_attention"].startswith("native (kernels_cuda.mla_decode"), rep["mla_attention"]
    assert rep["add_rms_norm"].startswith("native (kernels_cuda.rms_norm"), rep["add_rms_norm"]
    assert "mla_attention" not in ks.syncing_ops()


@pytest.mark.gpu
def test_toy_dims_fall_back_with_reasons(cuda_backend):
    ks = cuda_backend.kernels
    ks.mla_attention(**toy_attention_inputs("cuda"), max_seqlen_q=17)  # prefill-sized: the reference
    ks.rms_norm(torch.randn(3, 192, device="cuda"), torch.ones(192, device="cuda"), 1e-6)
    rep = ks.op_report()
    assert rep["mla_attention"].startswith("fallback (reference (")
    assert "syncs" in rep["mla_attention"]
    ks.mla_attention(**toy_attention_inputs("cuda"))  # decode-sized: the dense sync-free composition
    assert "composed torch dense decode, sync-free" in ks.op_report()["mla_attention"]
    assert rep["rms_norm"].startswith("fallback (reference (torch.float32")


@pytest.mark.gpu
def test_grouped_mlp_bf16_matches_reference(cuda_backend):
    from deepinfer_npu.backends.cpu import moe as ref_moe

    ks = cuda_backend.kernels
    g = torch.Generator(device="cuda").manual_seed(0)
    E, D, inter, T, k = 8, 256, 128, 37, 3
    hidden = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E - 1, (T, k), device="cuda", generator=g).to(torch.int32)  # expert E-1 unused
    w13 = (torch.randn(E, 2 * inter, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, D, inter, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    sh, counts, _ = ks.moe_dispatch(hidden, ids, E)
    out = ks.grouped_mlp(sh, counts, w13, w2)  # 111 rows: decode-sized, kernels_cuda.moe_gemm
    ref = ref_moe.grouped_mlp(sh.float(), counts, w13.float(), w2.float())
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, (rel, ks.op_report()["grouped_mlp"])
    assert ks.op_report()["grouped_mlp"].startswith("native (kernels_cuda.moe_gemm"), ks.op_report()["grouped_mlp"]
    # a prefill-sized batch (rows > MOE_GEMM_MAX_ROWS) goes to the library grouped GEMM, same numbers
    from deepinfer_npu.backends.cuda.ops.grouped_mlp import MOE_GEMM_MAX_ROWS

    big_t = MOE_GEMM_MAX_ROWS // k + 1
    hidden = torch.randn(big_t, D, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (big_t, k), device="cuda", generator=g).to(torch.int32)
    sh, counts, _ = ks.moe_dispatch(hidden, ids, E)
    out = ks.grouped_mlp(sh, counts, w13, w2)
    ref = ref_moe.grouped_mlp(sh.float(), counts, w13.float(), w2.float())
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel
    assert "torch._grouped_mm" in ks.op_report()["grouped_mlp"], ks.op_report()["grouped_mlp"]


def test_path_log_keeps_the_syncing_paths_as_they_are_noted():
    from deepinfer_npu.backends.cuda.ops.base import PathLog

    log = PathLog()
    log.note("linear", "kernels_cuda.skinny_gemm", True)
    log.note("moe_dispatch", "reference (host counts)", False, syncs=True)
    log.note("moe_dispatch", "reference (host counts)", False, syncs=True)  # the same path again: one entry
    log.note("linear", "reference (tensor not on a CUDA device)", False, syncs=True)
    assert log.syncing_ops() == {"moe_dispatch": ["reference (host counts)"],
                                 "linear": ["reference (tensor not on a CUDA device)"]}
    log.syncing_ops()["linear"].append("changed by a caller")  # a copy: the log is not changed through it
    assert log.syncing_ops()["linear"] == ["reference (tensor not on a CUDA device)"] and log.calls == 4
    log.clear()
    assert log.syncing_ops() == {} and log.paths == {} and log.calls == 4
