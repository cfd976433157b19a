"""Per-request generation parameters, mirroring vLLM's ``SamplingParams``.

Only the parameters the engine implements are accepted; every one is validated at construction (ranges follow
vLLM's ``SamplingParams._verify_args``) and an invalid value raises :class:`ValueError` whose message names
the parameter and the allowed range.

Semantics (as in vLLM):

* ``temperature == 0`` (anything below ``1e-5``) means greedy decoding: ``top_k`` / ``top_p`` are then reset
  to "disabled" and ``seed`` is irrelevant.
* ``top_k``: ``-1`` or ``0`` disables it (normalised to ``0``); otherwise the ``top_k`` most likely tokens are
  kept.
* ``top_p`` in ``(0, 1]``; ``1`` disables it. Top-k is applied first, then top-p on the renormalised
  distribution.
* ``seed``: per-request seed; the same seed, prompt and parameters give the same tokens. Requests without a
  seed get one drawn from the engine's generator when they are added (see
  :func:`deepinfer_npu.sampling.new_request_seed`), so a whole run is reproducible from ``LLM(seed=...)``.
* ``stop``: strings that end generation when they appear in the output text; the text is truncated before the
  stop string unless ``include_stop_str_in_output``. ``stop_token_ids``: tokens that end generation (the token
  is kept in ``token_ids``; its text is dropped unless ``include_stop_str_in_output``).
* ``min_tokens``: no stop (EOS, stop token, stop string) is honoured before this many tokens were generated.
* ``max_tokens``: the generation length limit (``None`` = limited only by the model's ``max_model_len``).
* ``logprobs``: ``None`` for none; ``k`` in ``0..20`` returns, per generated token, the log-probabilities of
  the ``k`` most likely tokens plus the sampled one (of the raw model distribution, temperature 1, before
  top-k/top-p).
* ``n``: number of completions per prompt. Validated here (``n >= 1``); whether ``n > 1`` is served is up to
  the engine (forked sequences), which raises if it does not support it.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SamplingParams", "SAMPLING_EPS", "MAX_LOGPROBS"]

#: Temperatures below this are treated as greedy decoding (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
#: Largest accepted ``logprobs`` value (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


def _as_int(name: str, value: Any, allowed: str) -> int:
    """Return ``value`` as a Python int, rejecting bools, floats and other non-integers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer ({allowed}), got {value!r}")
    return int(value)


def _as_float(name: str, value: Any, allowed: str) -> float:
    """Return ``value`` as a finite Python float, rejecting bools and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number ({allowed}), got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite ({allowed}), got {value!r}")
    return v


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM-compatible names and defaults).

    Construct with keywords, e.g. ``SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=1)``.
    Validation and normalisation happen in ``__post_init__``; mutate the fields afterwards only if you call
    :meth:`verify` again.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    #: Free-form per-request data for the caller; not interpreted by the engine.
    extra_args: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.verify()

    # ------------------------------------------------------------------ validation
    def verify(self) -> None:
        """Validate and normalise every field; raises ``ValueError`` naming the offending parameter."""
        self.n = _as_int("n", self.n, "n >= 1")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens, "max_tokens >= 1 or None")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}")

        self.min_tokens = _as_int("min_tokens", self.min_tokens, "0 <= min_tokens <= max_tokens")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )

        self.temperature = _as_float("temperature", self.temperature, "temperature >= 0; 0 means greedy")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative (0 means greedy), got {self.temperature}")

        self.top_k = _as_int("top_k", self.top_k, "-1 or 0 to disable, otherwise >= 1")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        self.top_p = _as_float("top_p", self.top_p, "0 < top_p <= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        if self.seed is not None:
            self.seed = _as_int("seed", self.seed, "an integer or None")

        self.stop = self._verify_stop(self.stop)
        self.stop_token_ids = self._verify_stop_token_ids(self.stop_token_ids)

        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = _as_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)

        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs, f"None or 0..{MAX_LOGPROBS}")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be None or in 0..{MAX_LOGPROBS}, got {self.logprobs}")

        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")

        if self.is_greedy:
            # As vLLM: greedy ignores the filters; normalise them so the sampler sees "disabled".
            self.top_k = 0
            self.top_p = 1.0

    @staticmethod
    def _verify_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string, a list of strings or None, got {type(stop).__name__}")
        out: list[str] = []
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if s == "":
                raise ValueError("stop cannot contain an empty string")
            out.append(s)
        return out

    @staticmethod
    def _verify_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
        out: list[int] = []
        for t in ids:
            v = _as_int("stop_token_ids", t, "a list of non-negative integers")
            if v < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {v}")
            out.append(v)
        return out

    # ------------------------------------------------------------------ checks
    @property
    def is_greedy(self) -> bool:
        """True when decoding is greedy (``temperature < 1e-5``)."""
        return self.temperature < SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        """The explicit stop token ids as a set (EOS ids are added by the stop checker, not here)."""
        return set(self.stop_token_ids or ())

    def clone(self) -> SamplingParams:
        """A deep copy (the engine clones before filling per-request defaults)."""
        return copy.deepcopy(self)
