"""Prefill on decompressed keys (``backends/cuda/ops/mla_prefill_mha.py``): one MLA layer's prefill through
``CudaKernelSet.mla_forward`` against the CPU reference kernel set in fp32 (the absorbed form), for a step of
plain prompts and a chunk over a cached prefix (keys gathered from the block tables), and the engine's tokens with
the path on against the absorbed path (logprobs-close rule). bf16 tolerances: cosine >= 0.999 and max |error| <=
3 % of the reference's largest value (bf16 keeps 8 bits; the two forms round in different places).

The selection and refusal checks run anywhere; the rest needs CUDA."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer_npu.backends.cuda.ops.mla_prefill_mha import MLAPrefillMHA, context_slots
from deepinfer_npu.hal.types import MLAWeights
from deepinfer_npu.model_executor.attention_metadata import build_attention_metadata

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H, N, R, V, L, D, PAGE = 16, 128, 64, 128, 512, 1024, 64


def _weights(device, dtype, seed=0) -> MLAWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    return MLAWeights(num_heads=H, qk_nope_head_dim=N, qk_rope_head_dim=R, v_head_dim=V, kv_lora_rank=L,
                      kv_a_proj=r(L + R, D), kv_a_layernorm=(torch.rand(L, generator=g) + 0.5).to(dtype).to(device),
                      w_uk=r(H, N, L), w_uv=r(H, V, L), o_proj=r(D, H * V), q_proj=r(H * (N + R), D))


class _Rope:
    def __init__(self, device, max_pos=4096):
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
        freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        self.interleaved = True


def _close(got: torch.Tensor, want: torch.Tensor) -> dict:
    g, w = got.float().cpu().flatten(), want.float().cpu().flatten()
    cos = torch.nn.functional.cosine_similarity(g, w, dim=0).item()
    rel = ((g - w).abs().max() / w.abs().max()).item()
    return {"cos": cos, "rel": rel, "ok": cos >= 0.999 and rel <= 0.03}


def _steps():
    """(seqlens_q, seqlens_k) of two prefill steps: request 0's 300-token prompt and the first 200 tokens of
    request 1's, then request 1's last 60 over its cached prefix (keys gathered from the block tables)."""
    return [((300, 200), (300, 200)), ((60,), (260,))]


def _run(ks, w, rope, device, dtype, hidden_steps):
    cache = torch.zeros(16, PAGE, L + R, dtype=dtype, device=device)
    tables = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    outs = []
    (q0, k0), (q1, k1) = _steps()
    attn = build_attention_metadata(q0, k0, tables, PAGE, device=device, is_prefill=True)
    scale = (N + R) ** -0.5
    outs.append(ks.mla_forward(hidden_steps[0].to(device, dtype), w, attn.positions, rope, cache, attn, scale))
    attn = build_attention_metadata(q1, k1, tables[1:], PAGE, device=device, is_prefill=True)
    outs.append(ks.mla_forward(hidden_steps[1].to(device, dtype), w, attn.positions, rope, cache, attn, scale))
    return outs


def test_refusals_name_the_reason():
    mha = MLAPrefillMHA(ks=None)
    w = _weights("cpu", torch.bfloat16)
    cache = torch.zeros(4, PAGE, L + R, dtype=torch.bfloat16)
    hidden = torch.zeros(3, D, dtype=torch.bfloat16)
    decode = build_attention_metadata([1], [5], [[1]], PAGE, is_prefill=False)
    assert mha.reason(hidden, w, cache, decode) == "not a prefill step"
    prefill = build_attention_metadata([3], [3], [[1]], PAGE, is_prefill=True)
    assert "CUDA" in mha.reason(hidden, w, cache, prefill)


def test_context_slots_follow_the_block_tables():
    attn = build_attention_metadata([2, 3], [66, 3], [[4, 7], [9, 0]], PAGE, is_prefill=True)
    slots, cu_k = context_slots(attn, PAGE, 69)
    want = [4 * PAGE + p for p in range(64)] + [7 * PAGE, 7 * PAGE + 1] + [9 * PAGE + p for p in range(3)]
    assert slots.tolist() == want and cu_k.tolist() == [0, 66, 69]


def test_one_kv_gemm_gives_the_keys_and_the_padded_values():
    """The cache rows times ``kv_weight`` (bf16, as on the device): the rope columns of every head's key are the
    rows' k_rope bit for bit, V's padding columns are zero, and the rest is the two kv_b products; the weight is
    built once a layer."""
    mha = MLAPrefillMHA(ks=None)
    w = _weights("cpu", torch.bfloat16)
    rows = (torch.randn(37, L + R, generator=torch.Generator().manual_seed(1)) * 0.5).to(torch.bfloat16)
    weight = mha.kv_weight(w)
    assert weight.shape == (2 * H * (N + R), L + R) and mha.kv_weight(w) is weight
    kv = torch.nn.functional.linear(rows, weight)
    k, v = kv[:, : H * (N + R)].view(37, H, N + R), kv[:, H * (N + R):].view(37, H, N + R)
    assert torch.equal(k[..., N:], rows[:, None, L:].expand(37, H, R))
    assert torch.equal(v[..., V:], torch.zeros(37, H, N + R - V, dtype=torch.bfloat16))
    c = rows[:, :L].float()
    torch.testing.assert_close(k[..., :N].float(), torch.einsum("tl,hnl->thn", c, w.w_uk.float()), rtol=1e-2,
                               atol=1e-2)
    torch.testing.assert_close(v[..., :V].float(), torch.einsum("tl,hvl->thv", c, w.w_uv.float()), rtol=1e-2,
                               atol=1e-2)
    other = _weights("cpu", torch.bfloat16, seed=1)
    assert not torch.equal(mha.kv_weight(other), weight)  # a layer each


def test_kv_weights_are_kept_up_to_the_byte_budget(monkeypatch):
    from deepinfer_npu.backends.cuda.ops import mla_prefill_mha

    one = 2 * H * (N + R) * (L + R) * 2  # bytes of one layer's bf16 weight
    monkeypatch.setattr(mla_prefill_mha, "KV_WEIGHT_CACHE_BYTES", one + one // 2)
    mha = MLAPrefillMHA(ks=None)
    first, second = _weights("cpu", torch.bfloat16), _weights("cpu", torch.bfloat16, seed=1)
    kept = mha.kv_weight(first)
    made = mha.kv_weight(second)  # past the budget: made, not kept
    assert mha.kv_weight(first) is kept and mha.kv_weight(second) is not made
    assert torch.equal(mha.kv_weight(second), made)


def _reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size=None, is_causal=None):
    """Flash attention's varlen contract in fp32 torch: per request, causal aligned to the bottom right (query i
    of Lq sees keys j <= i + Lk - Lq), ``scale`` on the scores."""
    assert window_size == (-1, 0) or is_causal
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    for b in range(cu_q.numel() - 1):
        qs, qe, ks_, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        assert qe - qs <= max_q and ke - ks_ <= max_k
        s = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k[ks_:ke].float()) * scale
        lq, lk = qe - qs, ke - ks_
        mask = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
        p_ = s.masked_fill(mask, float("-inf")).softmax(-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p_, v[ks_:ke].float()).to(q.dtype)
    return out


def test_composition_matches_the_fp32_reference_on_cpu(monkeypatch):
    """The path's own arithmetic (un-absorbed query, keys gathered from the block tables over a cached prefix,
    kv_b GEMMs, padded values, o_proj) on CPU bf16 tensors with flash attention's contract in fp32 torch in its
    place: within the bf16 tolerances of the fp32 absorbed reference."""
    from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.backends.cuda.ops import mla_prefill_mha

    monkeypatch.setattr(mla_prefill_mha, "_varlen_attn", lambda direct=True: _reference_varlen_attn)
    monkeypatch.setattr(MLAPrefillMHA, "on_device", staticmethod(lambda x: True))
    g = torch.Generator().manual_seed(2)
    hidden = [torch.randn(500, D, generator=g), torch.randn(60, D, generator=g)]
    ks = CudaKernelSet()
    got = _run(ks, _weights("cpu", torch.bfloat16), _Rope("cpu"), "cpu", torch.bfloat16, hidden)
    assert "varlen flash attention" in ks.op_report()["mla_attention"]
    want = _run(CpuKernelSet(), _weights("cpu", torch.float32), _Rope("cpu"), "cpu", torch.float32, hidden)
    for step, (a, b) in enumerate(zip(got, want)):
        stats = _close(a, b)
        assert stats["ok"], (step, stats)
    # the control: with the mask aligned to the top left instead, the prefix chunk is wrong
    def top_left(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        return _reference_varlen_attn(q, k[: q.shape[0]], v[: q.shape[0]], cu_q, cu_q, max_q, max_q, **kw)

    monkeypatch.setattr(mla_prefill_mha, "_varlen_attn", lambda direct=True: top_left)
    bad = _run(CudaKernelSet(), _weights("cpu", torch.bfloat16), _Rope("cpu"), "cpu", torch.bfloat16, hidden)
    assert not _close(bad[1], want[1])["ok"]


def test_a_failing_direct_call_falls_back_to_the_public_function(monkeypatch):
    """aten's flash forward called directly (no custom-op wrapper) is the first choice; if a torch rejects that
    call, the path keeps going through the public varlen function, once warned, instead of turning itself off."""
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.backends.cuda.ops import mla_prefill_mha

    calls = []

    def direct(*a, **kw):
        calls.append("direct")
        raise TypeError("_flash_attention_forward() got an unexpected keyword argument 'scale'")

    def public(*a, **kw):
        calls.append("public")
        return _reference_varlen_attn(*a, **kw)

    monkeypatch.setattr(mla_prefill_mha, "_flash_varlen", direct)
    monkeypatch.setattr(mla_prefill_mha, "_varlen_attn", lambda d=True: direct if d else public)
    monkeypatch.setattr(MLAPrefillMHA, "on_device", staticmethod(lambda x: True))
    g = torch.Generator().manual_seed(2)
    hidden = [torch.randn(500, D, generator=g), torch.randn(60, D, generator=g)]
    ks = CudaKernelSet()
    _run(ks, _weights("cpu", torch.bfloat16), _Rope("cpu"), "cpu", torch.bfloat16, hidden)
    assert calls[:2] == ["direct", "public"] and set(calls[2:]) == {"public"}, calls
    assert "varlen flash attention" in ks.op_report()["mla_attention"]


@gpu
@pytest.mark.gpu
def test_direct_flash_call_equals_the_public_varlen_function():
    """The direct call gives the public function's output bit for bit (the same kernel), a cached prefix included
    (queries fewer than keys: the bottom-right causal alignment)."""
    from torch.nn.attention.varlen import varlen_attn

    from deepinfer_npu.backends.cuda.ops import mla_prefill_mha

    g = torch.Generator(device="cuda").manual_seed(0)
    lq, lk, h, d = [5, 300, 1], [5, 420, 77], 16, 192
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(lk), h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(lk), h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = [torch.tensor([0] + list(itertools.accumulate(x)), device="cuda", dtype=torch.int32) for x in (lq, lk)]
    direct = mla_prefill_mha._flash_varlen(q, k, v, *cu, max(lq), max(lk), scale=0.07, is_causal=True)
    public = varlen_attn(q, k, v, *cu, max(lq), max(lk), scale=0.07,
                         **mla_prefill_mha._causal_kwargs(varlen_attn))
    assert torch.equal(direct, public)


@gpu
@pytest.mark.gpu
def test_prefill_on_decompressed_keys_matches_the_fp32_reference():
    from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    g = torch.Generator().manual_seed(1)
    hidden = [torch.randn(500, D, generator=g), torch.randn(60, D, generator=g)]
    ks = CudaKernelSet()
    got = _run(ks, _weights("cuda", torch.bfloat16), _Rope("cuda"), "cuda", torch.bfloat16, hidden)
    report = ks.op_report()["mla_attention"]
    assert "varlen flash attention" in report, report
    want = _run(CpuKernelSet(), _weights("cpu", torch.float32), _Rope("cpu"), "cpu", torch.float32, hidden)
    for step, (a, b) in enumerate(zip(got, want)):
        stats = _close(a, b)
        assert stats["ok"], (step, stats)


@gpu
@pytest.mark.gpu
def test_absorbed_path_when_left_out(monkeypatch):
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    monkeypatch.setattr(CudaKernelSet, "SKIP", frozenset({"mla_prefill_mha"}))
    ks = CudaKernelSet()
    g = torch.Generator().manual_seed(1)
    hidden = [torch.randn(500, D, generator=g), torch.randn(60, D, generator=g)]
    _run(ks, _weights("cuda", torch.bfloat16), _Rope("cuda"), "cuda", torch.bfloat16, hidden)
    report = ks.op_report()["mla_attention"]
    assert "varlen flash attention" not in report and "mla_prefill" in report, report


@gpu
@pytest.mark.gpu
@pytest.mark.tilelang
def test_engine_tokens_follow_the_absorbed_path(monkeypatch, deepseek_dims_model, assert_logprobs_close):
    """DeepSeek dims (random weights), prompts of 100-700 tokens, chunked prefill of 256 tokens: greedy tokens with
    the decompressed prefill against the absorbed one by the logprobs-close rule of conftest."""
    from deepinfer_npu import LLM, SamplingParams
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    model = deepseek_dims_model()
    prompts = [{"prompt_token_ids": [(7 * i + 31 * b) % 4000 + 3 for i in range(n)]}
               for b, n in enumerate((100, 333, 700))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    runs = {}
    for name, skip in (("absorbed", {"mla_prefill_mha"}), ("decompressed", set())):
        monkeypatch.setattr(CudaKernelSet, "SKIP", frozenset(skip))
        llm = LLM(model, load_format="dummy", backend="cuda", dtype="bfloat16", max_model_len=1024,
                  max_num_seqs=4, max_num_batched_tokens=256, enable_chunked_prefill=True, seed=0)
        kernels = llm.llm_engine.backend.kernels
        kernels.log = type(kernels.log)()  # the backend is cached per process: report this engine's calls only
        runs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        report = llm.llm_engine.backend.op_report()["mla_attention"]
        assert ("varlen flash attention" in report) == (name == "decompressed"), report
        del llm
    assert_logprobs_close(runs["absorbed"], runs["decompressed"])
