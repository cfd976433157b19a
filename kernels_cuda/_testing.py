"""Inputs and distances shared by the kernel checks (tests/kernels_cuda) and ``bench.py``: the layouts the engine
passes, with the values that make a check able to fail (poisoned cache tails, NaN / inf entries, ties, rows without
tokens), and distances in representable values."""

import dataclasses

import torch

from deepinfer_npu.hal.types import GatingParams
from deepinfer_npu.sampling.metadata import SamplingTensors

from ._mla_common import HEAD_DIM, KV_LORA, PAGE, ROPE


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-element distance in bf16 representable values between a and b (bf16, same shape); NaN pairs -> 0,
    a NaN against a number -> inf."""
    ia = a.contiguous().view(torch.int16).int()
    ib = b.contiguous().view(torch.int16).int()
    oa = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # order-preserving; +0 and -0 both map to 0
    ob = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    d = (oa - ob).abs().float()
    na, nb = torch.isnan(a), torch.isnan(b)
    d = torch.where(na & nb, torch.zeros_like(d), d)
    return torch.where(na ^ nb, torch.full_like(d, float("inf")), d)


def bf16_within(out: torch.Tensor, ref: torch.Tensor, max_ulps: float) -> tuple[bool, dict]:
    """(ok, stats): NaN and inf at the same positions and every element within ``max_ulps`` bf16 ulps."""
    same = torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))
    d = bf16_ulps(out, ref)
    worst = d.max().item() if d.numel() else 0.0
    stats = dict(max_ulps=worst, n_off=int((d > 0).sum()), exact=worst == 0.0, same_nan_inf=same)
    return same and worst <= max_ulps, stats


def f32_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 representable values between a and b (fp32, same shape)."""
    ia = a.contiguous().view(torch.int32).long()
    ib = b.contiguous().view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return (ia - ib).abs().max().item() if a.numel() else 0


