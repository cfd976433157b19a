"""Shared TileLang plumbing: lowering to AscendC and compiling the same program for the host C target."""

from __future__ import annotations

import struct
from typing import Any

try:
    import tilelang
    import tilelang.language as T
    from tvm.target import Target
except Exception:  # pragma: no cover - tilelang is optional (tests skip without it)
    tilelang = None
    T = None
    Target = None


def require() -> None:
    if tilelang is None:
        raise RuntimeError("tilelang is not installed (pip install tilelang==0.1.15)")


def lower_ascend(func: Any) -> str:
    """AscendC source for ``func`` (tilelang 0.1.15 needs a Target context around ``lower``)."""
    require()
    with Target({"kind": "ascend"}):
        return tilelang.lower(func, target="ascend").kernel_source


def compile_c(func: Any) -> Any:
    """The same program built for the host (target "c"): a callable taking torch CPU tensors."""
    require()
    return tilelang.compile(func, target="c")


def exact_f32(value: float) -> Any:
    """An fp32 constant that survives both code generators bit for bit: the host C codegen prints float literals
    with 7 significant digits (``2**-24`` becomes ``5.960464e-08f``, 1 ulp low), so the value enters as its
    ``uint32`` bit pattern reinterpreted as fp32 (the AscendC codegen's hex literals would be exact anyway)."""
    require()
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return T.reinterpret(T.uint32(bits), "float32")
