"""Shared TileLang plumbing: lowering to AscendC and compiling the same program for the host C target."""

from __future__ import annotations

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
