"""``spec_verify``'s first kernel: a split row arg-max over fp32 logits [N, V], optionally of
``logits / temperature + Gumbel(u)`` with ``u`` from the counter-based hash RNG (deepinfer_npu/sampling/rng.py),
bit for bit. Not a kernel file of its own (no ``ci_compile``; ``spec_verify`` compiles it).

Kernel ``row_argmax``: grid (S splits, N rows), THREADS threads; split ``s`` of row ``n`` scans the tiles
``[s * ceil(NT / S), (s + 1) * ceil(NT / S))`` of TILE = THREADS * VEC * UNROLL logits (NT tiles a row; 16-byte
loads when V % 4 == 0; UNROLL = 2 without noise, 1 with), each thread keeping its best (value, index) in index
order, then a warp / CTA max over a 64-bit key; it writes one key per (row, split) to ``Part [N, S]`` int64. A
second kernel (``spec_verify``'s accept kernel) reduces the S keys of a row: ``index = 0xFFFFFFFF - (max key & 0xFFFFFFFF)``.

Order (torch's CUDA ``argmax``, ``GreaterOrNan``): NaN is larger than everything, ties (NaN with NaN, equal values,
-0.0 with +0.0) go to the lowest index. The key is ``sortable(value) << 32 | (0xFFFFFFFF - index)`` with
``sortable`` the int32 whose signed order is the float order (zeros made +0.0, every NaN the largest value), so a
plain int64 max is that order. A split without an element writes INT64_MIN (below every real key).

Noise rows (``noise=True`` and ``Greedy[n] == 0``): the value of column ``c`` is
``fl(fl(logit / temperature) + -logf(-logf(u)))``, ``u = (2 * (bits >> 9) + 1) * 2**-24``,
``bits = mix(key ^ mix(c + 0x632BE5AB))``, ``key`` the row key of ``(seed, offset, stream)`` (four ``mix``), i.e.
the reference's ``scaled + gumbel_noise(...)`` with the same IEEE division and the same CUDA ``logf`` torch uses
(no fast math; no product is fused into an add: ``--fmad=false``). Greedy rows take the raw logits.
"""

from ._tilelang import T, tilelang
from ._prim_func_cache import cached_prim_func

THREADS = 256
UNROLL = 2  # 16-byte loads in flight per thread and tile
COMPILE_FLAGS = ["--fmad=false"]

# deepinfer_npu/sampling/rng.py constants
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
_STREAM_ADD = 0x7F4A7C15
_COL_ADD = 0x632BE5AB
INT64_MIN = -(2**63)


def vec_for(vocab: int) -> int:
    return 4 if vocab % 4 == 0 else 1


