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

Checked on an H200: every output equal to the CPU reference op run on the same CUDA tensors
(tests/kernels_cuda/test_spec_verify_kernel.py).
"""

import torch

from . import _argmax as am
from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
ACCEPT_THREADS = 512
MAX_ROWS = 4096  # rows (requests) the accept kernel's shared bit words hold
MAX_Q = 32  # query tokens a row (one bit each)


# ---- kernels -------------------------------------------------------------------------------------------------
@cached_prim_func
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


CI_CONFIGS = [("argmax", (129280, False)), ("argmax", (129280, True)), ("accept", ())]  # greedy, noise, accept


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
