"""Per-token-group FP8 activation quantisation (bf16 -> e4m3 + fp32 scales), in TileLang (Hopper).

Op: the activation side of ``fp8_linear`` / ``fp8_grouped_mlp`` (backends/cpu/quant.py, numerics in
model_executor/quantization/fp8.py ``quantize_per_token_group``): ``x`` [M, K] bf16 -> ``q`` [M, K]
float8_e4m3fn and ``scales`` [M, ceil(K / 128)] fp32, each row's 128-value group scaled by ``max(amax, 1e-10) / 448``.
``gated=True`` fuses the SwiGLU in front (``x`` [M, 2I] = [gate | up] -> the quantised ``silu(gate) * up`` [M, I])
with ``silu_mul``'s roundings (silu in fp32 rounded to bf16, the product in fp32 rounded to bf16), so the
grouped MLP's down projection reads its input once and no bf16 [M, I] intermediate is written.

Same arithmetic as the reference: fp32 amax, ``scale = amax / 448`` and ``q = x / scale`` with IEEE division (no
fast math), clamped to +-448, rounded to nearest even: bit-exact to ``quantize_per_token_group`` on bf16 input.

Kernel: grid (ceil(M / BM), ceil(K / 128)), 128 threads; a CTA quantises a [BM, 128] tile (BM = 8 up to
``SMALL_ROWS`` rows, 32 above: 8 or 32 values a thread, 16-byte vector loads); rows past M are masked by
TileLang's bounds checks. Memory-bound: 2 + 1 bytes a value (+ 4 / 128 for the scale).
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
GROUP = 128  # values per scale along K (DeepGEMM's 1 x 128 activation groups)
FP8_MAX = 448.0
AMAX_EPS = 1e-10  # model_executor/quantization/fp8.py AMAX_EPS: a zero group gets a finite scale
SMALL_ROWS = 512
THREADS = 128
MULT_K = 16  # K a multiple of 16 bytes of e4m3 (the GEMMs' TMA row stride); a partial last group is fine


def rows_block(m: int) -> int:
    return 8 if m <= SMALL_ROWS else 32


@cached_prim_func
def build_fp8_quant(k: int, bm: int, gated: bool = False, threads: int = THREADS):
    """PrimFunc quantising rows of ``k`` values (gated: input rows of 2k, [gate | up]); rows M are dynamic."""
    assert tilelang is not None, "tilelang is not installed"
    assert supported(k), f"K={k}: must be a multiple of {MULT_K}"
    K, KB, BM, G = k, -(-k // GROUP), bm, GROUP
    tail = k % GROUP != 0  # a partial last group: its columns past K (gated: the up half's) must not count
    KIN = 2 * k if gated else k
    bf16, f32, fp8 = T.bfloat16, T.float32, T.float8_e4m3fn
    M = T.dynamic("num_rows")

    @T.prim_func
    def fp8_quant(X: T.Tensor([M, KIN], bf16), Q: T.Tensor([M, K], fp8), S: T.Tensor([M, KB], f32)):
        with T.Kernel(T.ceildiv(M, BM), KB, threads=threads) as (bm_, g):
            T.pdl_sync()  # PDL: wait for the previous kernel, then let the next one launch
            T.pdl_trigger()
            x = T.alloc_fragment([BM, G], bf16)
            v = T.alloc_fragment([BM, G], f32)
            amax = T.alloc_fragment([BM], f32)
            q = T.alloc_fragment([BM, G], fp8)
            T.copy(X[bm_ * BM : (bm_ + 1) * BM, g * G : (g + 1) * G], x)
            if gated:
                u = T.alloc_fragment([BM, G], bf16)
                T.copy(X[bm_ * BM : (bm_ + 1) * BM, K + g * G : K + (g + 1) * G], u)
                for i, j in T.Parallel(BM, G):  # silu_mul's roundings: bf16 silu, bf16 product
                    gf = T.cast(x[i, j], f32)
                    s = T.cast(gf / (T.float32(1) + T.exp(-gf)), bf16)
                    y = T.cast(T.cast(T.cast(s, f32) * T.cast(u[i, j], f32), bf16), f32)
                    v[i, j] = T.if_then_else(g * G + j < K, y, T.float32(0)) if tail else y
            else:
                for i, j in T.Parallel(BM, G):
                    y = T.cast(x[i, j], f32)
                    v[i, j] = T.if_then_else(g * G + j < K, y, T.float32(0)) if tail else y
            T.reduce_absmax(v, amax, dim=1)
            for i in T.Parallel(BM):
                amax[i] = T.max(amax[i], T.float32(AMAX_EPS)) / T.float32(FP8_MAX)  # now the scale
            for i, j in T.Parallel(BM, G):
                q[i, j] = T.cast(T.clamp(v[i, j] / amax[i], T.float32(-FP8_MAX), T.float32(FP8_MAX)), fp8)
            T.copy(q, Q[bm_ * BM : (bm_ + 1) * BM, g * G : (g + 1) * G])
            for i in T.Parallel(BM):
                if bm_ * BM + i < M:
                    S[bm_ * BM + i, g] = amax[i]

    return fp8_quant


def _compile(func, target=None):
    return tilelang.compile(func, out_idx=None, target=dict(target or SM90_TARGET))


_CACHE = KernelCache({"quant": build_fp8_quant}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels  # the warm-up links and loads what it finds here (backends/cuda/warmup.py)


def supported(k: int) -> bool:
    return k > 0 and k % MULT_K == 0


def config_for(k: int, m: int, gated: bool = False) -> tuple:
    """The cache key :func:`quantize` launches for ``m`` rows of ``k`` output values."""
    return (int(k), rows_block(m), bool(gated))


def precompile(configs) -> None:
    _CACHE.precompile(("quant", tuple(c)) for c in configs)


def quantize(x: torch.Tensor, gated: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] bf16 (gated: [M, 2K] = [gate | up]) -> ``(q [M, K] float8_e4m3fn, scales [M, ceil(K / 128)]
    fp32)``; K a multiple of 16 (a partial last group takes its own amax, as the reference's).
    No host read of device values."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_quant: x must be 2-D bf16, got {x.dtype} {list(x.shape)}")
    m, kin = x.shape
    if gated and kin % 2:
        raise ValueError(f"fp8_quant: gated input width {kin} is odd ([gate | up] needs 2K)")
    k = kin // 2 if gated else kin
    if not supported(k):
        raise ValueError(f"fp8_quant: K={k} must be a positive multiple of {MULT_K}")
    if out is None:
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(m, -(-k // GROUP), dtype=torch.float32, device=x.device)
    else:
        q, s = out
    if m:
        _CACHE.get("quant", config_for(k, m, gated))(x.contiguous(), q, s)
    return q, s


CI_CONFIGS = [
    ("quant", (2048, 8, False)),  # V2-Lite hidden, decode rows
    ("quant", (1408, 32, True)),  # V2-Lite expert SwiGLU output, prefill rows
    ("quant", (10944, 8, True)),  # V2-Lite dense MLP: a partial last group
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations (sm_90a unless ``target``; no GPU, nothing cached); see
    tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)