def tiles_per_row(vocab: int, noise: bool = False, threads: int = THREADS) -> int:
    tile = threads * vec_for(vocab) * unroll_for(noise)
    return -(-vocab // tile)


def num_splits(rows: int, vocab: int, num_sms: int = 132, noise: bool = False, ctas_per_sm: int = 4) -> int:
    """Splits a row so that rows * splits ~ ctas_per_sm * SMs CTAs (each keeps 4-8 KB of loads in flight), at least
    one tile a split. Host ints only."""
    nt = tiles_per_row(vocab, noise)
    want = -(-(ctas_per_sm * num_sms) // max(rows, 1))
    return max(1, min(nt, want))


def stream_salt(stream: int) -> int:
    return (int(stream) * _GOLDEN + _STREAM_ADD) & 0xFFFFFFFF


if T is not None:

    @T.macro
    def _mix(h, i):
        """``lowbias32`` in place on the uint32 element ``h[i]`` (wrapping uint32 arithmetic)."""
        h[i] = h[i] ^ (h[i] >> T.uint32(16))
        h[i] = h[i] * T.uint32(_C1)
        h[i] = h[i] ^ (h[i] >> T.uint32(15))
        h[i] = h[i] * T.uint32(_C2)
        h[i] = h[i] ^ (h[i] >> T.uint32(16))

    @T.macro
    def _row_key(h, seed, offset, salt):
        """h[0] = the hash RNG's per-row key of (seed, offset) (int64 two's complement) and the stream salt."""
        h[0] = T.Cast(T.uint32, seed) ^ T.uint32(salt)
        _mix(h, 0)
        h[0] = h[0] ^ T.Cast(T.uint32, seed >> T.int64(32))
        _mix(h, 0)
        h[0] = h[0] ^ T.Cast(T.uint32, offset)
        _mix(h, 0)
        h[0] = h[0] ^ T.Cast(T.uint32, offset >> T.int64(32))
        _mix(h, 0)

    @T.macro
    def _gumbel(h, col, g):
        """g[0] = -logf(-logf(u)) for column ``col`` of the row whose key is h[0] (h[1] is scratch)."""
        h[1] = T.Cast(T.uint32, col) + T.uint32(_COL_ADD)
        _mix(h, 1)
        h[1] = h[1] ^ h[0]
        _mix(h, 1)
        g[0] = -T.log(-T.log(T.Cast(T.float32, (h[1] >> T.uint32(9)) * T.uint32(2) + T.uint32(1))
                             * T.float32(2.0**-24)))


def _sortable(v):
    """float32 -> int32 whose signed order is the float order; -0.0 -> +0.0; every NaN -> INT32_MAX."""
    b = T.if_then_else(v == T.float32(0), T.int32(0), T.reinterpret(v, "int32"))
    s = b ^ ((b >> T.int32(31)) & T.int32(0x7FFFFFFF))
    return T.if_then_else(T.isnan(v), T.int32(0x7FFFFFFF), s)


def unroll_for(noise: bool) -> int:
    """Loads in flight a thread: 2 for the memory-bound greedy scan; 1 with noise (compute-bound: a hash, two logf
    and a division per value; also halves nvcc's time on the unrolled body)."""
    return 1 if noise else UNROLL


@cached_prim_func
def build_row_argmax(vocab: int, noise: bool, stream: int = 0, threads: int = THREADS, unroll: int | None = None):
    """PrimFunc. ``noise=False``: (L [N, V] f32, Part [N, S] i64 out). ``noise=True``: (L, Temp [N] f32,
    Greedy [N] u8, Seeds [N] i64, Offsets [N] i64, Part). N and S are dynamic, V compile-time."""
    assert tilelang is not None, "tilelang is not installed"
    unroll = unroll_for(noise) if unroll is None else unroll
    V = int(vocab)
    assert 0 < V < 2**31 - 1 and threads % 32 == 0
    VEC = vec_for(V)
    TILE = threads * VEC * unroll
    NT = -(-V // TILE)
    NW = threads // 32
    STEP = threads * VEC  # between the unrolled loads of one thread
    f32, i32, i64, u32, u8 = T.float32, T.int32, T.int64, T.uint32, T.uint8
    salt = stream_salt(stream)
    N = T.dynamic("num_rows")
    S = T.dynamic("num_splits")

    @T.macro
    def body(L, Temp, Greedy, Seeds, Offsets, Part, bs, bn):
        tid = T.get_thread_binding()
        x = T.alloc_local([unroll * VEC], f32)
        h = T.alloc_local([2], u32)
        g = T.alloc_local([1], f32)
        best = T.alloc_var(f32)
        bi = T.alloc_var(i32)
        key = T.alloc_var(i64)
        greedy = T.alloc_var(i32)
        temp = T.alloc_var(f32)
        s_red = T.alloc_shared([NW], i64)
        tiles = T.ceildiv(NT, S)  # expressions, not vars: TileLang then proves the 16-byte loads in bounds
        t0 = bs * tiles
        best = -T.infinity(f32)
        bi = -1
        if noise:
            greedy = T.Cast(i32, Greedy[bn])
            temp = Temp[bn]
            _row_key(h, Seeds[bn], Offsets[bn], salt)
        for it in T.serial(tiles):
            base = (t0 + it) * TILE + tid * VEC
            for u in T.unroll(unroll, explicit=True):
                if base + u * STEP < V:
                    for v in T.vectorized(VEC):
                        x[u * VEC + v] = L[bn, base + u * STEP + v]
            for u in T.unroll(unroll, explicit=True):
                for v in T.unroll(VEC, explicit=True):
                    if base + u * STEP + v < V:
                        if noise:
                            if greedy == 0:
                                _gumbel(h, base + u * STEP + v, g)
                                x[u * VEC + v] = x[u * VEC + v] / temp + g[0]
                        # T.isnan, not x == x: TVM folds x == x to true
                        if (x[u * VEC + v] > best) | (T.isnan(x[u * VEC + v]) & ~T.isnan(best)):
                            best = x[u * VEC + v]
                            bi = base + u * STEP + v
        if bi < 0:  # no element taken: all of this thread's values are -inf (its first index wins), or none
            if (t0 < NT) & (t0 * TILE + tid * VEC < V):
                bi = t0 * TILE + tid * VEC
        if bi < 0:
            key = T.int64(INT64_MIN)
        else:
            key = T.Cast(i64, _sortable(best)) * T.int64(2**32) + (T.int64(0xFFFFFFFF) - T.Cast(i64, bi))
        for o in T.unroll(5, explicit=True):
            key = T.max(key, T.shfl_xor(key, 16 >> o))
        if tid % 32 == 0:
            s_red[tid // 32] = key
        T.sync_threads()
        if tid == 0:
            key = s_red[0]
            for w in T.unroll(1, NW, explicit=True):
                key = T.max(key, s_red[w])
            Part[bn, bs] = key

    if noise:

        @T.prim_func
        def row_argmax_noise(
            L: T.Tensor([N, V], f32),
            Temp: T.Tensor([N], f32),
            Greedy: T.Tensor([N], u8),
            Seeds: T.Tensor([N], i64),
            Offsets: T.Tensor([N], i64),
            Part: T.Tensor([N, S], i64),
        ):
            with T.Kernel(S, N, threads=threads) as (bs, bn):
                body(L, Temp, Greedy, Seeds, Offsets, Part, bs, bn)

        return row_argmax_noise

    @T.prim_func
    def row_argmax(
        L: T.Tensor([N, V], f32),
        Part: T.Tensor([N, S], i64),
    ):
        with T.Kernel(S, N, threads=threads) as (bs, bn):
            body(L, None, None, None, None, Part, bs, bn)

    return row_argmax


def compile_func(func, target=None):
    from_target = target or {"kind": "cuda", "arch": "sm_90a"}
    return tilelang.compile(func, out_idx=None, target=dict(from_target), compile_flags=list(COMPILE_FLAGS))
