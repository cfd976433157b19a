"""Sampling pieces with no torch_npu fused equivalent: the seeded hash-RNG noise and the argmaxes of the reference
sampler (backends/cpu/sampling.py, backends/cpu/spec_verify.py).

* ``hash_uniform`` writes the uniforms ``u[b, v] = U(seeds[b], offsets[b], v, stream)`` of
  deepinfer_npu/sampling/rng.py bit for bit: the counter-based ``lowbias32`` hash in 32-bit unsigned lanes
  (wrap-around ``uint32`` multiplies, which equal the reference's 16-bit-limb products mod 2**32), then
  ``u = (2 * (bits >> 9) + 1) * 2**-24`` (exact in fp32). With ``V = 1`` and stream ``STREAM_ACCEPT`` it is the
  rejection sampler's per-draft acceptance uniform.
* ``gumbel_argmax`` (one program per stream) fuses that hash with the temperature and the Gumbel-max race the
  reference samples with: ``argmax_v(logits[b, v] / temperature[b] + g)``, ``g = -log(-log(u))`` (the reference's
  ``scaled + gumbel_noise``; spec_verify's ``scaled - log(-log(u))`` is the same fp32 value). Tokens the caller
  banned or filtered out (top-k / top-p: the reference's mask, computed by aten ops) arrive as ``-inf`` logits,
  and ``-inf / T = -inf`` exactly as the reference's ``masked_fill`` after the division.
* ``greedy_argmax`` is ``torch.argmax(logits, -1)``: the first maximum (lowest id on ties), NaN above everything
  (the first NaN), as torch's.

The argmaxes split the vocabulary over ``splits`` blocks per row (one 1-D grid of ``B * splits`` blocks, scalar
code on the vector cores) writing a partial (value, index) per split, ``-1`` for an empty split; ``argmax_combine``
(one block per row) keeps the first best split, which is the first best index overall. Only the fp32 ``log`` of
the device may differ from torch's in the last ulp (the uniforms, the division and the comparisons are exact), so
seeded tokens equal the CPU backend's unless two noisy logits tie within an ulp.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations at definition.
import torch

from ._tl import T, compile_c, exact_f32, lower_ascend

SPLITS = 16  # vocabulary splits per row of the argmax kernels

_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers (rng.py)
_GOLDEN, _STREAM_ADD, _COL_ADD = 0x9E3779B9, 0x7F4A7C15, 0x632BE5AB
_M32 = 0xFFFFFFFF


# lowbias32 in three statements per call site (x ^= x >> 16; x *= C1; x ^= x >> 15; x *= C2; x ^= x >> 16): the
# caller assigns each step to a scalar variable, so the generated expressions stay flat. The four row-key words and
# the two column mixes are loops rather than straight-line code: lowering long straight-line scalar code makes the
# tilelang-ascend auto-scheduler search for seconds (and give up).
def _mix1(x):
    return (x ^ (x >> T.uint32(16))) * T.uint32(_C1)


def _mix2(x):
    return (x ^ (x >> T.uint32(15))) * T.uint32(_C2)


def _mix3(x):
    return x ^ (x >> T.uint32(16))


def _lo(x):  # low 32 bits of an int64
    return T.cast(x & T.int64(_M32), "uint32")


def _hi(x):  # high 32 bits of an int64 (arithmetic shift, then the mask: as rng._row_keys)
    return T.cast((x >> T.int64(32)) & T.int64(_M32), "uint32")


def _word(seed, offset, w):  # the w-th 32-bit word hashed into the row key: seed lo, seed hi, offset lo, offset hi
    return T.if_then_else(w == 0, _lo(seed), T.if_then_else(w == 1, _hi(seed), T.if_then_else(
        w == 2, _lo(offset), _hi(offset))))


def _stream_const(stream: int) -> int:
    return (int(stream) * _GOLDEN + _STREAM_ADD) & _M32


def build_hash_uniform(stream: int):
    B = T.dynamic("B")
    V = T.dynamic("V")
    s = _stream_const(stream)

    @T.prim_func
    def hash_uniform(
        seeds: T.Tensor([B], "int64"),
        offsets: T.Tensor([B], "int64"),
        u: T.Tensor([B, V], "float32"),
    ):
        with T.Kernel(B) as bx:
            h = T.alloc_var("uint32")
            c = T.alloc_var("uint32")
            h = T.uint32(s)
            for w in T.serial(4):  # row key: mix(mix(mix(mix(s ^ seed_lo) ^ seed_hi) ^ offset_lo) ^ offset_hi)
                h = h ^ _word(seeds[bx], offsets[bx], w)
                h = _mix1(h)
                h = _mix2(h)
                h = _mix3(h)
            for v in T.serial(V):
                c = T.cast(v, "uint32") + T.uint32(_COL_ADD)
                for m in T.serial(2):  # mix(mix(v + COL_ADD) ^ key)
                    c = _mix1(c)
                    c = _mix2(c)
                    c = _mix3(c) ^ T.if_then_else(m == 0, h, T.uint32(0))
                u[bx, v] = T.cast((c >> T.uint32(9)) * T.uint32(2) + T.uint32(1), "float32") * exact_f32(2.0**-24)

    return hash_uniform


def build_gumbel_argmax(stream: int, splits: int = SPLITS):
    B = T.dynamic("B")
    V = T.dynamic("V")
    s = _stream_const(stream)

    @T.prim_func
    def gumbel_argmax(
        logits: T.Tensor([B, V], "float32"),
        temperature: T.Tensor([B], "float32"),
        seeds: T.Tensor([B], "int64"),
        offsets: T.Tensor([B], "int64"),
        part_val: T.Tensor([B, splits], "float32"),
        part_idx: T.Tensor([B, splits], "int32"),
    ):
        with T.Kernel(B * splits) as bx:
            h = T.alloc_var("uint32")
            c = T.alloc_var("uint32")
            z = T.alloc_var("float32")
            best = T.alloc_var("float32")
            bi = T.alloc_var("int32")
            row = bx // splits
            chunk = (V + splits - 1) // splits
            h = T.uint32(s)
            for w in T.serial(4):  # row key: mix(mix(mix(mix(s ^ seed_lo) ^ seed_hi) ^ offset_lo) ^ offset_hi)
                h = h ^ _word(seeds[row], offsets[row], w)
                h = _mix1(h)
                h = _mix2(h)
                h = _mix3(h)
            best = T.float32(0.0)
            bi = -1
            for i in T.serial(chunk):
                v = (bx % splits) * chunk + i
                if v < V:
                    c = T.cast(v, "uint32") + T.uint32(_COL_ADD)
                    for m in T.serial(2):  # mix(mix(v + COL_ADD) ^ key)
                        c = _mix1(c)
                        c = _mix2(c)
                        c = _mix3(c) ^ T.if_then_else(m == 0, h, T.uint32(0))
                    # u = (2 * (bits >> 9) + 1) * 2**-24, Gumbel noise g = -log(-log(u)), race value logits / T + g
                    z = logits[row, v] / temperature[row] + -T.log(-T.log(
                        T.cast((c >> T.uint32(9)) * T.uint32(2) + T.uint32(1), "float32") * exact_f32(2.0**-24)))
                    if bi < 0 or z > best or (T.isnan(z) and not T.isnan(best)):
                        best = z
                        bi = v
            part_val[row, bx % splits] = best
            part_idx[row, bx % splits] = bi

    return gumbel_argmax


def build_greedy_argmax(splits: int = SPLITS):
    B = T.dynamic("B")
    V = T.dynamic("V")

    @T.prim_func
    def greedy_argmax(
        logits: T.Tensor([B, V], "float32"),
        part_val: T.Tensor([B, splits], "float32"),
        part_idx: T.Tensor([B, splits], "int32"),
    ):
        with T.Kernel(B * splits) as bx:
            z = T.alloc_var("float32")
            best = T.alloc_var("float32")
            bi = T.alloc_var("int32")
            row = bx // splits
            chunk = (V + splits - 1) // splits
            best = T.float32(0.0)
            bi = -1
            for i in T.serial(chunk):
                v = (bx % splits) * chunk + i
                if v < V:
                    z = logits[row, v]
                    if bi < 0 or z > best or (T.isnan(z) and not T.isnan(best)):
                        best = z
                        bi = v
            part_val[row, bx % splits] = best
            part_idx[row, bx % splits] = bi

    return greedy_argmax


def build_combine(splits: int = SPLITS):
    B = T.dynamic("B")

    @T.prim_func
    def argmax_combine(
        part_val: T.Tensor([B, splits], "float32"),
        part_idx: T.Tensor([B, splits], "int32"),
        ids: T.Tensor([B], "int32"),
    ):
        with T.Kernel(B) as bx:
            best = T.alloc_var("float32")
            bi = T.alloc_var("int32")
            best = T.float32(0.0)
            bi = -1
            for sp in T.serial(splits):  # splits hold increasing index ranges: the first best split wins ties
                if part_idx[bx, sp] >= 0:
                    if bi < 0 or part_val[bx, sp] > best or (T.isnan(part_val[bx, sp]) and not T.isnan(best)):
                        best = part_val[bx, sp]
                        bi = part_idx[bx, sp]
            ids[bx] = bi

    return argmax_combine


# ---- references ---------------------------------------------------------------------------------------------
def reference_uniform(seeds, offsets, vocab: int, stream: int) -> torch.Tensor:
    from deepinfer_npu.sampling.rng import hash_uniform

    return hash_uniform(seeds, offsets, vocab, stream=stream, dtype=torch.float32)


def reference_gumbel_argmax(logits, temperature, seeds, offsets, stream: int) -> torch.Tensor:
    """As backends/cpu/sampling.py: ``(logits / T + gumbel_noise).argmax(-1)`` (with the given stream)."""
    u = reference_uniform(seeds, offsets, logits.shape[1], stream)
    return (logits / temperature[:, None] + -torch.log(-torch.log(u))).argmax(dim=-1)


def ci_lower(splits: int = SPLITS) -> dict[str, str]:
    return {
        "hash_uniform": lower_ascend(build_hash_uniform(0)),
        "gumbel_argmax": lower_ascend(build_gumbel_argmax(0, splits)),
        "greedy_argmax": lower_ascend(build_greedy_argmax(splits)),
        "argmax_combine": lower_ascend(build_combine(splits)),
    }


def _seeds(g: torch.Generator, b: int) -> torch.Tensor:
    s = torch.randint(-(2**62), 2**62, (b,), generator=g, dtype=torch.int64) * 2  # both halves, negative seeds
    s[0] = -(2**63)
    return s


def check(seed: int = 0, splits: int = 4) -> bool:
    g = torch.Generator().manual_seed(seed)
    hu = {st: compile_c(build_hash_uniform(st)) for st in (0, 1)}
    ga, gr = compile_c(build_gumbel_argmax(2, splits)), compile_c(build_greedy_argmax(splits))
    comb = compile_c(build_combine(splits))
    ok = True
    for b, v in ((1, 3), (5, 97), (17, 1000)):
        seeds, offs = _seeds(g, b), torch.randint(0, 2**40, (b,), generator=g, dtype=torch.int64)
        for st, k in hu.items():  # the noise itself: bit for bit
            u = torch.empty(b, v)
            k(seeds, offs, u)
            ok &= torch.equal(u, reference_uniform(seeds, offs, v, st))
        logits = torch.randn(b, v, generator=g) * 4
        logits[:, ::7] = float("-inf")  # filtered tokens
        logits[0, -1] = logits[0].max()  # an exact tie: the lower id wins
        temp = torch.rand(b, generator=g) + 0.3
        pv, pi = torch.empty(b, splits), torch.empty(b, splits, dtype=torch.int32)
        ids = torch.empty(b, dtype=torch.int32)
        ga(logits, temp, seeds, offs, pv, pi)
        comb(pv, pi, ids)
        ok &= torch.equal(ids.long(), reference_gumbel_argmax(logits, temp, seeds, offs, 2))
        tie = torch.randint(0, 3, (b, v), generator=g).float()  # many ties
        tie[b // 2, v // 2] = float("nan")
        gr(tie, pv, pi)
        comb(pv, pi, ids)
        ok &= torch.equal(ids.long(), tie.argmax(dim=-1))
    return bool(ok)
