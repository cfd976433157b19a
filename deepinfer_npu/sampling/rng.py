"""Counter-based hash RNG shared by every backend.

Random numbers are a pure function of ``(seed, offset, column, stream)``:

* ``seed``   — the request's 64-bit seed (``SamplingParams.seed`` or one drawn by the engine at add time);
* ``offset`` — the output position of the token being sampled (0 for the first generated token), so a token's
  noise does not depend on batching, step boundaries, preemption/recompute or speculative decoding;
* ``column`` — the vocabulary index (or any per-row index);
* ``stream`` — separates independent uses (see ``STREAM_*``).

The hash works on 32-bit lanes carried in ``int64`` tensors and only uses ``&``, ``^``, ``>>``, ``+`` and
multiplications whose products stay below 2**49, so it is exact — bit-identical — on any torch device (CPU,
CUDA, Ascend) without relying on integer overflow. The mixer is Chris Wellons' ``lowbias32`` (a bijection of
32-bit integers with low avalanche bias).

Uniforms have 23 random bits: ``u = (2k + 1) / 2**24`` with ``k`` in ``[0, 2**23)``, so ``0 < u < 1`` and
every value is exactly representable in float32 (hence equal in float32 and float64). :func:`hash_uniform_py`
is the scalar pure-Python specification the tensor code is tested against.

Algorithm (all values mod 2**32)::

    s    = stream * 0x9E3779B9 + 0x7F4A7C15                                  # per row:
    h    = mix(seed_lo ^ s); h = mix(h ^ seed_hi); h = mix(h ^ offset_lo)
    key  = mix(h ^ offset_hi)
    bits = mix(key ^ mix(column + 0x632BE5AB))                               # per element
    u    = (2 * (bits >> 9) + 1) / 2**24

Per element this is one ``mix`` (the column hash is shared by all rows), done in place: on the CPU about
0.2 s for 64 x 129280 uniforms on two cores.
"""

from __future__ import annotations

import random

import torch

__all__ = [
    "STREAM_SAMPLE",
    "STREAM_ACCEPT",
    "STREAM_RESIDUAL",
    "hash_uniform",
    "hash_uniform_cols",
    "hash_uniform_py",
    "lowbias32",
    "new_request_seed",
    "derive_seed",
    "seed_to_int64",
]

#: Stream of the main sampler's Gumbel noise.
STREAM_SAMPLE = 0
#: Stream for the rejection sampler's per-draft acceptance uniforms (speculative decoding).
STREAM_ACCEPT = 1
#: Stream for the rejection sampler's resampling from the residual distribution.
STREAM_RESIDUAL = 2

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
_STREAM_ADD = 0x7F4A7C15
_COL_ADD = 0x632BE5AB
_H2_XOR = 0x85EBCA6B
_INV_2_24 = 2.0**-24


# ---------------------------------------------------------------------------------------------- scalar spec
def _mul32_py(x: int, c: int) -> int:
    return (x * c) & _M32


