"""Adapters for DeepSeek's optional CUDA libraries (FlashMLA, DeepGEMM, DeepEP), used only when the user built them.

Each adapter probes its library by import name (:func:`probe` -> ``VendorStatus``) and wraps its published Python
API in the engine's tensor layouts. No third-party code lives here; README.md says how to build each library and
what runs without it.
"""

from __future__ import annotations

from . import deep_ep, deep_gemm, flash_mla
from .status import VendorStatus

ADAPTERS = (flash_mla, deep_gemm, deep_ep)


def report() -> dict[str, str]:
    """``{library: "found (...)" | "not found (...); fallback: ..."}`` for ``--list-ops``."""
    return {a.NAME: a.probe().describe(a.FALLBACK) for a in ADAPTERS}


__all__ = ["ADAPTERS", "VendorStatus", "deep_ep", "deep_gemm", "flash_mla", "report"]
