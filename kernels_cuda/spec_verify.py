"""Draft verification (``spec_verify``) for Hopper, in TileLang: the greedy path in two launches.

Op contract: backends/cpu/spec_verify.py ``spec_verify(logits [T, V], draft_next [T], row_of_token [T], j_of_token
[T], num_rows, max_q, t, ban_mask) -> VerifyOutput``. This file covers

- every row greedy (``t.all_greedy``), no logprobs, no ban mask, any ``max_q <= 32``: ``greedy_tok = argmax(p_j)``,
  draft ``j+1`` accepted iff it equals ``greedy_tok`` at ``j``, accepted = the leading run of accepted drafts per row,
  ``target_tokens`` the draft before that point and the arg-max from it on, ``emitted [B, max_q]`` the target tokens
  up to and including the first non-accepted position (-1 after), ``num_emitted = accepted + 1``;
- rows sampled with a temperature (mixed with greedy rows) when ``max_q == 1``, no top-k / top-p, no logprobs, no ban
  mask: every token is then its row's last (``draft_next`` is -1 there by the op's contract), so the reference emits
  ``argmax(logits / temperature + Gumbel(u))`` with ``u`` from the hash RNG (stream ``STREAM_SAMPLE``) for sampled
  rows and ``argmax(logits)`` for greedy rows. This is the worker's prefill sampling and its decode step without
  drafts.

Everything else (sampled rows with drafts: the rejection rule needs ``softmax(scaled)[draft]``; top-k / top-p;
logprobs; bans) stays on the reference; ``backends/cuda/kernels.py`` routes and reports it.

Kernels (exactly the reference's integer outputs, int64, no host reads, CUDA-graph capturable):
1. ``row_argmax`` (kernels_cuda/_argmax.py): grid (S splits, T rows), 256 threads, 16-byte loads, two in flight a
   thread; split ``s`` of row ``t`` writes the 64-bit key ``sortable(value) << 32 | (0xFFFFFFFF - index)`` of its
   best element to ``Part [T, S]``: torch's arg-max order (NaN largest, ties and +-0 to the lowest index). S from
   the host shapes: ~4 CTAs a SM, at least one 2048-value tile a split (T = 1 at V = 129280: 64 splits); with
   sampled rows one 16-byte load a thread and tile (1024 values: compute-bound on the hash, two logf, a division).
2. ``accept``: one CTA of 512 threads. Per token: the max of its S keys -> arg-max; ``ok`` -> bit ``j`` of its
   row's shared-memory word (atomicAdd of ``1 << j``, (row, j) pairs are distinct); per row: accepted = the
   number of trailing one bits, ``popc(x & ~(x + 1))`` (as ``cumprod(ok_pad).sum()``); per token: target token and
   the emitted entry. ``emitted`` is pre-filled with -1 (rows without any token keep accepted 0, all -1).
The reference launches ~15 kernels (argmax, ==, clamp, zeros, index_put, cumprod, sum, index_select, where x2,
full, index_put, + 1, ...); for sampled rows it also materialises [T, V] int64 hash words (~25 elementwise
kernels over the vocabulary).

Verified: the ``--check`` below (exact equality of every output with the CPU reference op run on the same CUDA
tensors) passed on an H200 (session 3; kernels_cuda/NOTES.md), and the kernel set uses it by default. CI compiles
it for sm_90a and sm_100a.

Run alone:  python kernels_cuda/spec_verify.py --check --bench
"""

import argparse
import os
import sys
import time

import torch

try:
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover
    tilelang = None
    T = None

try:
    from . import _argmax as am
    from . import _bench
    from ._kernel_cache import KernelCache
except ImportError:  # run as a script: python kernels_cuda/spec_verify.py
    import _argmax as am
    import _bench
    from _kernel_cache import KernelCache

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
ACCEPT_THREADS = 512
MAX_ROWS = 4096  # rows (requests) the accept kernel's shared bit words hold
MAX_Q = 32  # query tokens a row (one bit each)


