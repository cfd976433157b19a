"""kernels_cuda.mla_decode (paged absorbed MLA decode on the FlashMLA layout, the pipelined kernel and, on 64-row
tiles, mla_decode_ws' warp-specialized one) and mla_prefill (the same kernel with a causal tile bound).

The oracle is an fp32 attention over the gathered pages here (the CPU backend's mla_attention takes another cache
layout, and the split / combine path is this layout's own). Tolerances, FlashMLA's: NaN / inf at the same
positions, cosine deficit 1 - 2<x,y>/(|x|^2+|y|^2) < 1e-5, every element within 2 bf16 ulps (2^-7 relative) of
|ref| + rms(ref) (prefill: 3, see ``PREFILL_OUT_ULPS``), lse within 0.25 of that; outputs NaN-poisoned first.
Cases: decode, verification (1..16 query tokens), short contexts (empty splits), odd lengths (partial last page),
varlen batches, at 16 and 128 heads; splits 1 (its own build) or several (one build for every count).
"""

import pytest
import torch

from deepinfer_npu.kernels_cuda import mla_decode as mla
from deepinfer_npu.kernels_cuda import mla_decode_ws as ws
from deepinfer_npu.kernels_cuda._testing import mla_paged

HEAD_DIM, KV_LORA, PAGE = mla.HEAD_DIM, mla.KV_LORA, mla.PAGE
# Causal rows with few keys average 1-3 values whose probabilities the kernel rounds to bf16 (as FlashMLA does);
# where those values cancel, |ref| is small and that rounding reaches 2.1 ulps of |ref| + rms(ref) (seen on an
# H200 at sk = sq = 300, cosine deficit 1.9e-6 as in the passing cases).
PREFILL_OUT_ULPS = 3.0


