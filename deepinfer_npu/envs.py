"""Every ``DEEPINFER_*`` environment variable the engine reads, typed and documented in one place.

Values are read when asked for (``envs.DISABLE_SYNC_GUARD``), not at import, so tests and launchers can set them
late. A malformed value raises ``ValueError`` naming the variable. Nothing else in the package calls
``os.environ`` for a ``DEEPINFER_*`` name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    parse: Callable[[str, str], Any]
    doc: str


def _flag(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return raw == "1"


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive integer")
    return value


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(allowed)}")
        return value

    return parse


def _count_or_auto(name: str, raw: str) -> int | None:
    value = raw.strip().lower()
    if value == "auto":
        return None
    if not value.isdigit():
        raise ValueError(f"{name}={raw!r}: expected auto or a count >= 0")
    return int(value)


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise ValueError(f"{name}={raw!r}: expected seconds >= 0")
    return value


def _path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _text(name: str, raw: str) -> str:
    return raw.strip()


_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("DEEPINFER_DISABLE_SYNC_GUARD", "0", _flag,
               "1 turns off the launch-path guard that makes an implicit host-device sync an error (debugging)."),
        EnvVar("DEEPINFER_CUDA_SYNC_DEBUG", "", _choice("", "error", "warn", "off"),
               "Overrides torch's CUDA sync-debug mode on the launch path: error | warn | off (debugging)."),
        EnvVar("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL", "8", _positive_int,
               "Decode graph sizes (total query tokens): powers of two below this interval, then every interval."),
        EnvVar("DEEPINFER_CACHE_DIR", str(Path.home() / ".cache" / "deepinfer_npu"), _path,
               "Where the engine caches measured data (the varlen step-time curve) and built kernel functions."),
        EnvVar("DEEPINFER_BENCH_COMMIT", "", _text,
               "The commit benchmark rows name, for a copy of the sources whose git metadata is absent or stale; "
               "empty: asked from git."),
        EnvVar("DEEPINFER_CPU_THREADS", "1", _positive_int,
               "Intra-op threads of the CPU backend (one is fastest for reference-sized models)."),
        EnvVar("DEEPINFER_COMPILE_WORKERS", "auto", _count_or_auto,
               "Processes the CUDA kernel warm-up builds in at start-up: auto (one a usable core, at most "
               "16) or a count (0 or 1: one at a time, e.g. several engines starting on one host)."),
        EnvVar("DEEPINFER_ROUTER_TENSOR_CORES", "1", _flag,
               "1 (the default): the CUDA backend's MoE router past 16 rows runs as bf16 tensor-core GEMMs of its "
               "fp32 weight's exact bf16 split, fp32 out; 0: the rows cast to fp32 and cuBLAS' fp32 GEMM."),
        EnvVar("DEEPINFER_MOE_SWAP_MAX_ROWS", "auto", _count_or_auto,
               "The CUDA backend's bf16 routed experts run on moe_gemm_swap (the SwiGLU in the w13 GEMM's epilogue) "
               "up to this many dispatched rows a step (tokens x top-k), on moe_gemm + silu_mul above it up to 2048 "
               "rows, and on torch._grouped_mm past those; auto: 20 rows an expert on average (docs/kernels/"
               "moe_gemm_swap.md), 0: never."),
        EnvVar("DEEPINFER_MOE_GEMM_GATED", "1", _flag,
               "1 (the default): past moe_gemm_swap's rows, the CUDA backend's bf16 routed experts run the w13 "
               "moe_gemm with the SwiGLU in its epilogue (no silu_mul launch); 0: moe_gemm, then silu_mul."),
        EnvVar("DEEPINFER_FUSED_A_PROJ", "1", _flag,
               "1 (the default): the CUDA backend runs the MLA query's projection and kv_a as one GEMM in every "
               "decode step of a model without q-LoRA (one row: one skinny_gemm launch); 0: one-row steps only, "
               "two GEMMs on two streams at more rows."),
        EnvVar("DEEPINFER_FP8_SKINNY", "1", _flag,
               "1 (the default): in FP8 models the CUDA backend runs one-row projections (and dense MLPs) whose "
               "weights hold at most 12 M values on fp8_skinny_gemm (the activations' quantisation inside the GEMM, "
               "one launch); 0: fp8_quant then the FP8 GEMMs, as at more rows (docs/kernels/fp8.md)."),
        EnvVar("DEEPINFER_PDL_OFF", "none", _text,
               "CUDA kernels built without programmatic dependent launch (PDL: a kernel's launch overlaps the "
               "previous kernel's end): comma-separated kernel-name prefixes (e.g. fp8), all, or none (the "
               "default: every TileLang kernel with PDL) (kernels_cuda/_pdl.py, docs/kernels/pdl.md)."),
        EnvVar("DEEPINFER_STEP_TIMEOUT", "600", _seconds,
               "Seconds a step may keep the host waiting for the device before the process logs the step, prints "
               "its threads' stacks and exits with code 70 (a kernel that never ends; worker/step_watchdog.py); "
               "0: wait forever. Above distributed_timeout_s' 300 s default, so a lost rank is named first."),
        EnvVar("DEEPINFER_ASCEND_PROFILE", "", _text,
               "Forces the Ascend capability profile (e.g. a2_a3); empty: detected from the chip."),
    )
}


def get(name: str) -> Any:
    """The parsed value of ``name`` (its default when unset or empty)."""
    var = _VARS[name]
    raw = os.environ.get(name, "")
    return var.parse(name, raw if raw.strip() else var.default)


def names() -> list[str]:
    return sorted(_VARS)


def describe() -> dict[str, str]:
    """name -> documentation, for ``--help`` texts and docs."""
    return {name: var.doc for name, var in sorted(_VARS.items())}


def __getattr__(attr: str) -> Any:
    # envs.CPU_THREADS reads DEEPINFER_CPU_THREADS now.
    name = f"DEEPINFER_{attr}"
    if name in _VARS:
        return get(name)
    raise AttributeError(f"module 'deepinfer_npu.envs' has no attribute {attr!r}")