# ---- kernels -------------------------------------------------------------------------------------------------
def build_accept(threads: int = ACCEPT_THREADS, max_rows: int = MAX_ROWS):
    """PrimFunc (Part [T, S] i64, Draft [T] i64, Row [T] i64, J [T] i64, Emitted [B, Q] i64 out, NumEmitted [B] i64
    out, Accepted [B] i64 out, Target [T] i64 out); T, S, B, Q dynamic (B <= max_rows, Q <= 32)."""
    assert tilelang is not None, "tilelang is not installed"
    i32, i64, u32 = T.int32, T.int64, T.uint32
    N = T.dynamic("num_tokens")
    S = T.dynamic("num_splits")
    B = T.dynamic("num_rows")
    Q = T.dynamic("max_q")

    @T.prim_func
    def accept(
        Part: T.Tensor([N, S], i64),
        Draft: T.Tensor([N], i64),
        Row: T.Tensor([N], i64),
        J: T.Tensor([N], i64),
        Emitted: T.Tensor([B, Q], i64),
        NumEmitted: T.Tensor([B], i64),
        Accepted: T.Tensor([B], i64),
        Target: T.Tensor([N], i64),
    ):
        with T.Kernel(1, threads=threads) as _bx:
            tid = T.get_thread_binding()
            bits = T.alloc_shared([max_rows], u32)
            key = T.alloc_var(i64)
            g = T.alloc_var(i64)
            x = T.alloc_var(u32)
            a = T.alloc_var(i32)
            row = T.alloc_var(i32)
            jj = T.alloc_var(i32)
            for it in T.serial(T.ceildiv(B, threads)):
                if it * threads + tid < B:
                    bits[it * threads + tid] = T.uint32(0)
            for it in T.serial(T.ceildiv(B * Q, threads)):
                if it * threads + tid < B * Q:
                    Emitted[(it * threads + tid) // Q, (it * threads + tid) % Q] = T.int64(-1)
            T.sync_threads()
            for it in T.serial(T.ceildiv(N, threads)):  # arg-max per token, accepted drafts as bits of the row
                if it * threads + tid < N:
                    key = Part[it * threads + tid, 0]
                    for s in T.serial(1, S):
                        key = T.max(key, Part[it * threads + tid, s])
                    g = T.int64(0xFFFFFFFF) - (key & T.int64(0xFFFFFFFF))
                    Target[it * threads + tid] = g
                    row = T.Cast(i32, Row[it * threads + tid])
                    jj = T.Cast(i32, J[it * threads + tid])
                    if (Draft[it * threads + tid] == g) & (row >= 0) & (row < B) & (jj >= 0) & (jj < Q):
                        T.atomic_add(bits[row], T.shift_left(T.uint32(1), T.Cast(u32, jj)))
            T.sync_threads()
            for it in T.serial(T.ceildiv(B, threads)):  # accepted = leading run of accepted positions
                if it * threads + tid < B:
                    x = bits[it * threads + tid]
                    a = T.Cast(i32, T.popcount(x & ~(x + T.uint32(1))))
                    Accepted[it * threads + tid] = T.Cast(i64, a)
                    NumEmitted[it * threads + tid] = T.Cast(i64, a + 1)
                    bits[it * threads + tid] = T.Cast(u32, a)
            T.sync_threads()
            for it in T.serial(T.ceildiv(N, threads)):  # target tokens; emitted up to the first rejection
                if it * threads + tid < N:
                    row = T.Cast(i32, Row[it * threads + tid])
                    jj = T.Cast(i32, J[it * threads + tid])
                    if (row >= 0) & (row < B) & (jj >= 0) & (jj < Q):
                        a = T.Cast(i32, bits[row])
                        if jj < a:
                            Target[it * threads + tid] = Draft[it * threads + tid]
                        if jj <= a:
                            Emitted[row, jj] = Target[it * threads + tid]

    return accept


def _compile(func, target=None):
    return am.compile_func(func, target or SM90_TARGET)


_CACHE = KernelCache({"argmax": am.build_row_argmax, "accept": build_accept}, _compile,
                     available=tilelang is not None)
_KERNELS = _CACHE.kernels  # (kind, cfg) -> compiled kernel


def get_kernel(kind: str, *cfg):
    return _CACHE.get(kind, cfg)


def precompile(items):
    """Compile (kind, cfg) pairs in parallel threads (nvcc runs in subprocesses)."""
    _CACHE.precompile(items)


CI_CONFIGS = [("argmax", (129280, False)), ("accept", ())]  # the noise arg-max: sampling.py's CI_CONFIGS


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)