def mla_decode_ref(q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale):
    """fp32 attention over the gathered pages of each request (causal within the query tokens): (out, lse)."""
    Tq, H, _ = q_latent.shape
    out = torch.empty(Tq, H, KV_LORA, dtype=torch.float32, device=q_latent.device)
    lse = torch.empty(Tq, H, dtype=torch.float32, device=q_latent.device)
    sq_l, sk_l, cu_l = seqlens_q.tolist(), seqlens_k.tolist(), cu_seqlens_q.tolist()
    for b in range(block_tables.shape[0]):
        sq, sk, q0 = sq_l[b], sk_l[b], cu_l[b]
        if sq == 0:
            continue
        pages = block_tables[b, : -(-sk // PAGE)].long()
        kv = kv_cache[pages].reshape(-1, HEAD_DIM)[:sk].float()  # [sk, 576]
        q = torch.cat([q_latent[q0 : q0 + sq], q_rope[q0 : q0 + sq]], dim=-1).float()  # [sq, H, 576]
        s = torch.einsum("qhd,kd->qhk", q, kv) * softmax_scale
        pos_q = sk - sq + torch.arange(sq, device=q.device)
        mask = torch.arange(sk, device=q.device)[None, :] > pos_q[:, None]  # [sq, sk]
        s = s.masked_fill(mask[:, None, :], float("-inf"))
        lse[q0 : q0 + sq] = torch.logsumexp(s, dim=-1)
        out[q0 : q0 + sq] = torch.einsum("qhk,kd->qhd", torch.softmax(s, dim=-1), kv[:, :KV_LORA])
    return out, lse


def compare(out, ref, name, ulps=2.0):
    """FlashMLA-style: NaN/inf positions equal, cosine deficit 1 - 2<x,y>/(|x|^2+|y|^2) < 1e-5, and each
    element within `ulps` bf16 ulps (2^-7 relative) of the reference, measured against |ref| + rms(ref)."""
    out = out.float()
    ref = ref.float()
    if not torch.equal(torch.isnan(out), torch.isnan(ref)):
        return False, dict(name=name, error="NaN positions differ", n_nan=int(torch.isnan(out).sum()))
    if not torch.equal(torch.isinf(out), torch.isinf(ref)):
        return False, dict(name=name, error="inf positions differ")
    fin = torch.isfinite(ref)
    o, r = out[fin].double(), ref[fin].double()
    if r.numel() == 0:
        return True, dict(name=name, cos_diff=0.0, max_abs=0.0, worst_ulps=0.0)
    cos_diff = (1 - 2 * (o * r).sum() / ((o * o).sum() + (r * r).sum()).clamp_min(1e-30)).item()
    eps = 2.0**-7
    rms = r.pow(2).mean().sqrt().item()
    err = (o - r).abs()
    worst = (err / (eps * (r.abs() + rms))).max().item()
    ok = worst <= ulps and cos_diff < 1e-5
    return ok, dict(name=name, cos_diff=cos_diff, max_abs=err.max().item(), worst_ulps=worst)


def check_cases(seed=0):
    """(batch, heads, seqlens_k, seqlens_q, num_splits): decode, verification (1..16 q tokens), short contexts
    (empty splits), odd lengths (partial last page), varlen batches; split counts 1, 3 and a few others."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for H in (16, 128):
        cases += [
            (4, H, 1000, 1, 1),
            (3, H, 64, 1, 3),
            (5, H, 777, 4, 3 if H == 128 else 1),
            (6, H, 2049, 16, 3),
            (2, H, 5000, 16, 1),
        ]
        rb = 9
        sq = torch.randint(1, 17, (rb,), generator=g).tolist()
        sk = [max(k, q) for k, q in zip(torch.randint(16, 3000, (rb,), generator=g).tolist(), sq)]
        sq4 = [min(q, 4) for q in sq]
        cases += [(rb, H, sk, sq, 1), (rb, H, sk, sq, 3), (rb, H, sk, [1] * rb, 3), (rb, H, sk, sq4, 1)]
    # the same build at other split counts (the count is a launch-time size): more splits than pages (empty
    # splits), and a count that does not divide the pages
    cases += [(1, 16, 300, 1, 32), (2, 16, 3000, 1, 7), (3, 128, 1500, 1, 5)]
    return cases


def prefill_check_cases(seed=0):
    """(batch, heads, seqlens_k, seqlens_q): whole prompts (sk == sq), chunked prefill (context before the chunk),
    varlen batches with tiny and long chunks, partial last pages."""
    g = torch.Generator().manual_seed(seed + 1)
    cases = []
    for H in (16, 128):
        cases += [(2, H, 300, 300), (3, H, 1000, 257), (1, H, 64, 64), (1, H, 33, 17)]
        sq = torch.randint(1, 700, (5,), generator=g).tolist()
        sk = [q + c for q, c in zip(sq, torch.randint(0, 1500, (5,), generator=g).tolist())]
        cases.append((5, H, sk, sq))
    return cases


def q_bucket(seqlens_q) -> int:
    return mla.bucket_q(max(seqlens_q) if isinstance(seqlens_q, list) else seqlens_q)


def ws_cases(seed=0):
    """The decode cases whose tile has 64 rows (all 128-head ones; 16 heads from 2 query tokens), plus 16 heads with
    2 query tokens (32 valid rows of the 64: V2-Lite with one MTP draft)."""
    extra = [(4, 16, 1000, 2, 1), (5, 16, [700, 64, 1500, 2, 3000], 2, 3)]
    return [c for c in check_cases(seed) if ws.applies(c[1], q_bucket(c[3]))] + extra


def run_decode(batch, heads, seqlens_k, seqlens_q, num_splits, seed, warp_specialized=False):
    """Fresh inputs, NaN-poisoned outputs, the fp32 reference; -> (ok, stats)."""
    inp = mla_paged(batch, heads, seqlens_k, seqlens_q, seed=seed)
    tq = inp["q_latent"].shape[0]
    out = torch.full((tq, heads, KV_LORA), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tq, heads), float("nan"), dtype=torch.float32, device="cuda")
    max_q = max(seqlens_q) if isinstance(seqlens_q, list) else seqlens_q
    mla.mla_decode(**inp, softmax_scale=HEAD_DIM**-0.5, max_seqlen_q=max_q, num_splits=num_splits, out=out, lse=lse,
                   warp_specialized=warp_specialized)
    ref_o, ref_l = mla_decode_ref(**inp, softmax_scale=HEAD_DIM**-0.5)
    ok_o, so = compare(out, ref_o, "out")
    ok_l, sl = compare(lse, ref_l, "lse", ulps=0.25)
    return ok_o and ok_l, dict(out=so, lse=sl)


# ---- anywhere ------------------------------------------------------------------------------------------------------
def test_compare_rejects_what_it_must():
    ref = torch.randn(4, 16, 64)
    assert compare(ref.to(torch.bfloat16), ref, "out")[0]
    off = ref.clone()
    off[0, 0, 0] += 0.1 * (ref.abs().max() + 1)
    assert not compare(off, ref, "out")[0]
    nan = ref.clone()
    nan[1, 2, 3] = float("nan")
    assert not compare(nan, ref, "out")[0]


def test_prefill_buckets():
    assert [mla.bucket_prefill_q(q) for q in (1, 17, 32, 33, 1000, 8192)] == [32, 32, 32, 64, 1024, 8192]
    with pytest.raises(ValueError, match="outside 1..8192"):
        mla.bucket_prefill_q(8193)


def test_decode_configs():
    """The precompile keys the launches use: the 16-row tile for one token of 16 heads, 64-row tiles otherwise,
    flagged for mla_decode_ws where asked."""
    D = mla.DYNAMIC_SPLITS  # one build for every split count above 1; one split writes the output itself
    assert mla.decode_config(16, 1, 32) == mla.decode_config(16, 1, 2) == (16, 1, D, False, mla.SMALL_BLOCK_M)
    assert mla.decode_config(128, 1, 1) == (128, 2, 1)
    assert mla.decode_config(16, 2, 3, warp_specialized=True) == (16, 1, D, False, 64, True)
    with pytest.raises(ValueError, match="num_splits must be at least 1, got 0"):
        mla.decode_config(16, 1, 0)
    assert mla.bucket_q(3) == 4 and mla.m_tiles_for(128, 2) == 4


def test_mla_decode_ws_applies_to_the_64_row_tiles():
    assert not ws.applies(16, 1) and ws.applies(16, 2) and ws.applies(16, 16) and ws.applies(128, 1)
    cases = ws_cases()
    assert any(c[1] == 16 and q_bucket(c[3]) == 2 for c in cases)  # 32 valid rows of 64 (one MTP draft)
    assert {c[1] for c in cases} == {16, 128}  # 16 heads only from 2 query tokens up
    assert all(c[1] == 128 or (max(c[3]) if isinstance(c[3], list) else c[3]) > 1 for c in cases)


def test_ws_precompile_builds_what_get_kernel_asks_for(monkeypatch):
    """precompile builds each configuration once on this thread, then primes get_kernel's cache with the
    launcher's call form, so the launch does not build again."""
    built = []
    monkeypatch.setattr(ws, "build_mla_decode_ws", lambda *a: built.append(a) or a)
    monkeypatch.setattr(ws, "_compile", lambda f: f)
    ws.get_kernel.cache_clear()
    try:
        D = ws.DYNAMIC_SPLITS
        ws.precompile([(128, 2, 1), (16, 1, D)], softmax_scale=0.125)
        assert len(built) == 4  # two from precompile's pool, two from priming get_kernel's cache
        assert built[:2] == built[2:] == [(128, 2, 1, 0.125), (16, 1, D, 0.125)]
        ws.get_kernel(128, 2, 1, 0.125)  # the launcher's call: served from the cache precompile primed
        assert len(built) == 4
    finally:
        ws.get_kernel.cache_clear()


# ---- on a CUDA device ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("i,case", list(enumerate(check_cases())), ids=lambda c: str(c)[:40] if isinstance(c, tuple)
                         else str(c))
def test_mla_decode_matches_reference_gpu(i, case):
    ok, stats = run_decode(*case, seed=i)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("i,case", list(enumerate(ws_cases())), ids=lambda c: str(c)[:40] if isinstance(c, tuple)
                         else str(c))
def test_mla_decode_ws_matches_reference_gpu(i, case):
    assert mla.takes_warp_specialized(case[1], q_bucket(case[3]), True), ws.disabled_reason
    ok, stats = run_decode(*case, seed=1000 + i, warp_specialized=True)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
def test_mla_decode_default_splits_gpu():
    """The launch wrapper's own split heuristic (no num_splits given) on a small batch: several splits."""
    ok, stats = run_decode(2, 16, 4096, 1, None, seed=7)
    assert ok, stats


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("i,case", list(enumerate(prefill_check_cases())), ids=lambda c: str(c)[:40]
                         if isinstance(c, tuple) else str(c))
def test_mla_prefill_matches_reference_gpu(i, case):
    """Whole prompts, chunked prefill and varlen batches against the fp32 reference."""
    batch, heads, seqlens_k, seqlens_q = case
    inp = mla_paged(batch, heads, seqlens_k, seqlens_q, seed=100 + i)
    tq = inp["q_latent"].shape[0]
    out = torch.full((tq, heads, KV_LORA), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tq, heads), float("nan"), dtype=torch.float32, device="cuda")
    max_q = max(seqlens_q) if isinstance(seqlens_q, list) else seqlens_q
    mla.mla_prefill(**inp, softmax_scale=HEAD_DIM**-0.5, max_seqlen_q=max_q, out=out, lse=lse)
    ref_o, ref_l = mla_decode_ref(**inp, softmax_scale=HEAD_DIM**-0.5)
    ok_o, so = compare(out, ref_o, "out", ulps=PREFILL_OUT_ULPS)
    ok_l, sl = compare(lse, ref_l, "lse", ulps=0.25)
    assert ok_o and ok_l, dict(out=so, lse=sl)
