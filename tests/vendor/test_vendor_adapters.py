"""deepinfer_npu.vendor: each adapter reports a missing library with its fallback, and with a stand-in module that
exposes the library's API it passes the engine's tensors in the library's argument order and layout."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deepinfer_npu import vendor
from deepinfer_npu.vendor import deep_ep, deep_gemm, flash_mla


@pytest.fixture
def absent(monkeypatch):
    """Every vendor library missing (a None entry in sys.modules makes its import raise ImportError)."""
    for name in ("flash_mla", "deep_gemm", "deep_ep"):
        monkeypatch.setitem(sys.modules, name, None)


def _fake(monkeypatch, name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__version__ = "9.9"
    for key, value in attrs.items():
        setattr(mod, key, value)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_absent_libraries_are_reported_with_their_fallback(absent):
    for adapter in vendor.ADAPTERS:
        status = adapter.probe()
        assert (status.name, status.available, status.version) == (adapter.NAME, False, None)
        assert "is not installed" in status.reason
    report = vendor.report()
    assert set(report) == {"flash_mla", "deep_gemm", "deep_ep"}
    assert report["flash_mla"].startswith("not found (flash_mla is not installed")
    assert report["flash_mla"].endswith("; fallback: kernels_cuda.mla_decode")
    assert report["deep_gemm"].endswith("fallback: kernels_cuda.moe_gemm / torch._grouped_mm")
    with pytest.raises(RuntimeError, match="flash_mla is not usable: flash_mla is not installed"):
        flash_mla.mla_decode(*_mla_case(), softmax_scale=0.1, q_per_request=2)


def test_a_library_without_the_entry_points_is_an_unsupported_version(monkeypatch):
    _fake(monkeypatch, "flash_mla", get_mla_metadata=lambda *a: None)
    status = flash_mla.probe()
    assert not status.available and status.version == "9.9"
    assert status.reason == "flash_mla lacks flash_mla_with_kvcache (an unsupported version)"


def _mla_case(batch: int = 3, q: int = 2, heads: int = 4, blocks: int = 7):
    g = torch.Generator().manual_seed(0)
    q_latent = torch.randn(batch * q, heads, 512, generator=g).bfloat16()
    q_rope = torch.randn(batch * q, heads, 64, generator=g).bfloat16()
    kv_cache = torch.randn(blocks, 64, 576, generator=g).bfloat16()
    tables = torch.randint(1, blocks, (batch, 2), generator=g, dtype=torch.int64)
    seqlens_k = torch.tensor([70, 5, 128])[:batch]
    return q_latent, q_rope, kv_cache, tables, seqlens_k


def test_flash_mla_gets_our_cache_and_queries_in_its_layout(monkeypatch):
    calls = {}

    def get_mla_metadata(cache_seqlens, q_tokens_per_head_k, heads_k):
        calls["metadata"] = (cache_seqlens, q_tokens_per_head_k, heads_k)
        return "meta", "splits"

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, metadata, num_splits, *,
                               softmax_scale, causal):
        calls["call"] = dict(q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                             head_dim_v=head_dim_v, metadata=metadata, num_splits=num_splits,
                             softmax_scale=softmax_scale, causal=causal)
        return q[..., :head_dim_v] * 2, None

    _fake(monkeypatch, "flash_mla", get_mla_metadata=get_mla_metadata, flash_mla_with_kvcache=flash_mla_with_kvcache)
    assert flash_mla.probe().available and "found (version 9.9)" in vendor.report()["flash_mla"]
    q_latent, q_rope, kv_cache, tables, seqlens_k = _mla_case()
    out = flash_mla.mla_decode(q_latent, q_rope, kv_cache, tables, seqlens_k, softmax_scale=0.1, q_per_request=2)
    c = calls["call"]
    assert c["q"].shape == (3, 2, 4, 576)  # [batch, q per request, heads, latent ‖ rope]
    assert torch.equal(c["q"][1, 0, :, :512], q_latent[2]) and torch.equal(c["q"][1, 0, :, 512:], q_rope[2])
    assert c["k_cache"].shape == (7, 64, 1, 576) and c["k_cache"].data_ptr() == kv_cache.data_ptr()  # a view
    assert c["block_table"].dtype == torch.int32 and torch.equal(c["block_table"], tables.to(torch.int32))
    assert c["cache_seqlens"].dtype == torch.int32 and c["cache_seqlens"].tolist() == [70, 5, 128]
    assert (c["head_dim_v"], c["metadata"], c["num_splits"]) == (512, "meta", "splits")
    assert (c["softmax_scale"], c["causal"]) == (0.1, True)
    assert calls["metadata"][1:] == (2 * 4, 1)  # query tokens per KV head, one KV head
    torch.testing.assert_close(out, q_latent * 2)  # [T, H, 512] back in token order
    with pytest.raises(ValueError, match="not 3 requests x 3"):
        flash_mla.mla_decode(q_latent, q_rope, kv_cache, tables, seqlens_k, softmax_scale=0.1, q_per_request=3)
    assert "cache (7, 16, 576)" in flash_mla.unsupported(q_latent, q_rope, kv_cache[:, :16])


def test_deep_gemm_gets_rows_padded_per_expert_with_their_expert_index(monkeypatch):
    seen = {}

    def grouped(a, b, d, m_indices):  # the library's contract: d[i] = a[i] @ b[m_indices[i]].T, -1 rows untouched
        seen.update(a=a, m_indices=m_indices)
        for i, g in enumerate(m_indices.tolist()):
            if g >= 0:
                d[i] = (a[i].float() @ b[g].float().T).to(d.dtype)

    _fake(monkeypatch, "deep_gemm", m_grouped_bf16_gemm_nt_contiguous=grouped,
          m_grouped_fp8_gemm_nt_contiguous=grouped, get_mk_alignment_for_contiguous_layout=lambda: 4)
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5])
    x = torch.randn(8, 16, generator=g).bfloat16()
    w = torch.randn(3, 6, 16, generator=g).bfloat16()
    out = deep_gemm.m_grouped_gemm(x, w, counts)
    groups = torch.repeat_interleave(torch.arange(3), counts)
    want = torch.stack([(x[i].float() @ w[groups[i]].float().T).bfloat16() for i in range(8)])
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    # expert 0: 3 rows padded to 4; expert 1: none; expert 2: 5 rows padded to 8
    assert seen["m_indices"][:12].tolist() == [0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, -1]
    assert (seen["m_indices"][12:] == -1).all() and seen["a"].shape[0] % 4 == 0
    assert torch.equal(seen["a"][4:9], x[3:8])


def test_deep_ep_dispatch_and_combine_go_through_one_buffer(monkeypatch):
    log = []

    class Config:
        def get_nvl_buffer_size_hint(self, hidden_bytes, ranks):
            return hidden_bytes * ranks

        def get_rdma_buffer_size_hint(self, hidden_bytes, ranks):
            return 0

    class Buffer:
        get_dispatch_config = get_combine_config = staticmethod(lambda ranks: Config())

        def __init__(self, group, num_nvl_bytes, num_rdma_bytes):
            log.append(("init", num_nvl_bytes, num_rdma_bytes))

        def get_dispatch_layout(self, topk_idx, num_experts):
            log.append(("layout", topk_idx.dtype, num_experts))
            return "per_rank", None, "per_expert", "in_rank", "event"

        def dispatch(self, x, **kw):
            log.append(("dispatch", kw))
            return x * 1, kw["topk_idx"], kw["topk_weights"], [2, 1], "handle", "event"

        def combine(self, x, handle):
            log.append(("combine", handle))
            return x + 1, None, "event"

    _fake(monkeypatch, "deep_ep", Buffer=Buffer)
    group = types.SimpleNamespace(size=lambda: 2)
    ep = deep_ep.ExpertDispatch(group, num_experts=8, hidden_bytes=4096)
    hidden, ids, weights = torch.ones(3, 4).bfloat16(), torch.tensor([[0, 5], [1, 2], [7, 0]], dtype=torch.int32), \
        torch.full((3, 2), 0.5)
    got = ep.dispatch(hidden, ids, weights)
    assert log[0] == ("init", 8192, 0) and log[1] == ("layout", torch.int64, 8)
    kw = log[2][1]
    assert (kw["num_tokens_per_rank"], kw["num_tokens_per_rdma_rank"], kw["is_token_in_rank"],
            kw["num_tokens_per_expert"]) == ("per_rank", None, "in_rank", "per_expert")
    assert kw["topk_idx"].dtype == torch.int64 and torch.equal(kw["topk_idx"], ids.long())
    assert got.tokens_per_expert == [2, 1] and got.handle == "handle"
    assert torch.equal(ep.combine(got.hidden, got), hidden + 1) and log[3] == ("combine", "handle")