# ---- host side -----------------------------------------------------------------------------------------------
def reason(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t, ban_mask=None) -> str | None:
    """None when :func:`spec_verify` reproduces the reference for these arguments (host facts only), else why
    not."""
    if ban_mask is not None:
        return "ban mask (min_tokens) present"
    if t.max_num_logprobs is not None:
        return "logprobs requested"
    if not t.all_greedy:
        if max_q != 1:
            return "sampled rows with drafts (rejection sampling needs softmax(scaled)[draft])"
        if t.need_top_k or t.need_top_p:
            return "top-k / top-p"
    if logits.dim() != 2 or logits.dtype != torch.float32:
        return f"logits {logits.dtype} {tuple(logits.shape)}: kernel reads [T, V] fp32"
    n, v = logits.shape
    if n == 0 or num_rows == 0:
        return "empty step"
    if not 0 < v < 2**31 - 1:
        return f"vocabulary {v}"
    if num_rows > MAX_ROWS:
        return f"{num_rows} rows > {MAX_ROWS}"
    if not 1 <= max_q <= MAX_Q:
        return f"max_q {max_q}: kernel handles 1..{MAX_Q}"
    if n >= 65536:
        return f"{n} tokens: grid y is limited to 65535"
    if any(x.shape != (n,) for x in (draft_next, row_of_token, j_of_token)):
        return "token tensors are not [T]"
    return None


def _i64(x):
    return x.to(torch.int64).contiguous()


def spec_verify(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t=None, num_sms=None):
    """(emitted [B, max_q], num_emitted [B], accepted [B], target_tokens [T]), int64, like the reference's
    ``VerifyOutput`` fields (see :func:`reason` for what is covered). ``t`` None = every row greedy."""
    logits = logits.contiguous()
    n, v = logits.shape
    dev = logits.device
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    noise = t is not None and not t.all_greedy
    s = am.num_splits(n, v, num_sms, noise)
    part = torch.empty(n, s, dtype=torch.int64, device=dev)
    if not noise:
        get_kernel("argmax", v, False)(logits, part)
    else:
        get_kernel("argmax", v, True)(
            logits, t.temperature.float().contiguous(), t.is_greedy.contiguous().view(torch.uint8),
            _i64(t.seeds), _i64(t.offsets), part,
        )
    emitted = torch.empty(num_rows, max_q, dtype=torch.int64, device=dev)
    num_emitted = torch.empty(num_rows, dtype=torch.int64, device=dev)
    accepted = torch.empty(num_rows, dtype=torch.int64, device=dev)
    target = torch.empty(n, dtype=torch.int64, device=dev)
    get_kernel("accept")(part, _i64(draft_next), _i64(row_of_token), _i64(j_of_token), emitted, num_emitted, accepted,
                         target)
    return emitted, num_emitted, accepted, target


# ---- reference and checks ------------------------------------------------------------------------------------
def _ensure_repo_on_path():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


def spec_verify_ref(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t):
    """The CPU reference op (backends/cpu/spec_verify.py) on the same tensors."""
    _ensure_repo_on_path()
    from deepinfer_npu.backends.cpu.spec_verify import spec_verify as ref

    vo = ref(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t, None)
    return vo.emitted, vo.num_emitted, vo.accepted, vo.target_tokens


def make_sampling(n, greedy_frac=1.0, seed=0, device="cuda"):
    """SamplingTensors for n rows: a fraction greedy, the others with temperatures in [0.2, 2] (no top-k/p)."""
    _ensure_repo_on_path()
    from deepinfer_npu.sampling.metadata import SamplingTensors

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


def make_logits(n, v, kind, generator, device="cuda"):
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


def make_step(rows, max_q, v, kind="randn", accept_p=0.7, layout="worker", seed=0, device="cuda"):
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
    logits = make_logits(n, v, kind, g, device)
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