def _mix_py(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = _mul32_py(x, _C1)
    x ^= x >> 15
    x = _mul32_py(x, _C2)
    x ^= x >> 16
    return x


def hash_uniform_py(seed: int, offset: int, column: int, stream: int = 0) -> float:
    """Scalar pure-Python specification of :func:`hash_uniform` (slow; for tests and documentation)."""
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    s = (stream * _GOLDEN + _STREAM_ADD) & _M32
    h = _mix_py((seed & _M32) ^ s)
    h = _mix_py(h ^ (seed >> 32))
    h = _mix_py(h ^ (offset & _M32))
    key = _mix_py(h ^ (offset >> 32))
    bits = _mix_py(key ^ _mix_py(column + _COL_ADD))
    return (2 * (bits >> 9) + 1) * _INV_2_24


# ---------------------------------------------------------------------------------------------- tensor code
def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """In place: ``x = (x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, via 16-bit limbs so every
    intermediate stays below 2**49 (no reliance on integer overflow)."""
    hi = x >> 16
    hi.mul_(c).bitwise_and_(_M16).bitwise_left_shift_(16)
    return x.bitwise_and_(_M16).mul_(c).add_(hi).bitwise_and_(_M32)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """In-place ``lowbias32`` on 32-bit values held in an int64 tensor."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, _C1)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, _C2)
    return x.bitwise_xor_(x >> 16)


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The ``lowbias32`` integer hash on 32-bit values held in an int64 tensor (values in ``[0, 2**32)``)."""
    return _lowbias32_(x.to(torch.int64, copy=True))


def _row_keys(seeds: torch.Tensor, offsets: torch.Tensor, stream: int) -> torch.Tensor:
    """Per-row key [B] from int64 seeds / offsets (two's complement 64-bit values)."""
    seeds = seeds.to(torch.int64)
    offsets = offsets.to(torch.int64)
    s = (int(stream) * _GOLDEN + _STREAM_ADD) & _M32
    h = _lowbias32_((seeds & _M32) ^ s)
    h = _lowbias32_(h ^ ((seeds >> 32) & _M32))  # arithmetic shift, then mask: the high 32 bits
    h = _lowbias32_(h ^ (offsets & _M32))
    return _lowbias32_(h ^ ((offsets >> 32) & _M32))


def _bits_to_uniform(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # 2k+1 < 2**24 is exact in float32; scaling by a power of two is exact too.
    return bits.bitwise_right_shift_(9).mul_(2).add_(1).to(dtype).mul_(_INV_2_24)


def hash_uniform_cols(
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    cols: torch.Tensor,
    stream: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniforms in ``(0, 1)`` for chosen columns: ``out[b, j] = U(seeds[b], offsets[b], cols[b, j], stream)``.

    Args:
        seeds, offsets: int64 ``[B]``.
        cols: int64 ``[B, K]`` or ``[K]`` (broadcast over rows), values in ``[0, 2**32)``.
        stream: one of ``STREAM_*`` (any int in ``[0, 2**32)``).
        dtype: float32 or float64; the values are identical in both.
    """
    key = _row_keys(seeds, offsets, stream)
    cols = cols.to(device=key.device, dtype=torch.int64)
    if cols.dim() == 1:
        cols = cols.unsqueeze(0)
    col_hash = _lowbias32_((cols + _COL_ADD) & _M32)
    bits = _lowbias32_(key[:, None] ^ col_hash)
    return _bits_to_uniform(bits, dtype)


def hash_uniform(
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    vocab_size: int,
    stream: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniforms in ``(0, 1)`` of shape ``[B, vocab_size]``: column ``j`` of row ``b`` is
    ``U(seeds[b], offsets[b], j, stream)`` (see the module docstring); on the device of ``seeds``."""
    cols = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    return hash_uniform_cols(seeds, offsets, cols, stream=stream, dtype=dtype)


# ---------------------------------------------------------------------------------------------- seeds
def seed_to_int64(seed: int) -> int:
    """Map any Python int to the signed int64 with the same low 64 bits (how seeds enter tensors)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def new_request_seed(rng: random.Random) -> int:
    """A seed for a request that has none, drawn from the engine's generator at ``add_request`` time.

    The engine owns ``rng = random.Random(LLM(seed=...))`` so a whole run is reproducible; the drawn seed is
    stored with the request and used for every token (and survives preemption / recompute).
    """
    return rng.getrandbits(63)


def derive_seed(seed: int, index: int) -> int:
    """A distinct, deterministic 63-bit seed for completion ``index`` of a request with ``n > 1`` (forks)."""
    if index == 0:
        return seed
    lo = _mix_py((seed & _M32) ^ _mix_py(index + _GOLDEN))
    hi = _mix_py(((seed >> 32) & _M32) ^ _mix_py(lo + _H2_XOR))
    return ((hi & 0x7FFFFFFF) << 32) | lo
