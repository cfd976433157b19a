"""CPU reference ops against independent references: dense attention, HF routers / norms / rope, naive MoE."""

from __future__ import annotations

import pytest
import torch
from deepinfer_npu.backends.cpu.kernels import CpuKernelSet

from deepinfer_npu.hal import GatingParams, KernelSet
from deepinfer_npu.model_executor import build_attention_metadata

K = CpuKernelSet()


# ---- MLA attention over the paged cache vs dense attention -------------------------------------------------
def _dense_mla(q_latent, q_rope, keys, q_len, scale):
    """Non-paged reference for one request: keys [k_len, L+R], causal with the queries at the end."""
    lrank = q_latent.shape[-1]
    k_len = keys.shape[0]
    kd = keys.double()
    scores = (q_latent.double() @ kd[:, :lrank].T + q_rope.double() @ kd[:, lrank:].T) * scale  # [q, H, k]
    for j in range(q_len):
        scores[j, :, k_len - q_len + j + 1 :] = float("-inf")
    return torch.softmax(scores, dim=-1) @ kd[:, :lrank]


@pytest.mark.parametrize(
    "seqlens", [[(1, 1), (1, 17), (1, 40)], [(5, 5), (16, 16), (3, 33)], [(4, 20), (2, 2)]]
)
def test_mla_attention_matches_dense(seqlens):
    torch.manual_seed(0)
    heads, lrank, rdim, bs, nblocks = 4, 32, 8, 16, 24
    cache = torch.zeros(nblocks, bs, lrank + rdim)
    free = (torch.randperm(nblocks - 1) + 1).tolist()
    tables, dense_keys = [], []
    for _, k_len in seqlens:
        blocks = [free.pop() for _ in range(-(-k_len // bs))]
        keys = torch.randn(k_len, lrank + rdim)
        for pos in range(k_len):
            cache[blocks[pos // bs], pos % bs] = keys[pos]
        tables.append(blocks)
        dense_keys.append(keys)
    width = max(map(len, tables))
    tables = [t + [0] * (width - len(t)) for t in tables]
    attn = build_attention_metadata([q for q, _ in seqlens], [k for _, k in seqlens], tables, bs)
    total = attn.num_tokens
    q_latent, q_rope = torch.randn(total, heads, lrank), torch.randn(total, heads, rdim)
    out = K.mla_attention(
        q_latent, q_rope, cache, attn.block_tables, attn.seqlens_q, attn.seqlens_k, attn.cu_seqlens_q, 0.17
    )
    start = 0
    for (q_len, _), keys in zip(seqlens, dense_keys):
        ref = _dense_mla(q_latent[start : start + q_len], q_rope[start : start + q_len], keys, q_len, 0.17)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, rtol=1e-5, atol=1e-5)
        start += q_len


def test_build_attention_metadata_slots_and_positions():
    attn = build_attention_metadata([2, 1], [18, 5], [[3, 7], [9, 0]], 16)
    assert attn.positions.tolist() == [16, 17, 4]
    assert attn.slot_mapping.tolist() == [7 * 16 + 0, 7 * 16 + 1, 9 * 16 + 4]
    assert attn.cu_seqlens_q.tolist() == [0, 2, 3]
    assert attn.cu_seqlens_q.dtype == torch.int32 and attn.slot_mapping.dtype == torch.int64
    assert (attn.max_seqlen_q, attn.max_seqlen_k, attn.is_prefill) == (2, 18, True)
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([1], [40], [[1, 2]], 16)


def test_kv_write_skips_negative_slots():
    cache = torch.zeros(3, 4, 6)
    from deepinfer_npu.backends.cpu.mla import write_kv_cache

    write_kv_cache(cache, torch.ones(3, 6), torch.tensor([5, -1, 8]))
    assert cache.view(-1, 6).sum(-1).nonzero().flatten().tolist() == [5, 8]


# ---- gating vs transformers' routers -----------------------------------------------------------------------
def _router_case(kind, **cfg_kw):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    base = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4)
    if kind == "v2":
        cfg = DeepseekV2Config(**base, **cfg_kw)
        router = DeepseekV2TopkRouter(cfg)
    else:
        cfg = DeepseekV3Config(**base, **cfg_kw)
        router = DeepseekV3TopkRouter(cfg)
        router.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    return cfg, router


@pytest.mark.parametrize(
    "kind,cfg_kw",
    [
        ("v2", dict(topk_method="greedy", routed_scaling_factor=1.3)),
        ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
        ("v3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
        ("v3", dict(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    ],
)
def test_gating_matches_hf_router(kind, cfg_kw):
    cfg, router = _router_case(kind, **cfg_kw)
    hidden = torch.randn(50, 32)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(hidden)
    params = GatingParams(
        top_k=4,
        num_experts=16,
        scoring_func="softmax" if kind == "v2" else "sigmoid",
        topk_method=cfg_kw.get("topk_method", "noaux_tc"),
        n_group=cfg.n_group or 1,
        topk_group=cfg.topk_group or 1,
        norm_topk_prob=kind == "v3" and cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    bias = router.e_score_correction_bias if kind == "v3" else None
    weights, ids = K.moe_gating_topk(logits, bias, params)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    # The order of the k choices is unspecified: compare per-token sorted by expert id.
    ids_sorted, perm = ids.long().sort(-1)
    ref_sorted, ref_perm = ref_ids.sort(-1)
    assert torch.equal(ids_sorted, ref_sorted)
    torch.testing.assert_close(weights.gather(1, perm), ref_w.gather(1, ref_perm), rtol=1e-6, atol=1e-7)


def test_moe_dispatch_grouped_combine_matches_naive():
    torch.manual_seed(0)
    t, d, inter, e, k = 13, 16, 8, 6, 3
    hidden = torch.randn(t, d)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int()
    ids[0] = torch.tensor([5, 4, 3])  # expert 0..2 may end up unused by some tokens; keep one full row fixed
    weights = torch.rand(t, k)
    w13, w2 = torch.randn(e, 2 * inter, d), torch.randn(e, d, inter)
    sorted_h, counts, state = K.moe_dispatch(hidden, ids, e)
    assert counts.tolist() == torch.bincount(ids.flatten().long(), minlength=e).tolist()
    assert sorted_h.shape == (t * k, d)
    out = K.moe_combine(K.grouped_mlp(sorted_h, counts, w13, w2), state, weights)
    ref = torch.zeros(t, d)
    for i in range(t):
        for j in range(k):
            x = int(ids[i, j])
            g, u = (w13[x] @ hidden[i]).chunk(2)
            ref[i] += weights[i, j] * (w2[x] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---- norms and rope vs transformers ------------------------------------------------------------------------
def test_rms_norm_and_add_rms_norm_match_hf():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    torch.manual_seed(0)
    norm = DeepseekV3RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, res = torch.randn(7, 24), torch.randn(7, 24)
    for dtype in (torch.float32, torch.bfloat16):
        norm_d = norm.to(dtype)
        xd, rd = x.to(dtype), res.to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(K.rms_norm(xd, norm_d.weight, 1e-5), norm_d(xd), rtol=0, atol=0)
            y, s = K.add_rms_norm(xd, rd, norm_d.weight, 1e-5)
            torch.testing.assert_close(s, xd + rd, rtol=0, atol=0)
            torch.testing.assert_close(y, norm_d(xd + rd), rtol=0, atol=0)


def test_rope_matches_hf_layouts():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb

    from deepinfer_npu.model_executor.layers.rope import RotaryEmbedding

    torch.manual_seed(0)
    rdim, t, h = 8, 11, 3
    pos = torch.randint(0, 100, (t,))
    x = torch.randn(t, h, rdim)
    rope = RotaryEmbedding(rdim, 128, 10000.0, None, interleaved=True)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rdim, 2, dtype=torch.float32) / rdim))
    freqs = pos[None, :, None].float() * inv_freq  # [1, T, R/2]
    # V2 (complex, interleaved pairs, interleaved output): HF expects [B, H, T, R].
    ref, _ = apply_rotary_emb(
        x.transpose(0, 1)[None], x.transpose(0, 1)[None], torch.polar(torch.ones_like(freqs), freqs)
    )
    got = K.rope(x, pos, rope.cos_sin_cache, True)
    torch.testing.assert_close(got, ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    # NeoX halves (V3 with rope_interleave=False).
    emb = torch.cat((freqs, freqs), -1)
    ref2, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], emb.cos(), emb.sin())
    got2 = K.rope(x, pos, rope.cos_sin_cache, False)
    torch.testing.assert_close(got2, ref2[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


# ---- fallbacks ---------------------------------------------------------------------------------------------
def test_partial_kernel_set_falls_back_and_reports():
    class OnlyNorm(CpuKernelSet):
        FALLBACK_REASONS = {"mla_attention": "waiting for the paged kernel"}

        def rms_norm(self, x, weight, eps):
            return K.rms_norm(x, weight, eps)

    ks = OnlyNorm()
    report = ks.op_report()
    assert report["rms_norm"] == "native"
    assert report["mla_attention"] == "fallback (waiting for the paged kernel)"
    assert report["linear"].startswith("fallback (")
    assert set(report) == set(KernelSet.OPS)
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    torch.testing.assert_close(ks.linear(x, w), K.linear(x, w))
    assert all(v == "native" for v in CpuKernelSet().op_report().values())


def test_kernel_set_is_an_abstract_contract():
    with pytest.raises(TypeError, match="abstract"):
        KernelSet()
    assert "sample" not in KernelSet.OPS and not hasattr(CpuKernelSet, "sample")