def check_case(rows, max_q, v, kind="randn", layout="worker", greedy_frac=1.0, seed=0, verbose=True):
    step = make_step(rows, max_q, v, kind, layout=layout, seed=seed)
    n = step["logits"].shape[0]
    t = make_sampling(n, greedy_frac, seed=seed)
    why = reason(**step, t=t)
    assert why is None, why
    out = spec_verify(**step, t=t)
    ref = spec_verify_ref(**step, t=t)
    torch.cuda.synchronize()
    names = ("emitted", "num_emitted", "accepted", "target_tokens")
    same = {nm: bool(torch.equal(a, b) and a.dtype == b.dtype) for nm, a, b in zip(names, out, ref)}
    ok = all(same.values())
    if verbose:
        acc = ref[2].float().mean().item()
        print(f"check spec_verify B={rows:4d} q<={max_q:2d} V={v:6d} T={n:5d} {kind:7s} {layout:8s} "
              f"greedy={greedy_frac:.1f}: {'OK' if ok else 'FAIL'} {same} (mean accepted {acc:.2f})", flush=True)
        if not ok:
            bad = (out[3] != ref[3]).nonzero().flatten()[:4].tolist()
            print(f"   target mismatches at {bad}: kernel {out[3][bad].tolist()} ref {ref[3][bad].tolist()}")
    return ok, same


# (rows, max_q, V, logits kind, layout, greedy fraction)
CHECK_CASES = [
    (1, 1, 129280, "randn", "prefill", 1.0),
    (1, 4, 129280, "randn", "worker", 1.0),
    (7, 2, 4096, "randn", "worker", 1.0),
    (64, 4, 102400, "randn", "worker", 1.0),
    (64, 4, 129280, "ties", "worker", 1.0),
    (64, 2, 129280, "special", "worker", 1.0),
    (256, 4, 129280, "randn", "worker", 1.0),
    (256, 1, 129280, "special", "prefill", 1.0),
    (1024, 1, 129280, "randn", "prefill", 1.0),  # T = 1024 logits rows: one split a row
    (256, 4, 102400, "randn", "worker", 1.0),  # T ~ 640
    (32, 16, 4096, "ties", "worker", 1.0),  # q up to 16 (bits 0..15)
    (16, 32, 4096, "randn", "worker", 1.0),  # q up to 32 (bit 31)
    (33, 3, 4096, "equal", "worker", 1.0),  # every logit equal: arg-max 0 everywhere
    (40, 4, 4096, "randn", "shuffled", 1.0),  # tokens in any order, rows without tokens
    (5, 3, 1001, "randn", "worker", 1.0),  # V % 4 != 0: scalar loads
    (3, 2, 7, "ties", "worker", 1.0),  # V smaller than a thread's vector
    # sampled rows (max_q == 1): Gumbel-max with the hash RNG, mixed with greedy rows
    (64, 1, 129280, "randn", "prefill", 0.0),
    (64, 1, 102400, "randn", "prefill", 0.5),
    (1024, 1, 129280, "randn", "prefill", 0.3),
    (16, 1, 4096, "special", "prefill", 0.5),
    (16, 1, 4096, "ties", "prefill", 0.0),
    (9, 1, 1001, "randn", "prefill", 0.0),
]


def check_graph(verbose=True):
    """Both kernels captured in a CUDA graph (no host reads) and replayed on new logits."""
    step = make_step(48, 4, 102400, seed=5)
    n = step["logits"].shape[0]
    t = make_sampling(n)
    spec_verify(**step, t=t)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = spec_verify(**step, t=t)
    fresh = make_step(48, 4, 102400, seed=6)
    step["logits"].copy_(fresh["logits"])
    gr.replay()
    ref = spec_verify_ref(**step, t=t)
    torch.cuda.synchronize()
    ok = all(torch.equal(a, b) for a, b in zip(out, ref))
    if verbose:
        print(f"check graph capture + replay: {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def check_noise(v=129280, n=8, seed=3, verbose=True):
    """Diagnostic for the sampled path: the kernels' uniforms and compared values (``_argmax.build_noise_values``)
    against rng.hash_uniform and torch's ``logits / T - log(-log(u))`` bit for bit, and the Gumbel-max tokens."""
    _ensure_repo_on_path()
    from deepinfer_npu.sampling.rng import STREAM_SAMPLE, hash_uniform

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, v, generator=g, device="cuda") * 3
    t = make_sampling(n, 0.0, seed=seed)
    u = hash_uniform(t.seeds, t.offsets, v, stream=STREAM_SAMPLE)
    x_ref = logits / t.temperature[:, None] - torch.log(-torch.log(u))
    x, uk = torch.empty_like(logits), torch.empty_like(logits)
    am.compile_func(am.build_noise_values(v))(logits, t.temperature, t.seeds, t.offsets, x, uk)
    tok = spec_verify(logits, torch.full((n,), -1, device="cuda"), torch.arange(n, device="cuda"),
                      torch.zeros(n, dtype=torch.int64, device="cuda"), n, 1, t)[3]
    torch.cuda.synchronize()
    u_same = torch.equal(uk, u)
    x_diff = int((x.view(torch.int32) != x_ref.view(torch.int32)).sum())
    tok_same = torch.equal(tok, x_ref.argmax(-1))
    ok = u_same and x_diff == 0 and tok_same
    if verbose:
        print(f"check hash-RNG noise (V={v}, {n} rows): {'OK' if ok else 'FAIL'} uniforms bit-exact={u_same}, "
              f"values differing from torch's: {x_diff} of {x.numel()}, tokens equal={tok_same}", flush=True)
    return ok