# ---- paged MLA (mla_decode, mla_prefill, mla_rope_cache, mla_absorb) ---------------------------------------------
def mla_paged(batch, heads, seqlens_k, seqlens_q, device="cuda", seed=0, spare_blocks=2):
    """Random paged problem, shuffled pages. seqlens_k / seqlens_q: int or list per request. Cache slots past
    seqlens_k and an unreferenced 'poison' page (where unused block-table entries point) hold large finite
    values,
    so a missing mask or an out-of-range page read shows in the output."""
    g = torch.Generator(device=device).manual_seed(seed)
    sk = [seqlens_k] * batch if isinstance(seqlens_k, int) else list(seqlens_k)
    sq = [seqlens_q] * batch if isinstance(seqlens_q, int) else list(seqlens_q)
    assert all(1 <= q <= k for q, k in zip(sq, sk))
    nbs = [-(-k // PAGE) for k in sk]
    nb_max = max(nbs) + spare_blocks
    used = sum(nbs)
    poison_page = used
    perm = torch.randperm(used, generator=torch.Generator().manual_seed(seed))
    bt = torch.full((batch, nb_max), poison_page, dtype=torch.int32)
    o = 0
    for b in range(batch):
        bt[b, : nbs[b]] = perm[o : o + nbs[b]].int()
        o += nbs[b]
    kv = torch.randn(used + 1, PAGE, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16)
    for b in range(
        batch
    ):  # poison the tail of each request's last page (finite: see the module precondition)
        tail = sk[b] % PAGE
        if tail:
            kv[int(bt[b, nbs[b] - 1]), tail:] = 3.0e4
    kv[poison_page] = 3.0e4
    Tq = sum(sq)
    ql = torch.randn(Tq, heads, KV_LORA, generator=g, device=device, dtype=torch.bfloat16)
    qr = torch.randn(Tq, heads, ROPE, generator=g, device=device, dtype=torch.bfloat16)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(sq, dtype=torch.int32), 0)
    return dict(
        q_latent=ql,
        q_rope=qr,
        kv_cache=kv,
        block_tables=bt.to(device),
        seqlens_q=torch.tensor(sq, dtype=torch.int32, device=device),
        seqlens_k=torch.tensor(sk, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
    )


def cos_sin_cache(max_pos, device="cuda", base=10000.0, attention_factor=0.7071):
    """[cos | sin] fp32 rows as model_executor/layers/rope.py builds them (plain RoPE, a YaRN-like factor)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1).to(device)


def rope_cache(num_tokens, heads, max_pos=8192, pad_every=0, num_blocks=None, q_dim=192, seed=0, special=False,
                device="cuda"):
    """Random problem: distinct slots spread over shuffled blocks (block 0 never used), every ``pad_every``-th
    row a padding row (slot -1), positions in [0, max_pos) including both ends. ``special``: a NaN in q, an inf
    in k_pe and in c_kv, a row whose squares overflow fp32, an all-zero c_kv row."""
    g = torch.Generator(device=device).manual_seed(seed)
    gc = torch.Generator().manual_seed(seed)
    T_ = num_tokens
    kv = torch.randn(T_, HEAD_DIM, generator=g, device=device) * 2
    kv[:, KV_LORA:] *= 4
    if T_ > 2:  # rows of very different scale: the norm must not depend on it
        kv[1] *= 1e-3
        kv[2] *= 300.0
    kv = kv.to(torch.bfloat16)
    weight = (torch.rand(KV_LORA, generator=g, device=device) + 0.5).to(torch.bfloat16)
    q = (torch.randn(T_, heads, q_dim, generator=g, device=device) * 3).to(torch.bfloat16)
    positions = torch.randint(0, max_pos, (T_,), generator=gc)
    positions[0] = max_pos - 1
    if T_ > 1:
        positions[1] = 0
    need = T_ + 2 * PAGE
    num_blocks = num_blocks or (need // PAGE + 2)
    slot_pool = torch.randperm((num_blocks - 1) * PAGE, generator=gc)[:T_] + PAGE  # block 0 stays untouched
    slots = slot_pool.clone()
    if pad_every:
        slots[pad_every - 1 :: pad_every] = -1
    if special and T_ >= 6:
        q[0, 0, q_dim - ROPE + 3] = float("nan")
        kv[3, KV_LORA + 5] = float("inf")
        kv[4, 7] = float("-inf")
        kv[5, :KV_LORA] = 3e38  # squares overflow: mean square inf, rsqrt 0
        if T_ > 6:
            kv[6, :KV_LORA] = 0.0
    cache = torch.randn(num_blocks, PAGE, HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    return dict(
        kv=kv,
        weight=weight,
        eps=1e-6,
        q=q,
        q_off=q_dim - ROPE,
        positions=positions.to(device),
        cos_sin_cache=cos_sin_cache(max_pos, device),
        kv_cache=cache,
        slot_mapping=slots.to(device),
    )


def absorb(heads, nope=128, lrank=512, q_dim=192, seed=0, special=False, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(1, heads, q_dim, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(heads, nope, lrank, generator=g) * 0.05).to(torch.bfloat16)
    if special:
        q[0, 0, 3] = float("nan")  # head 0: every column NaN
        w[1, 5, 7] = float("inf")  # head 1, column 7: inf (or NaN with a 0 query entry)
        q[0, 2, : nope // 2] = 0  # head 2: half the rows contribute nothing
    return q.to(device), w.to(device)


# ---- expert and dense GEMMs (moe_gemm, moe_gemm_swap, skinny_gemm) --------------------------------------------
def expert_rows(tokens: int, top_k: int, experts: int, n: int, k: int, seed: int = 0, skew: bool = False,
                dtype=torch.bfloat16):
    """Rows sorted by expert ([tokens * top_k, k]), expert weights [experts, n, k] and the tokens per expert; ``skew``:
    every token picks expert 0 first (one expert with many rows, many empty)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if skew:
        ids = torch.stack([torch.zeros(tokens, dtype=torch.long, device="cuda")]
                          + [torch.randint(1, experts, (tokens,), generator=g, device="cuda")
                             for _ in range(top_k - 1)], 1)
    else:
        ids = torch.stack([torch.randperm(experts, generator=g, device="cuda")[:top_k] for _ in range(tokens)])
    counts = torch.bincount(ids.flatten(), minlength=experts)
    m = tokens * top_k
    a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(experts, n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    return a, w, counts


def dense_rows(m, n, k, dtype=torch.bfloat16, w_dtype=torch.bfloat16, seed=0):
    """``a`` [m, k] and a weight [n, k] scaled by 1/sqrt(k)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    return a, (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(w_dtype)


def grouped_gemm_fp32(a: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """fp32 reference of the expert GEMMs: per expert, its rows @ w[e]^T."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for e, c in enumerate(tokens_per_expert.tolist()):
        if c:
            out[start : start + c] = a[start : start + c].float() @ w[e].float().t()
        start += c
    return out


def grouped_mlp_gate_fp32(a: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """fp32 reference of a gated expert GEMM (``w`` = [gate | up]) with the roundings of the CPU reference's SwiGLU:
    bf16 GEMM outputs, silu rounded to bf16, the product rounded to bf16."""
    g, u = grouped_gemm_fp32(a, w, tokens_per_expert).to(torch.bfloat16).chunk(2, dim=-1)
    s = torch.nn.functional.silu(g.float()).to(torch.bfloat16)
    return (s.float() * u.float()).to(torch.bfloat16).float()


def expert_starts_ref(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``moe_gemm.expert_starts``' layout on the host: the exclusive scan of the counts, then the experts with
    rows, -1 padded (int32 [2E + 1])."""
    counts = tokens_per_expert.to(torch.int64).cpu()
    e = counts.shape[0]
    scan = torch.full((2 * e + 1,), -1, dtype=torch.int32)
    scan[0] = 0
    scan[1 : e + 1] = torch.cumsum(counts, 0).to(torch.int32)
    hit = torch.nonzero(counts > 0).flatten().to(torch.int32)
    scan[e + 1 : e + 1 + hit.numel()] = hit
    return scan


def close_to(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> tuple[bool, dict]:
    """(ok, stats): every element within ``tol`` of ``ref``, NaN at the same positions, cosine > 0.99999."""
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    bad = int((err > tol).sum())
    same_nan = bool(torch.equal(torch.isnan(out), torch.isnan(ref)))
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    return bad == 0 and same_nan and cos > 0.99999, dict(max_err=err.max().item(), beyond_tol=bad, cos=cos,
                                                         same_nan=same_nan)


# ---- step inputs, ZOS, verification ----------------------------------------------------------------------------
def decode_step(rows, q_lo, q_hi, k, block_size=64, short_tables=False, neg_first=0.3, zero_rows=0.0, seed=0,
                 device="cuda"):
    """Operands as the worker passes them; returns (args, block_size, num_tokens). ``short_tables``: the tables
    are narrower than the longest context needs (positions past them map to block 0); ``zero_rows``: that fraction
    of rows has q = 0 (row 0 keeps q >= 1, so T >= 1); ``neg_first``: fraction of first_ids that are -1."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * rows + 3
    q = torch.randint(q_lo, q_hi + 1, (rows,), generator=g)
    q[torch.rand(rows, generator=g) < zero_rows] = 0
    q[0] = max(int(q[0]), 1)
    sk = q + torch.randint(0, 5000, (rows,), generator=g)
    w = -(-int(sk.max()) // block_size)
    w = max(1, w // 3) if short_tables else w
    tables = torch.randint(0, 1 << 20, (rows, w), generator=g, dtype=torch.int32)
    slots = torch.randperm(s, generator=g)[:rows]
    first = torch.randint(0, 1 << 17, (rows,), generator=g)
    first[torch.rand(rows, generator=g) < neg_first] = -1
    last = torch.randint(0, 1 << 17, (s,), generator=g)
    drafts = torch.randint(0, 1 << 17, (s, k), generator=g)
    args = [q.int(), sk.int(), tables, slots, first, last, drafts]
    return [x.to(device) for x in args], block_size, int(q.sum())


def zos_step(rows, k, resplit=True, probs="rand", opt_frac=0.7, num_slots=None, seed=0, device="cuda"):
    """Inputs as the worker passes them: int32 lengths, bool optimistic, int64 slots (a permutation of a larger
    slot table), int64 corrections in [0, k], fp32 draft probabilities [S, k], int64 caps >= the planned drafts.
    ``probs``: 'rand' (distinct); 'ties' (values from {0, 0.25, 0.5, 1}: equal products, exact zeros); 'special'
    (NaN, > 1, < 0, denormals, exact ones); 'conf' (drafter-like: high confidences near 1)."""
    g = torch.Generator().manual_seed(seed)
    s = num_slots or max(rows + 3, 2 * rows)
    slots = torch.randperm(s, generator=g)[:rows]
    opt = torch.rand(rows, generator=g) < opt_frac
    if rows > 1:
        opt[0] = True
    caps = torch.randint(0, k + 1, (rows,), generator=g)
    planned = (torch.rand(rows, generator=g) * (caps + 1).float()).long().clamp(max=caps)  # drafts <= caps
    sq = (1 + planned).int()
    sk = (sq.long() + torch.randint(k + 1, 5000, (rows,), generator=g)).int()
    corr = torch.randint(0, k + 1, (s,), generator=g)
    if probs == "ties":
        p = torch.tensor([0.0, 0.25, 0.5, 1.0])[torch.randint(0, 4, (s, k), generator=g)]
    elif probs == "conf":
        p = 1 - torch.rand(s, k, generator=g) ** 3 * 0.2
    else:
        p = torch.rand(s, k, generator=g)
        if probs == "special":
            m = torch.randint(0, 8, (s, k), generator=g)
            p[m == 0] = float("nan")
            p[m == 1] = 1.5
            p[m == 2] = -0.25
            p[m == 3] = 1.0
            p[m == 4] = 1e-42
    dp = p.float() if resplit else None
    cp = caps if resplit else None
    out = [sq, sk, opt, slots, corr, dp, cp]
    return [x.to(device) if x is not None else None for x in out]


def sampling(n, greedy_frac=1.0, seed=0, device="cuda"):
    """SamplingTensors for n rows: a fraction greedy, the others with temperatures in [0.2, 2] (no top-k/p)."""
    g = torch.Generator().manual_seed(seed)
    greedy = torch.rand(n, generator=g) < greedy_frac
    temp = torch.where(greedy, torch.ones(n), 0.2 + 1.8 * torch.rand(n, generator=g))
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) * 2 + torch.randint(0, 2, (n,),
                                                                                                       generator=g)
    offsets = torch.randint(0, 1 << 40, (n,), generator=g, dtype=torch.int64)
    offsets[: n // 2] = torch.randint(0, 4096, (n // 2,), generator=g)
    return SamplingTensors(
        temperature=temp.float().to(device), top_k=torch.zeros(n, dtype=torch.int64, device=device),
        top_p=torch.ones(n, device=device), is_greedy=greedy.to(device), seeds=seeds.to(device),
        offsets=offsets.to(device), all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()),
    )


def verify_logits(n, v, kind, generator, device="cuda"):
    """'randn'; 'ties' (integers in [-3, 3]: many equal maxima); 'special' (+inf, -inf rows, NaN, all-NaN and
    NaN-with-+inf rows, +-0 maxima, denormals, huge values); 'equal' (every logit 0.5)."""
    if kind == "equal":
        return torch.full((n, v), 0.5, device=device)
    if kind == "ties":
        return torch.randint(-3, 4, (n, v), generator=generator, device=device).float()
    x = torch.randn(n, v, generator=generator, device=device) * 4
    if kind == "special":
        r = torch.arange(n, device=device)
        cols = torch.randint(0, v, (n, 4), generator=generator, device=device)
        pick = r % 8
        x[pick == 0, :] = float("-inf")  # all -inf: index 0
        x[pick == 1] = float("-inf")
        x[(pick == 1).nonzero().flatten(), cols[pick == 1, 0]] = -3.0e38  # one finite value among -inf
        x[(pick == 2).nonzero().flatten()[:, None], cols[pick == 2]] = float("inf")  # several +inf: lowest
        x[(pick == 3).nonzero().flatten()[:, None], cols[pick == 3]] = float("nan")  # NaN wins: lowest NaN
        x[(pick == 4).nonzero().flatten(), cols[pick == 4, 0]] = float("inf")
        x[(pick == 4).nonzero().flatten(), cols[pick == 4, 1]] = float("nan")  # NaN beats +inf
        x[pick == 5] = float("nan")  # all NaN: index 0
        x[pick == 6] = -x[pick == 6].abs() - 1  # all negative, then +-0 maxima: -0.0 == +0.0, lowest index
        z = (pick == 6).nonzero().flatten()
        x[z[:, None], cols[pick == 6]] = torch.tensor([-0.0, 0.0, -0.0, 0.0], device=device)
        x[pick == 7] = x[pick == 7] * 1e-40  # denormals (no flush to zero)
    return x


def verify_step(rows, max_q, v, kind="randn", accept_p=0.7, layout="worker", seed=0, device="cuda"):
    """A verification step as the worker builds it: row i has q_i in 1..max_q tokens [last, draft_1..]; drafts
    equal the target's arg-max with probability ``accept_p`` (so the accepted prefix varies). ``layout``:
    'worker' (rows in order), 'prefill' (one token a row, draft -1, max_q 1), 'full' (every row max_q tokens),
    'shuffled' (tokens permuted, a few rows without tokens)."""
    g = torch.Generator(device=device).manual_seed(seed)
    gc = torch.Generator().manual_seed(seed)
    if layout in ("prefill", "full"):
        q = torch.full((rows,), 1 if layout == "prefill" else max_q, dtype=torch.int64)
    else:
        q = torch.randint(1, max_q + 1, (rows,), generator=gc)
        q[0] = max_q
        if layout == "shuffled":
            q[torch.randperm(rows, generator=gc)[: max(1, rows // 8)]] = 0
    n = int(q.sum())
    row = torch.repeat_interleave(torch.arange(rows), q)
    cu = torch.zeros(rows + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(q, 0)
    j = torch.arange(n) - cu[:-1][row]
    logits = verify_logits(n, v, kind, g, device)
    greedy = logits.argmax(-1).cpu()
    other = torch.randint(0, v, (n,), generator=gc)
    nxt = torch.where(torch.rand(n, generator=gc) < accept_p, greedy, other)
    has_next = (j + 1) < q[row]
    draft = torch.where(has_next, nxt, torch.full_like(nxt, -1))
    if layout == "shuffled":
        perm = torch.randperm(n, generator=gc)
        logits, draft, row, j = logits[perm.to(device)], draft[perm], row[perm], j[perm]
    return dict(logits=logits, draft_next=draft.to(device), row_of_token=row.to(device), j_of_token=j.to(device),
                num_rows=rows, max_q=max_q)


# ---- MoE routing -----------------------------------------------------------------------------------------------
V2_LITE = GatingParams(top_k=6, num_experts=64)
V2 = GatingParams(top_k=6, num_experts=160, topk_method="group_limited_greedy", n_group=8, topk_group=3,
            routed_scaling_factor=16.0)
V3 = GatingParams(top_k=8, num_experts=256, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
            norm_topk_prob=True, routed_scaling_factor=2.5)
GATINGS = {"v2lite": V2_LITE, "v2": V2, "v3": V3,
           "v2lite-norm": dataclasses.replace(V2_LITE, norm_topk_prob=True),  # k=6 normalisation order
           "v3-nobias": V3}
HIDDEN = {"v2lite": 2048, "v2": 5120, "v3": 7168}


def router_logits(t, e, kind, generator, device="cuda"):
    """'randn': distinct values; 'ties': integers in [-2, 2] (ties everywhere, also at the k-th value and
    between groups); 'equal': every logit equal; 'mixed': half the rows randn, half ties."""
    if kind == "randn":
        return torch.randn(t, e, generator=generator, device=device) * 2
    if kind == "ties":
        return torch.randint(-2, 3, (t, e), generator=generator, device=device).float()
    if kind == "equal":
        return torch.full((t, e), 0.25, device=device)
    x = torch.randn(t, e, generator=generator, device=device) * 2
    x[::2] = torch.randint(-2, 3, (x[::2].shape), generator=generator, device=device).float()
    return x
