"""W_UK absorption of one decode token's query, in TileLang: ``q_latent[h] = q_nope[h] @ W_UK[h]``.

Op: the first half of ``mla_prolog``'s absorbed query (docs/interfaces.md §2; backends/cpu/mla.py
``einsum("thn,hnl->thl", q_nope, w_uk)``) for one token: ``q`` [1, H, QD] bf16 (the projected query, its nope
part first), ``w_uk`` [H, N, L] bf16 in the checkpoint's layout (N = qk_nope_head_dim, L = kv_lora_rank) ->
[1, H, L] bf16. fp32 products and sums, rounded once to bf16 (cuBLAS' batched GEMM, the path it replaces, also
accumulates in fp32; the summation order differs, so the result is not bit-identical to it). Tolerance against the
fp32 reference: one bf16 ulp of the reference plus the fp32 reordering bound N * 2^-23 * sum |q * w| (which covers
sums that nearly cancel), NaN / inf at the same positions.

Why: at batch 1 the backend ran this as cuBLAS' batched GEMM (``absorb_heads``: 3.2-3.3 us a layer for 2 MB on an
H200, the 27 ``nvjet ... NNT`` launches of profile_decode.py) and a library kernel ends the programmatic launch
chain of the TileLang kernels around it (PDL, _pdl.py). Its twin on the output side, W_UV on skinny_gemm's
grouped mode, measured +2.3 / +1.8 % at batch 1 (two A/B pairs). W_UK's rows are only N = 128 long, too
short for skinny_gemm's one-warp-a-row dot products, so this kernel walks W_UK along L instead: a CTA owns 64
columns of one head, each of its 256 threads 8 adjacent columns (one 16-byte vector a row) of N / 32 rows; it loads
its whole slice of W_UK before it waits for the previous kernel (the weights do not depend on it), then the query,
then sums the 32 row groups through shared memory. Grid: L / 64 x H CTAs (128 for V2-Lite's 16 heads).

Checked on an H200 against the fp32 reference (tests/kernels_cuda/test_mla_absorb.py): 0-2 bf16 ulp, NaN/inf
positions equal, graph replay; 1.40 us for 16 heads against cuBLAS' 2.73 us, 3.84 against 4.94 us for 128 (graph-timed, weights in
L2). In the engine at batch 1 it raised decode from 433.9 / 428.2 to 449.4 / 449.8 tok/s (A/B/A/B, 9 windows each).
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
THREADS = 256
VEC = 8  # bf16 columns a thread: one 16-byte vector of a W_UK row
COLS = 64  # columns of L a CTA
LANES = COLS // VEC  # threads sharing one W_UK row (8 x 16 bytes = one 128-byte segment)
GROUPS = THREADS // LANES  # row groups a CTA (32)


def supported(heads: int, nope: int, lrank: int, q_dim: int) -> str | None:
    """None when the kernel is built for these dims, else why not."""
    if heads < 1 or nope % GROUPS or nope < GROUPS:
        return f"qk_nope_head_dim {nope}: the kernel splits the rows into {GROUPS} groups"
    if lrank % COLS:
        return f"kv_lora_rank {lrank}: a multiple of {COLS} columns"
    if q_dim < nope:
        return f"query width {q_dim} < qk_nope_head_dim {nope}"
    return None


@cached_prim_func
def build_absorb(heads: int, nope: int, lrank: int, q_dim: int):
    """PrimFunc: (Q [1, H, QD], W [H, N, L], Out [1, H, L]) for compile-time dims."""
    assert tilelang is not None, "tilelang is not installed"
    assert supported(heads, nope, lrank, q_dim) is None, supported(heads, nope, lrank, q_dim)
    H, N, L, QD = heads, nope, lrank, q_dim
    RPT = N // GROUPS  # W_UK rows a thread
    f32, bf16 = T.float32, T.bfloat16

    @T.prim_func
    def mla_absorb(Q: T.Tensor([1, H, QD], bf16), W: T.Tensor([H, N, L], bf16), Out: T.Tensor([1, H, L], bf16)):
        with T.Kernel(L // COLS, H, threads=THREADS) as (bx, h):
            tid = T.get_thread_binding()
            lane = tid % LANES
            grp = tid // LANES
            col0 = bx * COLS + lane * VEC
            w = T.alloc_local([RPT * VEC], bf16)
            acc = T.alloc_local([VEC], f32)
            part = T.alloc_shared([GROUPS, COLS], f32)
            for i in T.unroll(RPT, explicit=True):  # every weight load first: none depends on earlier kernels
                for v in T.vectorized(VEC):
                    w[i * VEC + v] = W[h, grp * RPT + i, col0 + v]
            T.pdl_sync()  # PDL: wait for the kernel that wrote Q, then let the next one launch
            T.pdl_trigger()
            for v in T.unroll(VEC, explicit=True):
                acc[v] = T.float32(0)
            for i in T.unroll(RPT, explicit=True):
                qn = T.Cast(f32, Q[0, h, grp * RPT + i])
                for v in T.unroll(VEC, explicit=True):
                    acc[v] = acc[v] + qn * T.Cast(f32, w[i * VEC + v])
            for v in T.unroll(VEC, explicit=True):
                part[grp, lane * VEC + v] = acc[v]
            T.sync_threads()
            if tid < COLS:  # one thread a column sums the row groups in a fixed order
                s = T.alloc_local([1], f32)
                s[0] = T.float32(0)
                for g in T.serial(GROUPS):
                    s[0] = s[0] + part[g, tid]
                Out[0, h, bx * COLS + tid] = T.Cast(bf16, s[0])

    return mla_absorb


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


_CACHE = KernelCache({"absorb": build_absorb}, _compile, available=tilelang is not None)


def config_for(heads: int, nope: int, lrank: int, q_dim: int) -> tuple:
    """The cache key of the kernel :func:`absorb_q` launches."""
    return (int(heads), int(nope), int(lrank), int(q_dim))


def get_kernel(*cfg):
    return _CACHE.get("absorb", tuple(cfg))


def precompile(configs):
    """Compile ``config_for`` tuples in parallel threads (nvcc subprocesses)."""
    _CACHE.precompile(("absorb", tuple(c)) for c in configs)


CI_CONFIGS = [("absorb", (16, 128, 512, 192)), ("absorb", (128, 128, 512, 192))]  # V2-Lite, V3


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)


def reason(q: torch.Tensor, w_uk: torch.Tensor) -> str | None:
    """None when :func:`absorb_q` takes these operands (``q`` [1, H, QD], ``w_uk`` [H, N, L]), else why not."""
    if not (q.is_cuda and w_uk.is_cuda):
        return "tensor not on a CUDA device"
    if q.dtype != torch.bfloat16 or w_uk.dtype != torch.bfloat16:
        return f"q {q.dtype}, w_uk {w_uk.dtype}: the kernel is bf16-only"
    if q.dim() != 3 or q.shape[0] != 1 or w_uk.dim() != 3 or q.shape[1] != w_uk.shape[0]:
        return f"q {list(q.shape)}, w_uk {list(w_uk.shape)}: one token's [1, H, QD] against [H, N, L]"
    why = supported(w_uk.shape[0], w_uk.shape[1], w_uk.shape[2], q.shape[2])
    if why is not None:
        return why
    if not (q.is_contiguous() and w_uk.is_contiguous()) or w_uk.data_ptr() % 16:
        return f"contiguous q={q.is_contiguous()}, w_uk={w_uk.is_contiguous()}: 16-byte weight vectors needed"
    return None


def absorb_q(q: torch.Tensor, w_uk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` [1, H, QD] (nope part first) x ``w_uk`` [H, N, L] -> [1, H, L] bf16; one launch, no host sync."""
    why = reason(q, w_uk)
    if why is not None:
        raise ValueError(f"mla_absorb: {why}")
    h, n, lrank = w_uk.shape
    if out is None:
        out = torch.empty(1, h, lrank, dtype=q.dtype, device=q.device)
    get_kernel(*config_for(h, n, lrank, q.shape[2]))(q, w_uk, out)
    return out