def check_configs():
    vs = sorted({c[2] for c in CHECK_CASES} | {102400})
    items = [("argmax", (v, False)) for v in vs] + [("accept", ())]
    items += [("argmax", (v, True)) for v in sorted({c[2] for c in CHECK_CASES if c[5] < 1.0} | {129280})]
    return items


def run_checks(verbose=True):
    t0 = time.time()
    precompile(check_configs())
    print(f"compiled {len(_KERNELS)} configurations in {time.time() - t0:.1f}s", flush=True)
    ok = True
    for i, c in enumerate(CHECK_CASES):
        ok &= check_case(*c, seed=10 + i, verbose=verbose)[0]
    ok &= check_noise(verbose=verbose)
    ok &= check_graph(verbose)
    return ok


# ---- benchmark -------------------------------------------------------------------------------------------------


def bench_case(rows, q, v, greedy_frac=1.0, copy_gbps=None):
    step = make_step(rows, q, v, layout="full", seed=1)
    n = step["logits"].shape[0]
    t = make_sampling(n, greedy_frac, seed=1)
    tk, how = _bench.time_us(lambda: spec_verify(**step, t=t))
    tr, how_r = _bench.time_us(lambda: spec_verify_ref(**step, t=t))
    ta, _ = _bench.time_us(lambda: step["logits"].argmax(-1))
    nbytes = n * v * 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row = {"bench": "spec_verify", "hardware": torch.cuda.get_device_name(), "rows": rows, "q": q, "T": n, "V": v,
           "greedy_frac": greedy_frac, "splits": am.num_splits(n, v, sms, greedy_frac < 1.0), "kernel_us": round(tk, 2),
           "reference_us": round(tr, 2), "torch_argmax_us": round(ta, 2), "speedup": round(tr / tk, 2),
           "GBps": round(nbytes / (tk * 1e-6) / 1e9, 1), "timing": how, "timing_ref": how_r}
    if copy_gbps:
        row.update(copy_GBps=round(copy_gbps, 1), frac_of_copy=round(row["GBps"] / copy_gbps, 3))
    return row


BENCH_SHAPES = [(b, q, v, 1.0) for v in (102400, 129280) for b, q in ((1, 1), (1, 4), (16, 4), (64, 1), (64, 2),
                                                                      (64, 4), (256, 4))]
BENCH_SHAPES += [(b, 1, 129280, gf) for b in (1, 64, 256) for gf in (0.0,)]


def main(argv=None):
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    _bench.exit_without_cuda(args)
    if args.compile_only:
        t = time.time()
        ci_compile()
        print(f"compiled {len(CI_CONFIGS)} configurations in {time.time() - t:.1f}s")
    ok = True
    if args.check:
        ok = run_checks()
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.bench:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from mla_decode import copy_bandwidth  # noqa: E402 (same folder)

        precompile([("argmax", (v, gf < 1.0)) for _b, _q, v, gf in BENCH_SHAPES] + [("accept", ())])
        cb = copy_bandwidth()
        for c in BENCH_SHAPES:
            print(json.dumps(bench_case(*c, copy_gbps=cb)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
