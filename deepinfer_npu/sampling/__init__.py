"""Sampling metadata and the counter-based hash RNG shared by all backends.

Tokens are drawn by the ``spec_verify`` op (a row without drafts is a plain sample; the reference sampler is
``backends/cpu/sampling.py``); this package holds what every backend and the engine share: :class:`SamplingTensors`
/ :class:`SamplerOutput` and the RNG.
"""

from deepinfer_npu.sampling.metadata import (
    LogprobsTensors,
    SamplerOutput,
    SamplingTensors,
    min_tokens_banned_ids,
)
from deepinfer_npu.sampling.rng import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    derive_seed,
    hash_uniform,
    hash_uniform_cols,
    hash_uniform_py,
    new_request_seed,
    seed_to_int64,
)

__all__ = [
    "LogprobsTensors",
    "SamplerOutput",
    "SamplingTensors",
    "min_tokens_banned_ids",
    "STREAM_ACCEPT",
    "STREAM_RESIDUAL",
    "STREAM_SAMPLE",
    "derive_seed",
    "hash_uniform",
    "hash_uniform_cols",
    "hash_uniform_py",
    "new_request_seed",
    "seed_to_int64",
]
