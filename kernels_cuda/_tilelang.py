"""``tilelang`` and its language module ``T`` when tilelang is importable, else None: importing a kernel module (its
host-side checks and configuration functions) needs no tilelang; building or launching a kernel does."""

try:
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover - exercised where tilelang is absent
    tilelang = None
    T = None

__all__ = ["T", "tilelang"]
